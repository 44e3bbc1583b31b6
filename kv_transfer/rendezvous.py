"""pdserve's authenticated rendezvous store for the per-pair groups (in place of torch's TCPStore).

A receiver (decode worker) serves one `RendezvousServer` on its node's transfer address; the senders
that pair with it talk to it through `RendezvousStore`, a `torch.distributed.Store` that process
groups can be built over, and the receiver itself through `LocalRendezvousStore`, the same table
without a socket. Lifecycle of a connection:
1. The server accepts it and sends a fresh 32-byte challenge. Within `AUTH_TIMEOUT_S` the client
   answers with its own challenge and an HMAC-SHA256 of both under the deployment's secret; the
   server checks it (constant time) and proves itself back the same way. A connection that does
   not prove the secret, sends a malformed frame or dawdles is logged and closed; nothing it sent
   touched the table.
2. Authenticated, it sends requests (set, get with a timeout, add, check, delete), one frame each,
   and gets one answer each. Frames, keys and the table are bounded (`MAX_*`); a request past a
   bound, or one the protocol does not know, closes the connection.
3. At most `MAX_CONNECTIONS` connections are served at once; more are closed on arrival.
Unlike torch's TCPStore, which listens on every interface, the server binds the one address it is
given. The secret never goes on the wire. Pure sockets and threads: no Ray, no torch beyond the
`Store` base class.
"""
from __future__ import annotations

import datetime
import hashlib
import hmac
import logging
import secrets
import socket
import struct
import threading
import time

import torch.distributed as dist

from kv_transfer.base import TransferError

log = logging.getLogger(__name__)

AUTH_TIMEOUT_S = 5.0  # an unauthenticated connection's time to prove the secret
MAX_CONNECTIONS = 128
MAX_FRAME = 1 << 20  # bytes of one request or answer
MAX_KEY = 1024
MAX_KEYS = 1 << 16
MAX_TABLE_BYTES = 64 << 20
_NONCE = 32
_CLIENT, _SERVER = b"pdserve-kv-rendezvous/client", b"pdserve-kv-rendezvous/server"
_SET, _GET, _ADD, _CHECK, _DELETE = range(1, 6)
_OK, _MISSING, _ERROR = range(3)


class ProtocolError(Exception):
    """A peer broke the rendezvous protocol (bad proof, malformed or oversized frame)."""


def proof(secret: bytes, role: bytes, *parts: bytes) -> bytes:
    """HMAC-SHA256 under `secret` of `role` and `parts` (each length-prefixed)."""
    mac = hmac.new(secret, role, hashlib.sha256)
    for p in parts:
        mac.update(struct.pack(">I", len(p)) + p)
    return mac.digest()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ProtocolError(f"connection closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def _send_frame(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(struct.pack(">I", len(payload)) + payload)


class _Closed(Exception):
    """The peer closed the connection between requests (a client done with it)."""


def _recv_frame(sock: socket.socket, between: bool = False) -> bytes:
    """One frame. `between`: a close before its first byte raises _Closed (not an error)."""
    first = sock.recv(1)
    if not first:
        if between:
            raise _Closed
        raise ProtocolError("connection closed before an answer")
    (n,) = struct.unpack(">I", first + _recv_exact(sock, 3))
    if n > MAX_FRAME:
        raise ProtocolError(f"frame of {n} bytes (at most {MAX_FRAME})")
    return _recv_exact(sock, n)


def _request(op: int, key: str, value: bytes = b"") -> bytes:
    k = key.encode()
    if len(k) > MAX_KEY:
        raise ValueError(f"key of {len(k)} bytes (at most {MAX_KEY})")
    return struct.pack(">BH", op, len(k)) + k + value


class RendezvousServer:
    """Serves the table on `host`:`port` (0: a free port) to clients that prove `secret`."""

    def __init__(self, host: str, port: int, secret: bytes) -> None:
        if not secret:
            raise ValueError("the rendezvous needs a non-empty secret")
        self._secret = secret
        self._table: dict[str, bytes] = {}
        self._bytes = 0
        self._cond = threading.Condition()
        self._closed = False
        self._connections: set[socket.socket] = set()
        self.refused = 0  # connections dropped for a bad proof or a broken protocol (for tests and logs)
        self._listener = socket.create_server((host, port), backlog=64)
        self.host, self.port = host, self._listener.getsockname()[1]
        self._thread = threading.Thread(target=self._accept_loop, daemon=True, name=f"kv-rendezvous-{self.port}")
        self._thread.start()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            conns = list(self._connections)
            self._cond.notify_all()
        self._listener.close()
        for c in conns:
            _close(c)

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, addr = self._listener.accept()
            except OSError:  # closed
                return
            with self._cond:
                if self._closed or len(self._connections) >= MAX_CONNECTIONS:
                    log.warning("rendezvous %s:%d: connection from %s closed (%d open at most)", self.host,
                                self.port, addr, MAX_CONNECTIONS)
                    _close(conn)
                    continue
                self._connections.add(conn)
            threading.Thread(target=self._serve, args=(conn, addr), daemon=True,
                             name=f"kv-rendezvous-{self.port}-conn").start()

    def _serve(self, conn: socket.socket, addr: object) -> None:
        authenticated = False
        try:
            conn.settimeout(AUTH_TIMEOUT_S)
            self._authenticate(conn)
            authenticated = True
            conn.settimeout(None)
            while True:
                _send_frame(conn, self._answer(_recv_frame(conn, between=True)))
        except _Closed:
            pass
        except (ProtocolError, OSError, struct.error) as e:  # OSError: reset, timed out, closed
            if isinstance(e, ProtocolError) or not authenticated:
                with self._cond:
                    self.refused += 1
                why = f"no proof within {AUTH_TIMEOUT_S:.0f} s" if isinstance(e, TimeoutError) else str(e)
                log.warning("rendezvous %s:%d: connection from %s dropped: %s", self.host, self.port, addr, why)
        finally:
            with self._cond:
                self._connections.discard(conn)
            _close(conn)

    def _authenticate(self, conn: socket.socket) -> None:
        challenge = secrets.token_bytes(_NONCE)
        conn.sendall(challenge)
        answer = _recv_exact(conn, 2 * _NONCE)
        theirs, mac = answer[:_NONCE], answer[_NONCE:]
        if not hmac.compare_digest(mac, proof(self._secret, _CLIENT, challenge, theirs)):
            raise ProtocolError("wrong proof of the deployment's secret")
        conn.sendall(proof(self._secret, _SERVER, theirs, challenge))

    def _answer(self, frame: bytes) -> bytes:
        if len(frame) < 3:
            raise ProtocolError(f"request of {len(frame)} bytes")
        op, n = struct.unpack(">BH", frame[:3])
        if n > MAX_KEY or len(frame) < 3 + n:
            raise ProtocolError(f"key of {n} bytes in a request of {len(frame)}")
        try:
            key, value = frame[3:3 + n].decode(), frame[3 + n:]
        except UnicodeDecodeError as e:
            raise ProtocolError("key is not UTF-8") from e
        if op == _SET:
            self.set(key, value)
            return bytes([_OK])
        if op == _ADD:
            if len(value) != 8:
                raise ProtocolError("add takes an 8-byte amount")
            return bytes([_OK]) + struct.pack(">q", self.add(key, struct.unpack(">q", value)[0]))
        if op == _CHECK:
            return bytes([_OK if self.check(key) else _MISSING])
        if op == _DELETE:
            return bytes([_OK if self.delete(key) else _MISSING])
        if op == _GET:
            if len(value) != 8:
                raise ProtocolError("get takes an 8-byte timeout")
            found = self.get(key, struct.unpack(">q", value)[0] / 1000)
            return bytes([_MISSING]) if found is None else bytes([_OK]) + found
        raise ProtocolError(f"unknown operation {op}")

    # -- the table: what a request does, for remote clients and for this process (`LocalRendezvousStore`) --
    def set(self, key: str, value: bytes) -> None:
        with self._cond:
            self._store(key, value)

    def add(self, key: str, amount: int) -> int:
        with self._cond:
            try:
                total = int(self._table.get(key, b"0")) + amount
            except ValueError as e:
                raise ProtocolError(f"add to {key!r}, which holds no number") from e
            self._store(key, str(total).encode())
            return total

    def check(self, key: str) -> bool:
        with self._cond:
            return key in self._table

    def delete(self, key: str) -> bool:
        with self._cond:
            old = self._table.pop(key, None)
            self._bytes -= len(old) if old is not None else 0
            return old is not None

    def get(self, key: str, timeout_s: float) -> bytes | None:
        """The value of `key`, waiting up to `timeout_s` for it to be set; None if it is not."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while key not in self._table and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)
            return self._table.get(key)

    def _store(self, key: str, value: bytes) -> None:
        """Caller holds the lock. ProtocolError when the table is full."""
        old = self._table.get(key)
        grown = self._bytes + len(value) - (len(old) if old is not None else 0)
        if (old is None and len(self._table) >= MAX_KEYS) or grown > MAX_TABLE_BYTES:
            raise ProtocolError(f"table full ({len(self._table)} keys, {self._bytes} bytes)")
        self._table[key] = value
        self._bytes = grown
        self._cond.notify_all()


def _close(sock: socket.socket) -> None:
    try:
        sock.close()
    except OSError:
        pass


class RendezvousStore(dist.Store):
    """A `torch.distributed.Store` over a `RendezvousServer`: connects and proves `secret` at once
    (TransferError if it cannot within `timeout_s`); then one request at a time (thread-safe)."""

    def __init__(self, host: str, port: int, secret: bytes, timeout_s: float) -> None:
        super().__init__()
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        try:
            self._sock = socket.create_connection((host, port), timeout=timeout_s)
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            challenge = _recv_exact(self._sock, _NONCE)
            mine = secrets.token_bytes(_NONCE)
            self._sock.sendall(mine + proof(secret, _CLIENT, challenge, mine))
            if not hmac.compare_digest(_recv_exact(self._sock, 32), proof(secret, _SERVER, mine, challenge)):
                raise ProtocolError("the rendezvous did not prove the deployment's secret")
        except (OSError, ProtocolError) as e:
            self.close()
            raise TransferError(f"rendezvous {host}:{port} refused or unreachable: {e}") from e

    def close(self) -> None:
        sock = getattr(self, "_sock", None)
        if sock is not None:
            _close(sock)

    def _call(self, op: int, key: str, value: bytes = b"", wait_s: float = 0.0) -> bytes:
        with self._lock:
            try:
                self._sock.settimeout(wait_s + self._timeout_s)
                _send_frame(self._sock, _request(op, key, value))
                answer = _recv_frame(self._sock)
            except (OSError, ProtocolError) as e:
                raise TransferError(f"rendezvous request failed: {e}") from e
        if not answer or answer[0] == _ERROR:
            raise TransferError(f"rendezvous refused a request for {key!r}")
        return answer

    # -- the Store API the process groups use -----------------------------------------------------
    def set(self, key: str, value: bytes | str) -> None:
        self._call(_SET, key, value.encode() if isinstance(value, str) else bytes(value))

    def get(self, key: str) -> bytes:
        answer = self._call(_GET, key, struct.pack(">q", int(self._timeout_s * 1000)), self._timeout_s)
        if answer[0] != _OK:
            raise TransferError(f"rendezvous: no {key!r} within {self._timeout_s} s")
        return answer[1:]

    def add(self, key: str, amount: int) -> int:
        return struct.unpack(">q", self._call(_ADD, key, struct.pack(">q", amount))[1:9])[0]

    def check(self, keys: list[str]) -> bool:
        return all(self._call(_CHECK, k)[0] == _OK for k in keys)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        wait_s = timeout.total_seconds() if timeout is not None else self._timeout_s
        deadline = time.monotonic() + wait_s
        for k in keys:
            left = max(0.0, deadline - time.monotonic())
            answer = self._call(_GET, k, struct.pack(">q", int(left * 1000)), left)
            if answer[0] != _OK:
                raise TransferError(f"rendezvous: no {k!r} within {wait_s} s")

    def delete_key(self, key: str) -> bool:
        return self._call(_DELETE, key)[0] == _OK

    def num_keys(self) -> int:
        raise NotImplementedError("the rendezvous does not count keys")


class LocalRendezvousStore(dist.Store):
    """A `torch.distributed.Store` over this process's own `RendezvousServer`: the receiver's side of its
    pairs reads and writes the table directly (no socket to itself; the receiver checks its pairs'
    generation once per received message). Same answers and timeouts as `RendezvousStore`."""

    def __init__(self, server: RendezvousServer, timeout_s: float) -> None:
        super().__init__()
        self._server, self._timeout_s = server, timeout_s

    def close(self) -> None:
        pass  # the server is the connector's; it closes it

    def set(self, key: str, value: bytes | str) -> None:
        try:
            self._server.set(key, value.encode() if isinstance(value, str) else bytes(value))
        except ProtocolError as e:
            raise TransferError(f"rendezvous refused a request for {key!r}: {e}") from e

    def get(self, key: str) -> bytes:
        found = self._server.get(key, self._timeout_s)
        if found is None:
            raise TransferError(f"rendezvous: no {key!r} within {self._timeout_s} s")
        return found

    def add(self, key: str, amount: int) -> int:
        try:
            return self._server.add(key, amount)
        except ProtocolError as e:
            raise TransferError(f"rendezvous refused a request for {key!r}: {e}") from e

    def check(self, keys: list[str]) -> bool:
        return all(self._server.check(k) for k in keys)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        wait_s = timeout.total_seconds() if timeout is not None else self._timeout_s
        deadline = time.monotonic() + wait_s
        for k in keys:
            if self._server.get(k, max(0.0, deadline - time.monotonic())) is None:
                raise TransferError(f"rendezvous: no {k!r} within {wait_s} s")

    def delete_key(self, key: str) -> bool:
        return self._server.delete(key)

    def num_keys(self) -> int:
        raise NotImplementedError("the rendezvous does not count keys")
