"""In-process backend for unit tests: connectors find each other in a module-level registry and a
send copies straight into the receiver's pool (synchronously)."""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

import torch

from kv_transfer.base import KVConnector, PeerInfo, TransferError, TransferState
from kv_transfer.config import TransferConfig
from kv_transfer.layers import check_blocks, gather_layer, scatter_layer

log = logging.getLogger(__name__)

_REGISTRY: dict[str, LocalConnector] = {}
_LOCK = threading.RLock()  # one lock for all local connectors: sends touch two of them


@dataclass
class _Transfer:
    state: TransferState
    blocks: list[int] = field(default_factory=list)
    num_layers: int = 0
    done_layers: set[int] = field(default_factory=set)


class LocalConnector(KVConnector):
    """Both roles in one class; `worker_id` must be unique among live local connectors."""

    def __init__(self, config: TransferConfig, worker_id: str) -> None:
        self.config = config
        self.worker_id = worker_id
        self.pool: torch.Tensor | None = None
        self._sends: dict[str, _Transfer] = {}
        self._recvs: dict[str, _Transfer] = {}
        with _LOCK:
            if worker_id in _REGISTRY:
                raise ValueError(f"a local connector named {worker_id!r} is already open; close it first")
            _REGISTRY[worker_id] = self

    def local_info(self) -> PeerInfo:
        return PeerInfo(self.worker_id)

    def send(self, transfer_id: str, layer: int, blocks: list[int], peer: PeerInfo) -> None:
        pool = self._need_pool()
        check_blocks(pool, blocks, layer)
        with _LOCK:
            tx = self._sends.setdefault(transfer_id, _Transfer(TransferState.PENDING))
            if tx.state == TransferState.FAILED:
                return
            dst = _REGISTRY.get(peer.worker_id)
            rx = dst._recvs.get(transfer_id) if dst is not None else None
            if rx is None or rx.state == TransferState.FAILED or len(rx.blocks) != len(blocks):
                why = "no such receiver" if dst is None else "receiver is not expecting it (no recv, aborted, or "\
                      "block count differs)"
                log.warning("transfer %s layer %d to %s failed: %s", transfer_id, layer, peer.worker_id, why)
                tx.state = TransferState.FAILED
                return
            assert dst.pool is not None
            scatter_layer(dst.pool, layer, rx.blocks, gather_layer(pool, layer, blocks))
            rx.done_layers.add(layer)
            rx.state = TransferState.DONE if len(rx.done_layers) == rx.num_layers else TransferState.TRANSFERRING
            tx.state = TransferState.DONE

    def recv(self, transfer_id: str, blocks: list[int], num_layers: int, peer: PeerInfo) -> None:
        pool = self._need_pool()
        check_blocks(pool, blocks)
        if not 0 < num_layers <= pool.shape[0]:
            raise ValueError(f"num_layers must be in [1, {pool.shape[0]}], got {num_layers}")
        with _LOCK:
            if transfer_id in self._recvs:
                raise TransferError(f"transfer {transfer_id!r} is already posted on {self.worker_id!r}")
            self._recvs[transfer_id] = _Transfer(TransferState.PENDING, list(blocks), num_layers)

    def poll(self, transfer_id: str) -> TransferState:
        with _LOCK:
            tx = self._recvs.get(transfer_id) or self._sends.get(transfer_id)
            if tx is None:
                raise TransferError(f"unknown transfer {transfer_id!r} on {self.worker_id!r}")
            return tx.state

    def abort(self, transfer_id: str) -> None:
        with _LOCK:
            for table in (self._recvs, self._sends):
                if transfer_id in table:
                    table[transfer_id].state = TransferState.FAILED

    def forget(self, transfer_id: str) -> None:
        with _LOCK:
            for table in (self._recvs, self._sends):
                tx = table.get(transfer_id)
                if tx is not None and tx.state in (TransferState.DONE, TransferState.FAILED):
                    del table[transfer_id]

    def close(self) -> None:
        with _LOCK:
            for tx in (*self._recvs.values(), *self._sends.values()):
                if tx.state != TransferState.DONE:
                    tx.state = TransferState.FAILED
            if _REGISTRY.get(self.worker_id) is self:
                del _REGISTRY[self.worker_id]
