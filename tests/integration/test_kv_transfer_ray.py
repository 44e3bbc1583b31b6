"""kv_transfer between real Ray actors: torch_dist (gloo) and object_store, no mocks."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import replace

import psutil
import pytest
import ray
import torch

from kv_transfer import PeerInfo, TransferConfig, TransferState, make_connector

LAYERS = 30
SHAPE = (LAYERS, 2, 3, 16, 16, 64)  # ~12 MB fp32: the embedded model's KV geometry, 16 blocks
TIMEOUT_S = 3.0
DIST = TransferConfig(backend="torch_dist", timeout_s=TIMEOUT_S, host="127.0.0.1")  # one deployment: one secret
OBJECT_STORE = TransferConfig(backend="object_store", timeout_s=TIMEOUT_S)


@ray.remote(num_cpus=0)
class Worker:
    """A worker owning a KV pool and a connector, as prefill and decode workers will."""

    def __init__(self, config: TransferConfig, worker_id: str, seed: int) -> None:
        self._baseline = self._listening()  # what Ray itself listens on in this process
        torch.set_num_threads(1)
        self.pool = torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed))
        self.conn = make_connector(config, worker_id)
        self.conn.register(self.pool)

    def info(self) -> PeerInfo:
        return self.conn.local_info()

    def send_all(self, tid: str, blocks: list[int], num_layers: int, peer: PeerInfo) -> None:
        for layer in range(num_layers):
            self.conn.send(tid, layer, blocks, peer)

    def recv(self, tid: str, blocks: list[int], peer: PeerInfo) -> None:
        self.conn.recv(tid, blocks, LAYERS, peer)

    def wait(self, tid: str, limit_s: float = 30.0) -> TransferState:
        """Poll until DONE or FAILED (or `limit_s`, a hang guard, not a timing check)."""
        end = time.monotonic() + limit_s
        while (state := self.conn.poll(tid)) in (TransferState.PENDING, TransferState.TRANSFERRING):
            if time.monotonic() > end:
                break
            time.sleep(0.01)
        return state

    def blocks(self, blocks: list[int]) -> torch.Tensor:
        return self.pool[:, :, :, blocks].clone()

    def take_refs(self, tid: str) -> dict:
        return self.conn.take_refs(tid)

    def deliver(self, tid: str, refs: dict) -> None:
        self.conn.deliver(tid, refs)

    def close(self) -> None:
        self.conn.close()

    def transfer_ports(self) -> list[tuple[str, int]]:
        """The (address, port)s this process listens on that the connector opened."""
        return sorted(self._listening() - self._baseline)

    def _listening(self) -> set[tuple[str, int]]:
        return {(c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections(kind="tcp")
                if c.status == psutil.CONN_LISTEN}


@pytest.fixture(scope="module")
def dist_workers(ray_cluster: None) -> tuple:
    p1, p2 = Worker.remote(DIST, "prefill-1", 1), Worker.remote(DIST, "prefill-2", 2)
    d = Worker.remote(DIST, "decode-1", 3)
    yield p1, p2, d
    ray.get([w.close.remote() for w in (p1, p2, d)])
    for w in (p1, p2, d):
        ray.kill(w)


def _move(p, d, tid: str, src: list[int], dst: list[int]) -> None:
    """The orchestrator's part: the decode side posts its receive, then the prefill side sends."""
    ray.get(d.recv.remote(tid, dst, p.info.remote()))
    p.send_all.remote(tid, src, LAYERS, d.info.remote())


def _check(p, d, tid: str, src: list[int], dst: list[int]) -> None:
    assert ray.get(d.wait.remote(tid)) == TransferState.DONE
    assert ray.get(p.wait.remote(tid)) == TransferState.DONE
    assert torch.equal(ray.get(d.blocks.remote(dst)), ray.get(p.blocks.remote(src)))


def test_torch_dist_moves_30_layers_into_other_blocks(dist_workers: tuple) -> None:
    p1, _, d = dist_workers
    _move(p1, d, "req-a", [0, 3, 5, 7, 11], [15, 2, 9, 4, 1])
    _check(p1, d, "req-a", [0, 3, 5, 7, 11], [15, 2, 9, 4, 1])


def test_torch_dist_unposted_receive_fails_then_pair_rebuilds(dist_workers: tuple) -> None:
    p1, _, d = dist_workers
    ray.get(p1.send_all.remote("req-lost", [1, 2], 1, d.info.remote()))  # d never posts recv
    assert ray.get(p1.wait.remote("req-lost", 6 * TIMEOUT_S)) == TransferState.FAILED
    _move(p1, d, "req-b", [1, 2], [6, 8])
    _check(p1, d, "req-b", [1, 2], [6, 8])


def test_torch_dist_two_senders_one_receiver(dist_workers: tuple) -> None:
    p1, p2, d = dist_workers
    _move(p1, d, "req-c", [4, 5, 6], [10, 11, 12])
    _move(p2, d, "req-d", [8, 9], [13, 14])
    _check(p2, d, "req-d", [8, 9], [13, 14])
    _check(p1, d, "req-c", [4, 5, 6], [10, 11, 12])


def test_object_store_moves_30_layers(ray_cluster: None) -> None:
    p, d = Worker.remote(OBJECT_STORE, "os-prefill", 4), Worker.remote(OBJECT_STORE, "os-decode", 5)
    try:
        src, dst = [2, 4, 6], [1, 3, 0]
        _move(p, d, "req-e", src, dst)
        assert ray.get(p.wait.remote("req-e")) == TransferState.DONE
        refs = ray.get(p.take_refs.remote("req-e"))
        assert sorted(refs) == list(range(LAYERS))
        ray.get(d.deliver.remote("req-e", refs))
        _check(p, d, "req-e", src, dst)
    finally:
        ray.get([w.close.remote() for w in (p, d)])
        for w in (p, d):
            ray.kill(w)


_FOREIGN_STORE = """
import datetime, sys
import torch.distributed as dist
store = dist.TCPStore(sys.argv[1], int(sys.argv[2]), None, False, timeout=datetime.timedelta(seconds=2))
store.set("kvx/intruder", "1")
print("ACCEPTED")
"""


def _hostile(host: str, port: int, store: bool) -> None:
    """What an attacker who reaches a port can do without the secret: bytes of every kind, and (`store`:
    a rendezvous port) torch's own store client, TCPStore's protocol, in a process of its own."""
    for payload in (os.urandom(64), os.urandom(200_000), b"\xff" * 16, b""):
        try:
            with socket.create_connection((host, port), timeout=5) as s:
                s.sendall(payload)
                time.sleep(0.05)
        except OSError:  # dropped mid-send: refused, as it should be
            pass
    if not store:
        return
    try:
        out = subprocess.run([sys.executable, "-c", _FOREIGN_STORE, host, str(port)], check=False, capture_output=True,
                             text=True, timeout=20).stdout
    except subprocess.TimeoutExpired:
        out = ""  # never answered: not in
    assert "ACCEPTED" not in out, f"a foreign store client got into {host}:{port}"


def test_torch_dist_ports_refuse_hostile_bytes_foreign_stores_and_wrong_secrets(dist_workers: tuple) -> None:
    """Every port either side's connector opens (the receiver's rendezvous, each side's pair-group
    socket) is bound to the transfer address only and takes random bytes and a foreign TCPStore
    client without harm, while a transfer is in flight; a worker with another deployment's secret
    can neither send to nor receive from a worker of this one. Afterwards transfers are exact."""
    p1, _, d = dist_workers
    _move(p1, d, "req-h0", [0, 1], [2, 3])
    _check(p1, d, "req-h0", [0, 1], [2, 3])  # a pair exists: its group's sockets listen too
    ports = ray.get(d.transfer_ports.remote()) + ray.get(p1.transfer_ports.remote())
    rendezvous = {ray.get(w.info.remote()).port for w in (p1, d)}  # each side serves one (the sender's idles)
    assert rendezvous <= {port for _, port in ports}
    assert len(ports) >= 3 and all(host == "127.0.0.1" for host, _ in ports), ports
    _move(p1, d, "req-h1", [4, 5, 6], [7, 8, 9])  # in flight while the ports are attacked
    for host, port in ports:
        _hostile(host, port, store=port in rendezvous)
    _check(p1, d, "req-h1", [4, 5, 6], [7, 8, 9])
    intruder = Worker.remote(replace(DIST, secret="x" * 64), "intruder", 9)
    try:
        ray.get(intruder.send_all.remote("req-x", [1], 2, d.info.remote()))  # into d's pool
        ray.get(p1.send_all.remote("req-z", [3], 1, intruder.info.remote()))  # d's peer to the intruder
        assert ray.get(intruder.wait.remote("req-x")) == TransferState.FAILED
        assert ray.get(p1.wait.remote("req-z")) == TransferState.FAILED
    finally:
        ray.get(intruder.close.remote())
        ray.kill(intruder)
    _move(p1, d, "req-h2", [11, 12], [13, 14])
    _check(p1, d, "req-h2", [11, 12], [13, 14])
