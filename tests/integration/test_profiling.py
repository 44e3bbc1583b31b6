"""The calibration probe of a prompt computed over a cached prefix, on a real engine over a tiny model:
it times prompts that read the prefix from the cache (only their new tokens computed), leaves every block
free, and declines where no prefix would be read (no prefix cache, or a prefix that is not whole blocks)."""
from __future__ import annotations

from transformers import LlamaConfig, LlamaForCausalLM

from engine.config import CacheConfig, EngineConfig
from engine.llm_engine import LLMEngine
from engine.profiling import time_prefill_over
from tests.conftest import TINY
from tests.integration.test_engine_correctness import assert_all_free, make_engine


def test_prompts_over_a_cached_prefix_compute_only_their_new_tokens():
    engine = make_engine(LlamaForCausalLM(LlamaConfig(**TINY)).eval())
    before = engine.stats.prefill_tokens
    seconds = time_prefill_over(engine, prefix=256, chunk=32, rounds=3)
    assert seconds is not None and seconds >= 0.0
    # the prefix once, then per round 32 tokens over it (the prefix read from the cache) and 32 alone
    assert engine.stats.prefill_tokens - before == 256 + 3 * (32 + 32)
    assert_all_free(engine)


def test_no_prefix_read_no_measurement():
    model = LlamaForCausalLM(LlamaConfig(**TINY)).eval()
    assert time_prefill_over(make_engine(model), prefix=250, chunk=32) is None  # not whole blocks of 16
    cold = LLMEngine(EngineConfig(dtype="float32", cache=CacheConfig(block_size=16, memory_gib=0.02,
                                                                     enable_prefix_caching=False)), model=model)
    assert time_prefill_over(cold, prefix=256, chunk=32) is None
    assert cold.stats.prefill_tokens == 0  # it computed nothing
