"""The KV connector interface: moves one request's KV blocks, layer by layer, between two workers.

Sender side (prefill worker): `register(pool)`, then `send(...)` once per layer as each layer is
ready, then `poll(...)` until DONE before freeing its blocks. Receiver side (decode worker):
`register(pool)`, reserve blocks, `recv(...)` once for all layers, `poll(...)` until DONE before
the sequence may run. The receiver's `poll` is authoritative for whether the KV landed.
Both sides use the same transfer id (the request id).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum

import torch

from kv_transfer.layers import check_pool


class TransferState(IntEnum):
    """Ordered: `state >= TransferState.TRANSFERRING` means the transfer has started."""

    FAILED = 0
    PENDING = 1
    TRANSFERRING = 2
    DONE = 3


class TransferError(RuntimeError):
    """A transfer or a connector call could not proceed; the message says what and why."""


@dataclass(frozen=True)
class PeerInfo:
    """How to reach a worker's connector; small and picklable, passed in ordinary Ray calls.

    Args:
        worker_id: unique id of the worker (also keys per-pair state).
        host: address of the rendezvous this worker hosts (receivers); "" when none.
        port: port of that rendezvous; 0 when none.
    """

    worker_id: str
    host: str = ""
    port: int = 0


class KVConnector(ABC):
    """Moves KV blocks of a paged pool `[layers, 2, kv_heads, num_blocks, block_size, head_dim]`.

    Each layer travels as one contiguous `[2, kv_heads, n, block_size, head_dim]` buffer and lands
    in the receiver's own reserved block ids (which differ from the sender's).
    """

    worker_id: str
    pool: torch.Tensor | None = None
    wakes_owner = False  # whether this backend calls `set_waker`'s callback (if not, its owner polls)
    _waker: Callable[[], None] | None = None

    def set_waker(self, waker: Callable[[], None] | None) -> None:
        """Have `waker()` called whenever a transfer settles (DONE or FAILED) on either side, from the
        connector's own threads, so that the worker waiting for it sleeps until then instead of polling
        `poll`. It must be cheap, thread-safe and never block. Only backends whose `wakes_owner` is
        True call it; a sender may also be woken between layers (DONE until the next `send`)."""
        self._waker = waker

    def _settled(self) -> None:
        """A transfer reached DONE or FAILED: wake the owner (`set_waker`)."""
        if self._waker is not None:
            self._waker()

    def register(self, kv_pool: torch.Tensor, model: str = "") -> None:
        """Give the connector the worker's KV pool (read by sends, written by receives).

        Args:
            kv_pool: the engine's pool tensor; must stay alive and keep its shape.
            model: what identifies the model whose KV the pool holds (`model_fingerprint`); a peer
                whose model differs is refused by backends that pair workers.
        """
        check_pool(kv_pool)
        self.pool = kv_pool

    def _need_pool(self) -> torch.Tensor:
        """The registered pool; raises TransferError before `register`."""
        if self.pool is None:
            raise TransferError(f"connector {self.worker_id!r}: call register(kv_pool) before transferring")
        return self.pool

    @abstractmethod
    def local_info(self) -> PeerInfo:
        """Returns:
            this worker's `PeerInfo`; on a receiver, the address of the rendezvous it hosts.
        """

    @abstractmethod
    def send(self, transfer_id: str, layer: int, blocks: list[int], peer: PeerInfo) -> None:
        """Sender side: queue one layer of `blocks` for `peer`. Never blocks on the network.

        Args:
            transfer_id: id shared with the receiver's `recv`.
            layer: layer index in the pool.
            blocks: the sender's block ids, in sequence order.
            peer: the receiver's `local_info()`.
        """

    @abstractmethod
    def recv(self, transfer_id: str, blocks: list[int], num_layers: int, peer: PeerInfo) -> None:
        """Receiver side: expect all `num_layers` layers of `transfer_id` into `blocks`. Non-blocking.

        Args:
            transfer_id: id shared with the sender's `send` calls.
            blocks: the receiver's reserved block ids, same count and order as the sender's.
            num_layers: how many layers must land before the transfer is DONE.
            peer: the sender's `local_info()`.
        """

    @abstractmethod
    def poll(self, transfer_id: str) -> TransferState:
        """Returns:
            the transfer's state. On a sender, DONE means every layer queued so far was delivered.

        Raises:
            TransferError: the id is unknown to this connector.
        """

    @abstractmethod
    def abort(self, transfer_id: str) -> None:
        """Stop a transfer: it becomes FAILED and nothing more of it is written. Unknown ids are ignored.

        Args:
            transfer_id: the transfer to stop.
        """

    def handoff(self, transfer_id: str) -> object | None:
        """Sender side, after the last `send`: what the receiver needs besides the data path
        (the object store's refs), to pass along in an ordinary call. None when nothing is needed.

        Args:
            transfer_id: the transfer whose layers were all sent.
        """
        return None

    def accept(self, transfer_id: str, handoff: object | None) -> None:
        """Receiver side: take the sender's `handoff` (ignored when None).

        Args:
            transfer_id: a transfer posted with `recv`.
            handoff: what the sender's `handoff` returned.
        """

    def forget(self, transfer_id: str) -> None:
        """Drop what this connector keeps of a finished (DONE or FAILED) transfer, so a long-running
        worker's memory stays bounded; a later `poll` of it raises TransferError. Transfers still
        running and unknown ids are left alone.

        Args:
            transfer_id: the finished transfer.
        """

    def drop_peer(self, peer_id: str) -> None:
        """A peer is gone for good (its worker died and was replaced): fail what is pending with it and
        release the pair's thread and connections. Unknown peers are ignored.

        Args:
            peer_id: the gone worker's id.
        """

    @abstractmethod
    def close(self) -> None:
        """Release threads, groups and stores; pending transfers become FAILED. Idempotent."""
