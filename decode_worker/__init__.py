"""Decode workers: continuous-batching decode over a paged KV cache, KV received from prefill workers."""
from decode_worker.worker import DecodeWorker

__all__ = ["DecodeWorker"]
