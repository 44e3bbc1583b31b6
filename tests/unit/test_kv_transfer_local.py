"""kv_transfer: config validation, factory, and the in-process backend."""
from __future__ import annotations

import pytest
import torch

from kv_transfer import PeerInfo, TransferConfig, TransferError, TransferState, make_connector
from kv_transfer.local import LocalConnector
from kv_transfer.torch_dist import TorchDistConnector

SHAPE = (5, 2, 3, 12, 4, 8)  # layers, k/v, kv heads, blocks, block size, head dim


@pytest.fixture
def pair() -> tuple[LocalConnector, LocalConnector, torch.Tensor, torch.Tensor]:
    cfg = TransferConfig(backend="local")
    src, dst = make_connector(cfg, "p0"), make_connector(cfg, "d0")
    a, b = torch.randn(SHAPE), torch.zeros(SHAPE)
    src.register(a)
    dst.register(b)
    yield src, dst, a, b
    src.close()
    dst.close()


def test_round_trip_into_other_blocks_and_states(pair) -> None:
    src, dst, a, b = pair
    dst.recv("r1", [9, 2, 4], SHAPE[0], src.local_info())
    assert dst.poll("r1") == TransferState.PENDING
    for layer in range(SHAPE[0]):
        src.send("r1", layer, [0, 5, 7], dst.local_info())
        want = TransferState.DONE if layer == SHAPE[0] - 1 else TransferState.TRANSFERRING
        assert dst.poll("r1") == want
    assert src.poll("r1") == TransferState.DONE
    assert torch.equal(b[:, :, :, [9, 2, 4]], a[:, :, :, [0, 5, 7]])
    untouched = [i for i in range(SHAPE[3]) if i not in (9, 2, 4)]
    assert not b[:, :, :, untouched].any()


def test_abort_fails_and_writes_nothing_more(pair) -> None:
    src, dst, _, b = pair
    dst.recv("r2", [1, 3], SHAPE[0], src.local_info())
    src.send("r2", 0, [0, 1], dst.local_info())
    dst.abort("r2")
    before = b.clone()
    for layer in range(1, SHAPE[0]):
        src.send("r2", layer, [0, 1], dst.local_info())
    assert dst.poll("r2") == TransferState.FAILED
    assert src.poll("r2") == TransferState.FAILED
    assert torch.equal(b, before)


def test_send_without_recv_fails_and_unknown_poll_raises(pair) -> None:
    src, dst, _, _ = pair
    src.send("r3", 0, [0], dst.local_info())
    assert src.poll("r3") == TransferState.FAILED
    with pytest.raises(TransferError, match="unknown transfer"):
        dst.poll("nope")


def test_user_errors(pair) -> None:
    src, dst, _, _ = pair
    with pytest.raises(ValueError, match="block ids must be in"):
        dst.recv("r4", [99], 1, src.local_info())
    with pytest.raises(ValueError, match="num_layers"):
        dst.recv("r4", [1], 0, src.local_info())
    with pytest.raises(ValueError, match="kv_pool must be"):
        src.register(torch.zeros(3, 4))
    with pytest.raises(ValueError, match="already open"):
        make_connector(TransferConfig(backend="local"), "p0")
    with pytest.raises(TransferError, match="register"):
        make_connector(TransferConfig(backend="local"), "x").send("t", 0, [0], PeerInfo("d0"))


def test_state_is_ordered() -> None:
    assert TransferState.FAILED < TransferState.PENDING < TransferState.TRANSFERRING < TransferState.DONE


@pytest.mark.parametrize("kwargs, field", [
    ({"backend": "nccl"}, "backend must be one of"),
    ({"timeout_s": 0}, "timeout_s must be > 0"),
    ({"host": ""}, "host must be"),
    ({"port": 70000}, "port must be in"),
])
def test_config_validation(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        TransferConfig(**kwargs)


def test_factory_picks_backend() -> None:
    assert TransferConfig().backend == "torch_dist"
    local = make_connector(TransferConfig(backend="local"), "f-local")
    dist = make_connector(TransferConfig(), "f-dist")
    try:
        assert isinstance(local, LocalConnector) and isinstance(dist, TorchDistConnector)
    finally:
        local.close()
        dist.close()
    with pytest.raises(ValueError, match="worker_id"):
        make_connector(TransferConfig(), "")


def test_forget_drops_finished_transfers_only(pair) -> None:
    src, dst, _, _ = pair
    dst.recv("r5", [1], SHAPE[0], src.local_info())
    dst.forget("r5")  # still pending: kept
    assert dst.poll("r5") == TransferState.PENDING
    for layer in range(SHAPE[0]):
        src.send("r5", layer, [0], dst.local_info())
    for conn in (src, dst):
        assert conn.poll("r5") == TransferState.DONE
        conn.forget("r5")
        with pytest.raises(TransferError, match="unknown transfer"):
            conn.poll("r5")
        conn.forget("r5")  # idempotent; unknown ids are ignored
