"""One 2-rank process group per (sender, receiver) pair, built over the receiver's rendezvous
(`kv_transfer.rendezvous`: authenticated, bound to the node's transfer address).

Rendezvous (all keys under `kvx/<sender>/<receiver>/` in the receiver's store):
- the sender proposes generation g = `add("gen", 1)` and builds rank 0 over prefix `g<g>`;
  if that fails it sets `dead/<g>` so the receiver never joins it;
- the receiver, when it has transfers waiting, joins the newest live generation as rank 1, and
  rejoins whenever the sender proposes a newer one (the sender tore its side down).
Handshake, on every new group before any KV moves: each side sends a hello (a fresh nonce and what
its pool holds: model, dtype, layers, KV heads, block size, head dim), then proves the deployment's
secret with an HMAC over both hellos, the pair and the generation; the sender proves first. A group
whose peer cannot prove it (someone else reached the group's socket) or whose pool differs is torn
down with a TransferError that says which (for a mismatch: the field, here and there).
No global group and no `init_process_group`: every pair is independent of every other.
"""
from __future__ import annotations

import datetime
import hmac
import json
import logging
import secrets
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from kv_transfer.base import TransferError
from kv_transfer.rendezvous import proof

log = logging.getLogger(__name__)


def pair_key(sender_id: str, receiver_id: str) -> str:
    return f"kvx/{sender_id}/{receiver_id}"


MAX_HELLO = 4096  # bytes of a handshake hello


def _new_group(store: dist.Store, rank: int, timeout: datetime.timedelta, device: torch.device,
               host: str) -> dist.ProcessGroup:
    """The pair's group; gloo listens on `host` only (NCCL picks its own interfaces: NCCL_SOCKET_IFNAME)."""
    if device.type == "cuda":  # untested here (no GPU): same protocol, NCCL transport
        if not hasattr(dist, "ProcessGroupNCCL"):
            raise TransferError("the KV pool is on CUDA but this torch build has no NCCL")
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, 2, opts)
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return dist.ProcessGroupGloo(store, rank, 2, opts)


def describe_pool(kv_pool: torch.Tensor, model: str) -> dict[str, str | int]:
    """What a pair must agree on: the model, and the pool's dtype and per-block geometry."""
    layers, _, kv_heads, _, block_size, head_dim = kv_pool.shape
    return {"model": model, "dtype": str(kv_pool.dtype).removeprefix("torch."), "num_layers": int(layers),
            "kv_heads": int(kv_heads), "block_size": int(block_size), "head_dim": int(head_dim)}


def mismatch(ours: dict, theirs: dict) -> str | None:
    """The fields two pool descriptions differ in, for an error message (None: compatible)."""
    fields = sorted(set(ours) | set(theirs))
    diff = [f"{f} {ours.get(f)!r} on this side, {theirs.get(f)!r} on the peer" for f in fields
            if ours.get(f) != theirs.get(f)]
    return "; ".join(diff) or None


class PairGroup:
    """One side of a pair: the store client, the current group and its generation.

    Args:
        key: `pair_key(sender, receiver)`.
        rank: 0 on the sender, 1 on the receiver.
        store: a client of the receiver's rendezvous.
        timeout_s: set-up and per-message timeout.
        device: the pool's device (picks gloo or NCCL).
        host: the address this side's group listens on.
        secret: the deployment's secret, proved in the handshake.
        pool: this side's `describe_pool`, compared with the peer's in the handshake.
    """

    def __init__(self, key: str, rank: int, store: dist.Store, timeout_s: float, device: torch.device,
                 host: str, secret: bytes, pool: dict) -> None:
        assert rank in (0, 1)
        self.key, self.rank, self.store, self.device = key, rank, store, device
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self._host, self._secret, self._pool = host, secret, pool
        self.group: dist.ProcessGroup | None = None
        self.gen = 0  # generation of `group`, or the last one tried

    def _build(self, gen: int) -> None:
        prefixed = dist.PrefixStore(f"{self.key}/g{gen}", self.store)
        self.group = _new_group(prefixed, self.rank, self.timeout, self.device, self._host)
        self.gen = gen
        try:
            self._handshake()
        except Exception:
            self.teardown()
            raise
        log.info("pair %s: rank %d joined generation %d (authenticated)", self.key, self.rank, gen)

    def connect_sender(self) -> None:
        """Sender: propose a new generation and build it; on failure mark it dead and raise."""
        assert self.rank == 0 and self.group is None
        gen = self.store.add(f"{self.key}/gen", 1)
        try:
            self._build(gen)
        except Exception as e:
            self.store.set(f"{self.key}/dead/{gen}", "1")
            self.gen = gen
            if isinstance(e, TransferError):  # the handshake refused the pair: its own message says why
                raise
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

    def _handshake(self) -> None:
        """Hellos out and in (sender first), then proofs (sender first); raise TransferError unless the
        peer proves the secret and its pool matches this one."""
        mine = json.dumps({"nonce": secrets.token_hex(32), "pool": self._pool}).encode()
        if self.rank == 0:
            self._send_bytes(mine)
            hellos = (mine, self._recv_bytes())  # the sender's first
        else:
            hellos = (self._recv_bytes(), mine)
            self._send_bytes(mine)
        context = (self.key.encode(), str(self.gen).encode(), *hellos)
        want = {r: proof(self._secret, b"pdserve-kv-pair/rank%d" % r, *context) for r in (0, 1)}
        if self.rank == 0:
            self._send_bytes(want[0])
            try:
                got = self._recv_bytes()
            except RuntimeError as e:  # the receiver closed the group: it refused our proof
                raise TransferError(f"pair {self.key}: the peer did not prove the deployment's secret (it "
                                    f"closed the group: {e}); refused") from e
        else:
            got = self._recv_bytes()
            if hmac.compare_digest(got, want[0]):
                self._send_bytes(want[1])
        if not hmac.compare_digest(got, want[1 - self.rank]):
            raise TransferError(f"pair {self.key}: the peer did not prove the deployment's secret; refused")
        try:
            theirs = json.loads(hellos[1 - self.rank])["pool"]
        except (ValueError, KeyError, TypeError) as e:
            raise TransferError(f"pair {self.key}: malformed hello from the peer") from e
        if (diff := mismatch(self._pool, theirs)) is not None:
            raise TransferError(f"pair {self.key}: refused, the workers' KV pools differ: {diff}")

    def _send_bytes(self, data: bytes) -> None:
        assert self.group is not None
        size = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        self.group.send([size], 1 - self.rank, 0).wait(self.timeout)
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
        self.group.send([payload], 1 - self.rank, 0).wait(self.timeout)

    def _recv_bytes(self) -> bytes:
        assert self.group is not None
        size = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.group.recv([size], 1 - self.rank, 0).wait(self.timeout)
        n = int(size.item())
        if not 0 < n <= MAX_HELLO:
            raise TransferError(f"pair {self.key}: handshake message of {n} bytes (at most {MAX_HELLO}); refused")
        payload = torch.empty(n, dtype=torch.uint8, device=self.device)
        self.group.recv([payload], 1 - self.rank, 0).wait(self.timeout)
        return bytes(payload.cpu().tolist())

    def close(self) -> None:
        """Tear the group down and close the store client (the pair is not used again)."""
        self.teardown()
        close = getattr(self.store, "close", None)
        if close is not None:
            close()

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
