"""Frozen KV transfer configuration."""
from __future__ import annotations

from dataclasses import dataclass, field

BACKENDS = ("torch_dist", "object_store", "local")


@dataclass(frozen=True)
class TransferConfig:
    """How KV blocks move between workers.

    Args:
        backend: "torch_dist" (per-pair NCCL/gloo groups, default), "object_store" (Ray fallback)
            or "local" (in-process, for tests).
        timeout_s: longest wait for any single step (group set-up, one message) before FAILED.
        host: address a receiver advertises for its rendezvous; None picks this machine's address.
        port: port of that rendezvous; 0 picks a free one.
    """

    backend: str = field(default="torch_dist", metadata={"flag": "--transfer-backend", "choices": BACKENDS,
                                                         "help": "how KV moves between workers"})
    timeout_s: float = field(default=30.0, metadata={"flag": "--transfer-timeout",
                                                     "help": "seconds before a KV transfer fails"})
    host: str | None = None
    port: int = 0

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 seconds, got {self.timeout_s}")
        if self.host is not None and not self.host:
            raise ValueError("host must be a non-empty address or None (auto), got ''")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535] (0 = any free port), got {self.port}")
