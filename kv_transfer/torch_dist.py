"""Default backend: per-pair 2-rank gloo (CPU pools) or NCCL (CUDA pools) groups, one thread per pair.

Each receiver serves an authenticated rendezvous (`kv_transfer.rendezvous`) on its transfer address;
every group is built over it and authenticated by a handshake before any KV moves
(`kv_transfer.pair_group`). Both bind the configured address only (`TransferConfig.host`).

Wire protocol per layer, in order on the pair: header int64[4] = (transfer hash, layer, n blocks,
byte size), then the layer's buffer as bytes. The receiver accepts layers of any transfer it has
posted from that sender, in any order; a header it cannot match fails the transfer and the pair.
Headers of transfers it already failed or aborted are drained and dropped.
A send/recv that errors or times out tears the pair down; the next use rebuilds it.
"""
from __future__ import annotations

import logging
import queue
import socket
import threading
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from kv_transfer.base import KVConnector, PeerInfo, TransferError, TransferState
from kv_transfer.config import TransferConfig
from kv_transfer.layers import check_blocks, gather_layer, layer_shape, scatter_layer, single_threaded, transfer_hash
from kv_transfer.pair_group import PairGroup, describe_pool, pair_key
from kv_transfer.rendezvous import LocalRendezvousStore, RendezvousServer, RendezvousStore

log = logging.getLogger(__name__)
_STOP = None
_MAX_DEAD = 4096


@dataclass
class _Send:
    peer_id: str
    queued: int = 0
    sent: int = 0
    started: bool = False
    failed: bool = False

    def state(self) -> TransferState:
        if self.failed:
            return TransferState.FAILED
        if self.sent == self.queued:
            return TransferState.DONE
        return TransferState.TRANSFERRING if self.started else TransferState.PENDING


@dataclass
class _Recv:
    tid: str
    peer_id: str
    blocks: list[int]
    num_layers: int
    landed: set[int] = field(default_factory=set)
    state: TransferState = TransferState.PENDING


def _default_host() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


class TorchDistConnector(KVConnector):
    """Both roles; a worker may send to many receivers and receive from many senders. Wakes its owner
    (`set_waker`) as each transfer settles."""

    wakes_owner = True

    def __init__(self, config: TransferConfig, worker_id: str) -> None:
        self.config = config
        self.worker_id = worker_id
        self.pool: torch.Tensor | None = None
        self._lock = threading.Condition()
        self._closed = False
        self._master: RendezvousServer | None = None
        self._host = config.host or _default_host()
        self._secret = config.secret.encode()
        self._model = ""
        self._sends: dict[str, _Send] = {}
        self._recvs: dict[str, _Recv] = {}
        self._live: dict[int, _Recv] = {}  # hash → posted, not finished
        self._dead: dict[int, None] = {}  # hashes failed/aborted here (newest last): their messages are drained
        self._gone: set[str] = set()  # peers dropped for good
        self._send_pairs: dict[str, tuple[queue.Queue, threading.Thread]] = {}
        self._recv_pairs: dict[str, threading.Thread] = {}

    # -- common ---------------------------------------------------------------------------------
    def local_info(self) -> PeerInfo:
        with self._lock:
            if self._master is None:
                self._master = RendezvousServer(self._host, self.config.port, self._secret)
            return PeerInfo(self.worker_id, self._host, self._master.port)

    def register(self, kv_pool: torch.Tensor, model: str = "") -> None:
        super().register(kv_pool, model)
        self._model = model

    def _pair(self, sender: str, receiver: str, rank: int, store: dist.Store) -> PairGroup:
        """One side of the pair `sender` -> `receiver` over `store`, the receiver's rendezvous."""
        assert self.pool is not None
        return PairGroup(pair_key(sender, receiver), rank, store, self.config.timeout_s, self.pool.device,
                         self._host, self._secret, describe_pool(self.pool, self._model))

    def _need_pool(self) -> torch.Tensor:
        if self._closed:
            raise TransferError(f"connector {self.worker_id!r} is closed")
        return super()._need_pool()

    def poll(self, transfer_id: str) -> TransferState:
        with self._lock:
            if transfer_id in self._recvs:
                return self._recvs[transfer_id].state
            if transfer_id in self._sends:
                return self._sends[transfer_id].state()
        raise TransferError(f"unknown transfer {transfer_id!r} on {self.worker_id!r}")

    def abort(self, transfer_id: str) -> None:
        with self._lock:
            if transfer_id in self._sends:
                self._sends[transfer_id].failed = True  # queued layers are skipped
            rx = self._recvs.get(transfer_id)
            if rx is not None and rx.state > TransferState.FAILED:
                self._fail_recv(rx, "aborted")

    def forget(self, transfer_id: str) -> None:
        with self._lock:
            tx = self._sends.get(transfer_id)
            if tx is not None and tx.state() in (TransferState.DONE, TransferState.FAILED):
                del self._sends[transfer_id]
            rx = self._recvs.get(transfer_id)
            if rx is not None and rx.state in (TransferState.DONE, TransferState.FAILED):
                del self._recvs[transfer_id]

    def drop_peer(self, peer_id: str) -> None:
        with self._lock:
            self._gone.add(peer_id)
            entry = self._send_pairs.pop(peer_id, None)
            for tx in self._sends.values():
                if tx.peer_id == peer_id and tx.state() != TransferState.DONE:
                    tx.failed = True
            for rx in self._waiting(peer_id):
                self._fail_recv(rx, f"peer {peer_id} is gone")
            self._recv_pairs.pop(peer_id, None)  # its thread sees the peer gone and exits
            self._lock.notify_all()
        if entry is not None:
            entry[0].put(_STOP)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for rx in list(self._live.values()):
                self._fail_recv(rx, "connector closed")
            for tx in self._sends.values():
                tx.failed = tx.failed or tx.state() != TransferState.DONE
            self._lock.notify_all()
        threads = [t for _, t in self._send_pairs.values()] + list(self._recv_pairs.values())
        for q, _ in self._send_pairs.values():
            q.put(_STOP)
        for t in threads:  # each is at most one timed wait away from noticing
            t.join(timeout=self.config.timeout_s * 2 + 5)
            if t.is_alive():
                log.error("transfer thread %s did not stop", t.name)
        if self._master is not None:
            self._master.close()
        self._master = None

    # -- sender -------------------------------------------------------------------------------------
    def send(self, transfer_id: str, layer: int, blocks: list[int], peer: PeerInfo) -> None:
        pool = self._need_pool()
        check_blocks(pool, blocks, layer)
        if not peer.host or not peer.port:
            raise ValueError(f"peer {peer.worker_id!r} has no rendezvous address; pass its local_info()")
        with self._lock:
            tx = self._sends.setdefault(transfer_id, _Send(peer.worker_id))
            if tx.peer_id != peer.worker_id:
                raise TransferError(f"transfer {transfer_id!r} goes to {tx.peer_id!r}, not {peer.worker_id!r}")
            if tx.failed:
                log.warning("transfer %s already failed; layer %d not sent", transfer_id, layer)
                return
            tx.queued += 1
            if peer.worker_id not in self._send_pairs:
                q: queue.Queue = queue.Queue()
                t = threading.Thread(target=self._send_loop, args=(q, peer), daemon=True,
                                     name=f"kv-send-{self.worker_id}->{peer.worker_id}")
                self._send_pairs[peer.worker_id] = (q, t)
                t.start()
            self._send_pairs[peer.worker_id][0].put((transfer_id, layer, list(blocks)))

    def _send_loop(self, q: queue.Queue, peer: PeerInfo) -> None:
        assert self.pool is not None
        single_threaded()
        pair: PairGroup | None = None
        while (job := q.get()) is not _STOP:
            tid, layer, blocks = job
            with self._lock:
                tx = self._sends.get(tid)
                if tx is None or tx.failed or self._closed:
                    continue
                tx.started = True
            try:
                try:
                    pair = self._send_layer(pair, peer, tid, layer, blocks)
                except Exception as e:
                    if tx.sent:  # part of this transfer went through: the receiver cannot take it again
                        raise
                    # nothing of it arrived: the pair may have been closed by the receiver (e.g. after a
                    # timed-out transfer); rebuild it once and send again
                    log.info("pair %s->%s broken (%s); rebuilding it for %s", self.worker_id, peer.worker_id, e, tid)
                    if pair is not None:
                        pair.close()
                    pair = self._send_layer(None, peer, tid, layer, blocks)
                with self._lock:
                    tx.sent += 1
                    settled = tx.state() == TransferState.DONE
                if settled:
                    self._settled()
            except Exception as e:
                log.warning("transfer %s layer %d to %s failed, pair torn down: %s", tid, layer, peer.worker_id, e)
                with self._lock:
                    tx.failed = True
                    for other in self._sends.values():  # mid-stream transfers on this pair cannot complete
                        if other.peer_id == peer.worker_id and 0 < other.sent < other.queued:
                            other.failed = True
                self._settled()
                if pair is not None:
                    pair.close()
                    pair = None  # a fresh store connection too, in case the receiver restarted
        if pair is not None:
            pair.close()

    def _send_layer(self, pair: PairGroup | None, peer: PeerInfo, tid: str, layer: int,
                    blocks: list[int]) -> PairGroup:
        """Send one layer's header and buffer, connecting the pair first if needed. Returns the pair."""
        assert self.pool is not None
        if pair is None:
            # TransferError if the receiver's rendezvous refuses or cannot be reached
            store = RendezvousStore(peer.host, peer.port, self._secret, self.config.timeout_s)
            pair = self._pair(self.worker_id, peer.worker_id, 0, store)
        if pair.group is None:
            try:
                pair.connect_sender()
            except Exception:
                pair.close()
                raise
        buf = gather_layer(self.pool, layer, blocks)
        nbytes = buf.numel() * buf.element_size()
        header = torch.tensor([transfer_hash(tid), layer, len(blocks), nbytes], dtype=torch.int64,
                              device=self.pool.device)
        pair.send(header)
        pair.send(buf.view(-1).view(torch.uint8))
        return pair

    # -- receiver -----------------------------------------------------------------------------------
    def recv(self, transfer_id: str, blocks: list[int], num_layers: int, peer: PeerInfo) -> None:
        pool = self._need_pool()
        check_blocks(pool, blocks)
        if not 0 < num_layers <= pool.shape[0]:
            raise ValueError(f"num_layers must be in [1, {pool.shape[0]}], got {num_layers}")
        self.local_info()  # the store must exist before the sender looks for it
        h = transfer_hash(transfer_id)
        with self._lock:
            if transfer_id in self._recvs or h in self._live:
                raise TransferError(f"transfer {transfer_id!r} is already posted on {self.worker_id!r}")
            rx = _Recv(transfer_id, peer.worker_id, list(blocks), num_layers)
            self._recvs[transfer_id] = rx
            self._live[h] = rx
            self._dead.pop(h, None)
            if peer.worker_id not in self._recv_pairs:
                t = threading.Thread(target=self._recv_loop, args=(peer.worker_id,), daemon=True,
                                     name=f"kv-recv-{peer.worker_id}->{self.worker_id}")
                self._recv_pairs[peer.worker_id] = t
                t.start()
            self._lock.notify_all()

    def _fail_recv(self, rx: _Recv, why: str) -> None:
        """Caller holds the lock."""
        if rx.state != TransferState.DONE:
            log.warning("transfer %s from %s failed: %s", rx.tid, rx.peer_id, why)
            rx.state = TransferState.FAILED
            self._settled()
        h = transfer_hash(rx.tid)
        self._live.pop(h, None)
        self._dead[h] = None
        while len(self._dead) > _MAX_DEAD:  # bounded: a late layer of a long-failed transfer fails its pair
            del self._dead[next(iter(self._dead))]

    def _waiting(self, peer_id: str) -> list[_Recv]:
        return [rx for rx in self._live.values() if rx.peer_id == peer_id]

    def _recv_loop(self, peer_id: str) -> None:
        assert self.pool is not None and self._master is not None
        single_threaded()
        pair = self._pair(peer_id, self.worker_id, 1, LocalRendezvousStore(self._master, self.config.timeout_s))
        while True:
            with self._lock:
                while not self._closed and peer_id not in self._gone and not self._waiting(peer_id):
                    self._lock.wait(0.5)
                if self._closed or peer_id in self._gone:
                    break
            current: list[_Recv] = []
            try:
                if pair.group is None or pair.stale():
                    pair.connect_receiver(lambda: not self._closed and bool(self._waiting(peer_id)))
                self._recv_one(pair, current)
            except Exception as e:
                with self._lock:
                    broken = [rx for rx in self._waiting(peer_id) if rx.landed] + current
                    if pair.group is None:  # never connected: nothing will arrive for any of them
                        broken = self._waiting(peer_id)
                    for rx in broken:
                        self._fail_recv(rx, f"pair torn down: {e}")
                pair.teardown()
        pair.close()

    def _recv_one(self, pair: PairGroup, current: list[_Recv]) -> None:
        """Receive one header and its buffer; land it if it belongs to a live transfer."""
        pool = self.pool
        assert pool is not None
        header = torch.zeros(4, dtype=torch.int64, device=pool.device)
        pair.recv(header)
        h, layer, n, nbytes = header.tolist()
        max_bytes = pool[0].numel() * pool.element_size()
        with self._lock:
            rx = self._live.get(h)
            dead = h in self._dead
        if rx is None and dead and 0 < nbytes <= max_bytes:  # failed/aborted here: drain and drop
            pair.recv(torch.empty(nbytes, dtype=torch.uint8, device=pool.device))
            return
        if rx is None:
            raise TransferError(f"header for a transfer not posted here (hash {h}, layer {layer})")
        current.append(rx)
        shape = layer_shape(pool, len(rx.blocks))
        want = torch.Size(shape).numel() * pool.element_size()
        if n != len(rx.blocks) or nbytes != want or not 0 <= layer < rx.num_layers or layer in rx.landed:
            raise TransferError(f"transfer {rx.tid}: header mismatch: layer {layer}, {n} blocks, {nbytes} bytes; "
                                f"expected a new layer < {rx.num_layers}, {len(rx.blocks)} blocks, {want} bytes")
        buf = torch.empty(shape, dtype=pool.dtype, device=pool.device)
        pair.recv(buf.view(-1).view(torch.uint8))
        with self._lock:
            if rx.state == TransferState.FAILED:  # aborted while in flight: write nothing
                return
            scatter_layer(pool, layer, rx.blocks, buf)
            rx.landed.add(layer)
            rx.state = TransferState.TRANSFERRING
            if len(rx.landed) == rx.num_layers:
                rx.state = TransferState.DONE
                self._live.pop(h, None)
                self._settled()
