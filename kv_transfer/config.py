"""Frozen KV transfer configuration."""
from __future__ import annotations

import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

BACKENDS = ("torch_dist", "object_store", "local")
SECRET_ENV = "PDSERVE_TRANSFER_SECRET"
MIN_SECRET = 16  # characters


@dataclass(frozen=True)
class TransferConfig:
    """How KV blocks move between workers.

    Args:
        backend: "torch_dist" (per-pair NCCL/gloo groups, default), "object_store" (Ray fallback)
            or "local" (in-process, for tests).
        timeout_s: longest wait for any single step (group set-up, one message) before FAILED.
        host: address a receiver's rendezvous and every pair group listen on (and the receiver
            advertises); None: the worker's node address as Ray knows it (loopback on a local
            cluster).
        port: port of that rendezvous; 0 picks a free one.
        secret: the deployment's secret every pair proves before any KV moves (`kv_transfer.rendezvous`,
            `kv_transfer.pair_group`); a fresh random one per config by default, so workers built
            from one config (one deployment) share it. Never printed (not in the repr); configs that
            differ in it alone compare equal.
    """

    backend: str = field(default="torch_dist", metadata={"flag": "--transfer-backend", "choices": BACKENDS,
                                                         "help": "how KV moves between workers"})
    timeout_s: float = field(default=30.0, metadata={"flag": "--transfer-timeout",
                                                     "help": "seconds before a KV transfer fails"})
    host: str | None = None
    port: int = 0
    secret: str = field(default_factory=lambda: secrets.token_hex(32), repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 seconds, got {self.timeout_s}")
        if self.host is not None and not self.host:
            raise ValueError("host must be a non-empty address or None (auto), got ''")
        if len(self.secret) < MIN_SECRET:
            raise ValueError(f"secret must be at least {MIN_SECRET} characters, got {len(self.secret)}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535] (0 = any free port), got {self.port}")


def operator_secret(path: str | None, env: Mapping[str, str]) -> str | None:
    """The transfer secret an operator gives: the file at `path` (its text, stripped), else
    `$PDSERVE_TRANSFER_SECRET`; None when neither is given (each deployment then makes its own).
    Raises ValueError naming the source of an unreadable or too short secret."""
    if path is not None:
        source = f"--transfer-secret-file {path}"
        try:
            secret = Path(path).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"{source}: cannot read it: {type(e).__name__}") from None
    elif env.get(SECRET_ENV, "").strip():
        source, secret = f"${SECRET_ENV}", env[SECRET_ENV].strip()
    else:
        return None
    if len(secret) < MIN_SECRET:
        raise ValueError(f"{source}: the transfer secret must be at least {MIN_SECRET} characters, got {len(secret)}")
    return secret
