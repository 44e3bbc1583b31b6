"""What prefill and decode workers share: one engine, its KV connector, the engine-loop thread, and
the typed protocol (`worker_core.protocol`) they speak with the router.

`WorkerBase` is imported on first use, so the router side, and `pdserve status`, import the protocol
without torch."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from worker_core.base import WorkerBase

__all__ = ["WorkerBase"]


def __getattr__(name: str) -> object:
    if name == "WorkerBase":
        from worker_core.base import WorkerBase

        return WorkerBase
    raise AttributeError(f"module 'worker_core' has no attribute {name!r}")
