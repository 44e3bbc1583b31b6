"""The gloo connector wakes the worker waiting for a transfer as it settles, on both sides, so a worker
whose KV is in flight sleeps instead of polling (two connectors in one process, real gloo pairs)."""
from __future__ import annotations

import threading

import pytest
import torch

from kv_transfer import TransferConfig, TransferState, make_connector

SHAPE = (4, 2, 3, 12, 4, 8)  # layers, k/v, kv heads, blocks, block size, head dim


class Waker:
    """Counts wakes; `wait` returns once one came after the last `wait`."""

    def __init__(self) -> None:
        self.calls = 0
        self._event = threading.Event()

    def __call__(self) -> None:
        self.calls += 1
        self._event.set()

    def wait(self, timeout_s: float = 30.0) -> bool:
        woken = self._event.wait(timeout_s)
        self._event.clear()
        return woken


@pytest.fixture
def gloo_pair():
    cfg = TransferConfig(backend="torch_dist", host="127.0.0.1", timeout_s=3.0)  # bounds the teardown after a broken pair
    src, dst = make_connector(cfg, "p-wake"), make_connector(cfg, "d-wake")
    a, b = torch.randn(SHAPE), torch.zeros(SHAPE)
    src.register(a)
    dst.register(b)
    wakes = Waker(), Waker()
    src.set_waker(wakes[0])
    dst.set_waker(wakes[1])
    yield src, dst, a, b, wakes
    src.close()
    dst.close()


def test_both_sides_are_woken_when_a_transfer_lands(gloo_pair) -> None:
    src, dst, a, b, (src_woken, dst_woken) = gloo_pair
    assert src.wakes_owner and dst.wakes_owner
    dst.recv("r1", [9, 2, 4], SHAPE[0], src.local_info())
    for layer in range(SHAPE[0]):
        src.send("r1", layer, [0, 5, 7], dst.local_info())
    assert dst_woken.wait()
    assert dst.poll("r1") == TransferState.DONE  # woken once, when the last layer landed
    assert dst_woken.calls == 1
    assert src_woken.wait()
    deadline = 100
    while src.poll("r1") != TransferState.DONE and deadline:  # the sender may be woken between layers
        assert src_woken.wait()
        deadline -= 1
    assert torch.equal(b[:, :, :, [9, 2, 4]], a[:, :, :, [0, 5, 7]])


def test_the_receiver_is_woken_when_a_transfer_fails(gloo_pair) -> None:
    src, dst, _, b, (_, dst_woken) = gloo_pair
    dst.recv("r2", [1, 2], SHAPE[0], src.local_info())
    src.send("r2", 0, [0, 5, 7], dst.local_info())  # three blocks where two were reserved
    assert dst_woken.wait()
    assert dst.poll("r2") == TransferState.FAILED
    assert not b.any()  # nothing of it was written
