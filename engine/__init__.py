"""pdserve's engine: paged KV cache, continuous batching, transformers models. Never imports Ray."""
from engine.config import CacheConfig, EngineConfig, KVLayout
from engine.errors import InvalidRequestError
from engine.llm_engine import EngineStats, LLMEngine, RequestOutput
from engine.sampling_params import SamplingParams

__all__ = [
           "CacheConfig",
           "EngineConfig",
           "EngineStats",
           "InvalidRequestError",
           "KVLayout",
           "LLMEngine",
           "RequestOutput",
           "SamplingParams",
]
