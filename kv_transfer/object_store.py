"""Fallback and baseline backend: layers travel through Ray's object store.

Wiring (the orchestrator, e.g. the router, does this with ordinary Ray calls):
1. receiver: `recv(tid, blocks, num_layers, sender_info)`;
2. sender: `send(tid, layer, blocks, receiver_info)` per layer (each `ray.put`s one buffer);
3. orchestrator: `refs = sender_actor.take_refs.remote(tid)` → `{layer: ObjectRef}` (refs nested in a
   dict are passed as refs, not values), then `receiver_actor.deliver.remote(tid, refs)`;
   the receiver's connector fetches them on its own thread and writes them into its blocks.
The sender's DONE means its layers are in the object store; the receiver's poll is authoritative.
"""
from __future__ import annotations

import logging
import queue
import threading

import ray
import torch

from kv_transfer.base import KVConnector, PeerInfo, TransferError, TransferState
from kv_transfer.config import TransferConfig
from kv_transfer.layers import check_blocks, gather_layer, scatter_layer, single_threaded

log = logging.getLogger(__name__)


class ObjectStoreConnector(KVConnector):
    """Both roles; needs `ray.init` (a Ray worker or driver)."""

    def __init__(self, config: TransferConfig, worker_id: str) -> None:
        self.config = config
        self.worker_id = worker_id
        self.pool: torch.Tensor | None = None
        self._lock = threading.Lock()
        self._outbox: dict[str, dict[int, ray.ObjectRef]] = {}
        self._send_state: dict[str, TransferState] = {}
        self._recvs: dict[str, tuple[list[int], int, set[int]]] = {}  # tid → (blocks, num_layers, landed)
        self._recv_state: dict[str, TransferState] = {}
        self._inbox: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._fetch_loop, daemon=True, name=f"kv-objstore-{worker_id}")
        self._thread.start()

    def local_info(self) -> PeerInfo:
        return PeerInfo(self.worker_id)

    def send(self, transfer_id: str, layer: int, blocks: list[int], peer: PeerInfo) -> None:
        pool = self._need_pool()
        check_blocks(pool, blocks, layer)
        with self._lock:
            if self._send_state.get(transfer_id) == TransferState.FAILED:
                return
        ref = ray.put(gather_layer(pool, layer, blocks).cpu())
        with self._lock:
            if self._send_state.get(transfer_id) != TransferState.FAILED:
                self._outbox.setdefault(transfer_id, {})[layer] = ref
                self._send_state[transfer_id] = TransferState.DONE

    def take_refs(self, transfer_id: str) -> dict[int, ray.ObjectRef]:
        """Sender side: hand over (and forget) the refs of the layers put so far.

        Returns:
            `{layer: ObjectRef}`; empty if nothing was sent or the transfer was aborted.
        """
        with self._lock:
            return self._outbox.pop(transfer_id, {})

    def handoff(self, transfer_id: str) -> object | None:
        return self.take_refs(transfer_id)

    def accept(self, transfer_id: str, handoff: object | None) -> None:
        if handoff:
            self.deliver(transfer_id, handoff)  # type: ignore[arg-type]

    def recv(self, transfer_id: str, blocks: list[int], num_layers: int, peer: PeerInfo) -> None:
        pool = self._need_pool()
        check_blocks(pool, blocks)
        if not 0 < num_layers <= pool.shape[0]:
            raise ValueError(f"num_layers must be in [1, {pool.shape[0]}], got {num_layers}")
        with self._lock:
            if transfer_id in self._recvs:
                raise TransferError(f"transfer {transfer_id!r} is already posted on {self.worker_id!r}")
            self._recvs[transfer_id] = (list(blocks), num_layers, set())
            self._recv_state[transfer_id] = TransferState.PENDING

    def deliver(self, transfer_id: str, refs: dict[int, ray.ObjectRef]) -> None:
        """Receiver side: the sender's `take_refs` result; fetched and written asynchronously.

        Args:
            transfer_id: a transfer posted with `recv`.
            refs: `{layer: ObjectRef}`, possibly a subset of the layers (deliver may be called again).
        """
        with self._lock:
            if transfer_id not in self._recvs:
                raise TransferError(f"deliver for {transfer_id!r}, which was never posted with recv")
        self._inbox.put((transfer_id, refs))

    def _fetch_loop(self) -> None:
        single_threaded()
        while (item := self._inbox.get()) is not None:
            tid, refs = item
            for layer, ref in refs.items():
                with self._lock:
                    if self._recv_state[tid] == TransferState.FAILED:
                        break
                try:
                    buf = ray.get(ref, timeout=self.config.timeout_s)
                except Exception as e:
                    log.warning("transfer %s layer %d: fetching from the object store failed: %s", tid, layer, e)
                    with self._lock:
                        self._recv_state[tid] = TransferState.FAILED
                    break
                with self._lock:
                    blocks, num_layers, landed = self._recvs[tid]
                    if self._recv_state[tid] == TransferState.FAILED:
                        break
                    if buf.shape[2] != len(blocks) or not 0 <= layer < num_layers:
                        log.warning("transfer %s: layer %d has %d blocks, expected %d of %d layers", tid, layer,
                                    buf.shape[2], len(blocks), num_layers)
                        self._recv_state[tid] = TransferState.FAILED
                        break
                    assert self.pool is not None
                    scatter_layer(self.pool, layer, blocks, buf)
                    landed.add(layer)
                    done = len(landed) == num_layers
                    self._recv_state[tid] = TransferState.DONE if done else TransferState.TRANSFERRING

    def forget(self, transfer_id: str) -> None:
        with self._lock:
            if self._send_state.get(transfer_id) in (TransferState.DONE, TransferState.FAILED):
                del self._send_state[transfer_id]
                self._outbox.pop(transfer_id, None)
            # a receive may still be in the fetch queue (deliver after FAILED): keep it until it is DONE
            if self._recv_state.get(transfer_id) == TransferState.DONE:
                del self._recv_state[transfer_id]
                self._recvs.pop(transfer_id, None)

    def poll(self, transfer_id: str) -> TransferState:
        with self._lock:
            state = self._recv_state.get(transfer_id, self._send_state.get(transfer_id))
        if state is None:
            raise TransferError(f"unknown transfer {transfer_id!r} on {self.worker_id!r}")
        return state

    def abort(self, transfer_id: str) -> None:
        with self._lock:
            for table in (self._recv_state, self._send_state):
                if transfer_id in table:
                    table[transfer_id] = TransferState.FAILED
            self._outbox.pop(transfer_id, None)

    def close(self) -> None:
        with self._lock:
            for table in (self._recv_state, self._send_state):
                for tid, state in table.items():
                    if state != TransferState.DONE:
                        table[tid] = TransferState.FAILED
            self._outbox.clear()
        self._inbox.put(None)
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.config.timeout_s + 5)
