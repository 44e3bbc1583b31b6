"""TLS for both API servers: one PEM certificate (chain) and its private key, loaded once at start.

`pdserve serve --ssl-certfile cert.pem --ssl-keyfile key.pem` serves HTTPS and gRPC over TLS on
the same ports; without them both serve plaintext (keep them on loopback or behind a TLS proxy).
A file that cannot be read, or a key that does not match its certificate, is refused at start
with an error naming the flag.
"""
from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc


@dataclass(frozen=True)
class TlsFiles:
    """certfile: the server's certificate (chain), PEM; keyfile: its private key, PEM (unencrypted)."""

    certfile: str
    keyfile: str

    def _read(self) -> tuple[bytes, bytes]:
        pems = []
        for name, path in (("ssl_certfile", self.certfile), ("ssl_keyfile", self.keyfile)):
            try:
                pems.append(Path(path).read_bytes())
            except OSError as e:
                raise ValueError(f"{name}: cannot read {path}: {e.strerror or e}") from None
        return pems[0], pems[1]

    def http_context(self) -> ssl.SSLContext:
        """The HTTPS server's context (TLS 1.2 and later). Raises ValueError naming the bad file."""
        self._read()
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            context.load_cert_chain(self.certfile, self.keyfile)
        except ssl.SSLError as e:
            raise ValueError(f"ssl_certfile / ssl_keyfile: not a PEM certificate and its key ({e.reason})") from None
        return context

    def grpc_credentials(self) -> grpc.ServerCredentials:
        """The gRPC server's credentials (checked with `http_context` first: grpc reports bad PEM late)."""
        cert, key = self._read()
        return grpc.ssl_server_credentials([(key, cert)])
