"""Prefill workers: batched prompt passes whose KV streams, layer by layer, to decode workers."""
from prefill_worker.worker import PrefillWorker

__all__ = ["PrefillWorker"]
