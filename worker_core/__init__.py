"""What prefill and decode workers share: one engine, its KV connector, the engine-loop thread, and
the typed protocol (`worker_core.protocol`) they speak with the router.

`WorkerBase` loads on first use, so that the router side and `pdserve status` import the protocol
without torch."""
from __future__ import annotations

import importlib

_EXPORTS = {"WorkerBase": "worker_core.base"}
__all__ = ["WorkerBase"]
assert sorted(__all__) == sorted(_EXPORTS)


def __getattr__(name: str) -> object:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'worker_core' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
