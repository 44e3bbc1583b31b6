"""What prefill and decode workers share: one engine, its KV connector, the engine-loop thread."""
from worker_core.base import WorkerBase

__all__ = ["WorkerBase"]
