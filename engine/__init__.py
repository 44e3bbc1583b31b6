"""pdserve's engine: paged KV cache, continuous batching, transformers models. Never imports Ray.

The names below load on first use, so that light modules (`engine.config`, `engine.hardware`)
import without torch and transformers (the CLI builds its flags from them)."""
from __future__ import annotations

import importlib

_EXPORTS = {
    "CacheConfig": "engine.config",
    "EngineConfig": "engine.config",
    "KVLayout": "engine.config",
    "InvalidRequestError": "engine.errors",
    "EngineStats": "engine.llm_engine",
    "LLMEngine": "engine.llm_engine",
    "RequestOutput": "engine.llm_engine",
    "SamplingParams": "engine.sampling_params",
}
__all__ = ["CacheConfig", "EngineConfig", "EngineStats", "InvalidRequestError", "KVLayout", "LLMEngine",
           "RequestOutput", "SamplingParams"]
assert sorted(__all__) == sorted(_EXPORTS)


def __getattr__(name: str) -> object:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
