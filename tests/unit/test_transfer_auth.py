"""The transfer plane's authentication, in one process: the rendezvous (`kv_transfer.rendezvous`)
against clients with and without the secret and against hostile bytes, and the pair handshake
(`kv_transfer.pair_group`) between two real gloo ranks in threads."""
from __future__ import annotations

import datetime
import os
import socket
import threading
import time

import pytest
import torch
import torch.distributed as dist

from kv_transfer import TransferConfig, TransferError
from kv_transfer.pair_group import PairGroup, describe_pool, mismatch
from kv_transfer.rendezvous import RendezvousServer, RendezvousStore

SECRET = b"a" * 32
POOL = torch.zeros(4, 2, 2, 8, 16, 8)


@pytest.fixture
def server():
    srv = RendezvousServer("127.0.0.1", 0, SECRET)
    yield srv
    srv.close()


def closed(s: socket.socket) -> bool:
    """The server closed the connection without an answer (a close, or a reset: it left bytes unread)."""
    try:
        return s.recv(64) == b""
    except ConnectionResetError:
        return True


def refused_becomes(srv: RendezvousServer, n: int) -> None:
    """Wait until at least `n` connections were dropped (a retrying client makes more than one)."""
    end = time.monotonic() + 10
    while srv.refused < n and time.monotonic() < end:
        time.sleep(0.01)
    assert srv.refused >= n


def test_a_client_with_the_secret_uses_the_table(server: RendezvousServer) -> None:
    a, b = RendezvousStore("127.0.0.1", server.port, SECRET, 5), RendezvousStore("127.0.0.1", server.port, SECRET, 5)
    a.set("k", b"\x00\xffbytes")
    assert b.get("k") == b"\x00\xffbytes" and b.check(["k"]) and not b.check(["k", "other"])
    assert a.add("n", 2) == 2 and b.add("n", 0) == 2
    threading.Timer(0.2, lambda: a.set("late", "v")).start()
    assert b.get("late") == b"v"  # a get waits for the key
    assert b.delete_key("k") and not b.check(["k"])
    with pytest.raises(TransferError, match="no 'never'"):
        RendezvousStore("127.0.0.1", server.port, SECRET, 0.3).get("never")
    assert server.refused == 0
    a.close()
    b.close()


def test_the_server_binds_only_the_address_it_is_given(server: RendezvousServer) -> None:
    assert server.host == "127.0.0.1"
    other = [a for a in {i[4][0] for i in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)}
             if a != "127.0.0.1" and not a.startswith("127.")]
    for address in other:  # this machine's other IPv4 addresses: nothing listens there
        with pytest.raises(OSError):
            socket.create_connection((address, server.port), timeout=2).close()


def test_wrong_secrets_hostile_bytes_and_foreign_stores_are_dropped_and_it_carries_on(
        server: RendezvousServer) -> None:
    with pytest.raises(TransferError, match="refused or unreachable"):
        RendezvousStore("127.0.0.1", server.port, b"b" * 32, 5)
    refused_becomes(server, 1)
    for payload in (os.urandom(64), b"\xff" * 70_000, b"\x00" * 64):  # garbage as the proof
        with socket.create_connection(("127.0.0.1", server.port)) as s:
            s.recv(32)
            s.sendall(payload)
            assert closed(s)
    refused_becomes(server, 4)
    foreign = {}

    def torch_client() -> None:  # torch's own store client speaks another protocol
        try:
            dist.TCPStore("127.0.0.1", server.port, None, False, timeout=datetime.timedelta(seconds=2))
        except Exception as e:  # noqa: BLE001  (whatever torch raises: it must not get in)
            foreign["error"] = e
    t = threading.Thread(target=torch_client)
    t.start()
    t.join(30)
    assert "error" in foreign
    refused_becomes(server, 5)
    good = RendezvousStore("127.0.0.1", server.port, SECRET, 5)
    good.set("still", "here")
    assert good.get("still") == b"here"
    good.close()


def test_a_client_must_prove_the_secret_in_time(server: RendezvousServer, monkeypatch) -> None:
    monkeypatch.setattr("kv_transfer.rendezvous.AUTH_TIMEOUT_S", 0.3)
    srv = RendezvousServer("127.0.0.1", 0, SECRET)
    with socket.create_connection(("127.0.0.1", srv.port)) as s:
        s.settimeout(5)
        s.recv(32)
        assert closed(s)  # silent: dropped
    refused_becomes(srv, 1)
    srv.close()


def pair(store: dist.Store, rank: int, secret: bytes, pool: dict, out: dict) -> None:
    group = PairGroup("kvx/s/r", rank, store, 5.0, torch.device("cpu"), "127.0.0.1", secret, pool)
    try:
        group._build(1)
        out[rank] = "ok"
    except TransferError as e:
        out[rank] = str(e)


def handshake(secrets: tuple[bytes, bytes], pools: tuple[dict, dict]) -> dict:
    store, out = dist.HashStore(), {}
    threads = [threading.Thread(target=pair, args=(store, r, secrets[r], pools[r], out)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def test_a_pair_proves_the_secret_both_ways_before_any_kv_moves() -> None:
    pool = describe_pool(POOL, "llama:abc")
    assert handshake((SECRET, SECRET), (pool, pool)) == {0: "ok", 1: "ok"}
    out = handshake((SECRET, b"b" * 32), (pool, pool))
    assert all("did not prove the deployment's secret" in out[r] for r in (0, 1)), out


@pytest.mark.parametrize("field, theirs", [("block_size", torch.zeros(4, 2, 2, 8, 32, 8)),
                                           ("dtype", torch.zeros(4, 2, 2, 8, 16, 8, dtype=torch.bfloat16)),
                                           ("num_layers", torch.zeros(3, 2, 2, 8, 16, 8))])
def test_a_pair_whose_pools_differ_is_refused_naming_the_field(field: str, theirs: torch.Tensor) -> None:
    ours = describe_pool(POOL, "llama:abc")
    out = handshake((SECRET, SECRET), (ours, describe_pool(theirs, "llama:abc")))
    for r in (0, 1):
        assert "KV pools differ" in out[r] and field in out[r], out
    assert mismatch(ours, describe_pool(POOL, "qwen2:def")) == "model 'llama:abc' on this side, 'qwen2:def' on the peer"


def test_the_secret_is_per_config_and_never_printed() -> None:
    a, b = TransferConfig(), TransferConfig()
    assert a.secret != b.secret and len(a.secret) == 64
    assert a.secret not in repr(a)
    with pytest.raises(ValueError, match="secret"):
        TransferConfig(secret="short")


def test_an_operator_gives_the_secret_by_file_or_environment(tmp_path) -> None:
    from kv_transfer.config import SECRET_ENV, operator_secret

    assert operator_secret(None, {}) is None  # each deployment makes its own
    path = tmp_path / "secret"
    path.write_text("  s3cret-of-the-fleet-0123456789\n")
    assert operator_secret(str(path), {SECRET_ENV: "ignored-when-a-file-is-given"}) == "s3cret-of-the-fleet-0123456789"
    assert operator_secret(None, {SECRET_ENV: "from-the-environment-42"}) == "from-the-environment-42"
    with pytest.raises(ValueError, match="--transfer-secret-file .*cannot read"):
        operator_secret(str(tmp_path / "missing"), {})
    with pytest.raises(ValueError, match=f"\\${SECRET_ENV}: .*at least 16"):
        operator_secret(None, {SECRET_ENV: "short"})
