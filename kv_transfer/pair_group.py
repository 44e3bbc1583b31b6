"""One 2-rank process group per (sender, receiver) pair, built from the receiver's TCPStore.

Rendezvous (all keys under `kvx/<sender>/<receiver>/` in the receiver's store):
- the sender proposes generation g = `add("gen", 1)` and builds rank 0 over prefix `g<g>`;
  if that fails it sets `dead/<g>` so the receiver never joins it;
- the receiver, when it has transfers waiting, joins the newest live generation as rank 1, and
  rejoins whenever the sender proposes a newer one (the sender tore its side down).
No global group and no `init_process_group`: every pair is independent of every other.
"""
from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from kv_transfer.base import TransferError

log = logging.getLogger(__name__)


def pair_key(sender_id: str, receiver_id: str) -> str:
    return f"kvx/{sender_id}/{receiver_id}"


def _new_group(store: dist.Store, rank: int, timeout: datetime.timedelta, device: torch.device) -> dist.ProcessGroup:
    if device.type == "cuda":  # untested here (no GPU): same protocol, NCCL transport
        if not hasattr(dist, "ProcessGroupNCCL"):
            raise TransferError("the KV pool is on CUDA but this torch build has no NCCL")
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, 2, opts)
    return dist.ProcessGroupGloo(store, rank, 2, timeout)


class PairGroup:
    """One side of a pair: the store client, the current group and its generation.

    Args:
        key: `pair_key(sender, receiver)`.
        rank: 0 on the sender, 1 on the receiver.
        store: the receiver's TCPStore (client on the sender, the master itself on the receiver).
        timeout_s: set-up and per-message timeout.
        device: the pool's device (picks gloo or NCCL).
    """

    def __init__(self, key: str, rank: int, store: dist.Store, timeout_s: float, device: torch.device) -> None:
        assert rank in (0, 1)
        self.key, self.rank, self.store, self.device = key, rank, store, device
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.group: dist.ProcessGroup | None = None
        self.gen = 0  # generation of `group`, or the last one tried

    def _build(self, gen: int) -> None:
        prefixed = dist.PrefixStore(f"{self.key}/g{gen}", self.store)
        self.group = _new_group(prefixed, self.rank, self.timeout, self.device)
        self.gen = gen
        log.info("pair %s: rank %d joined generation %d", self.key, self.rank, gen)

    def connect_sender(self) -> None:
        """Sender: propose a new generation and build it; on failure mark it dead and raise."""
        assert self.rank == 0 and self.group is None
        gen = self.store.add(f"{self.key}/gen", 1)
        try:
            self._build(gen)
        except Exception as e:
            self.store.set(f"{self.key}/dead/{gen}", "1")
            self.gen = gen
            raise TransferError(f"pair {self.key}: receiver did not join within {self.timeout}: {e}") from e

    def newest_gen(self) -> int:
        return self.store.add(f"{self.key}/gen", 0)

    def stale(self) -> bool:
        """Receiver: the sender has proposed a newer generation than ours."""
        return self.group is not None and self.newest_gen() > self.gen

    def connect_receiver(self, keep_waiting: Callable[[], bool]) -> None:
        """Receiver: wait for the sender's newest live proposal and join it.

        Args:
            keep_waiting: polled while no proposal is there; False stops waiting (raises).
        """
        assert self.rank == 1
        self.teardown()
        deadline = time.monotonic() + self.timeout.total_seconds()
        while True:
            gen = self.newest_gen()
            if gen > self.gen and not self.store.check([f"{self.key}/dead/{gen}"]):
                self._build(gen)
                return
            if time.monotonic() > deadline:
                raise TransferError(f"pair {self.key}: no sender proposed a group within {self.timeout}")
            if not keep_waiting():
                raise TransferError(f"pair {self.key}: stopped waiting for the sender")
            time.sleep(0.01)

    def send(self, tensor: torch.Tensor) -> None:
        assert self.group is not None and self.rank == 0
        self.group.send([tensor], 1, 0).wait(self.timeout)

    def recv(self, tensor: torch.Tensor) -> None:
        assert self.group is not None and self.rank == 1
        self.group.recv([tensor], 0, 0).wait(self.timeout)

    def teardown(self) -> None:
        """Drop the group (its connections close; the peer's pending ops fail). Keeps the generation."""
        if self.group is not None:
            log.info("pair %s: rank %d leaves generation %d", self.key, self.rank, self.gen)
            if self.rank == 0:
                try:
                    self.store.set(f"{self.key}/dead/{self.gen}", "1")
                except Exception:  # store gone with the receiver
                    pass
        self.group = None
