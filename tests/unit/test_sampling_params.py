"""Unit tests for request and engine validation: SamplingParams, EngineConfig, CacheConfig, KVLayout."""
from __future__ import annotations

import dataclasses
import math

import pytest

from engine.config import CacheConfig, EngineConfig, KVLayout
from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams

# (field, bad value, words the message must contain: the field and the allowed range)
BAD = [
    ("max_tokens", 0, ">= 1"),
    ("max_tokens", -5, ">= 1"),
    ("max_tokens", 2.0, ">= 1"),
    ("max_tokens", "16", ">= 1"),
    ("max_tokens", True, ">= 1"),
    ("max_tokens", None, ">= 1"),
    ("temperature", -0.1, "[0, 100]"),
    ("temperature", math.nan, "[0, 100]"),
    ("temperature", math.inf, "[0, 100]"),
    ("temperature", "0.5", "[0, 100]"),
    ("top_p", 0, "(0, 1]"),
    ("top_p", 0.0, "(0, 1]"),
    ("top_p", 1.5, "(0, 1]"),
    ("top_p", -0.1, "(0, 1]"),
    ("top_p", math.nan, "(0, 1]"),
    ("top_k", -1, ">= 0"),
    ("top_k", 1.5, ">= 0"),
    ("top_k", True, ">= 0"),
    ("seed", -1, "[0, 2**63)"),
    ("seed", 2**63, "[0, 2**63)"),
    ("seed", 1.0, "[0, 2**63)"),
    ("seed", False, "[0, 2**63)"),
    ("stop", "", "non-empty"),
    ("stop", ["ok", ""], "non-empty"),
    ("stop", [1], "str"),
    ("stop", ["ok", None], "str"),
    ("stop", 5, "list of str"),
    ("stop_token_ids", [-1], "non-negative int"),
    ("stop_token_ids", -3, "non-negative int"),
    ("stop_token_ids", ["2"], "non-negative int"),
    ("stop_token_ids", "2", "non-negative int"),
    ("stop_token_ids", [1.0], "non-negative int"),
    ("stop_token_ids", [True], "non-negative int"),
    ("stop_token_ids", 7.5, "list of int"),
    ("logprobs", -1, "[0, 20]"),
    ("logprobs", 21, "[0, 20]"),
    ("logprobs", True, "[0, 20]"),
    ("logprobs", 2.0, "[0, 20]"),
    ("logit_bias", 5, "(token id, bias) pairs"),
    ("logit_bias", [(-1, 1.0)], "integers >= 0"),
    ("logit_bias", [(True, 1.0)], "integers >= 0"),
    ("logit_bias", [(3, 100.5)], "[-100, 100]"),
    ("logit_bias", [(3, float("nan"))], "[-100, 100]"),
    ("logit_bias", [(3, 1.0), (3, 2.0)], "twice"),
    ("logit_bias", [(i, 1.0) for i in range(301)], "at most 300"),
]


@pytest.mark.parametrize(("field", "value", "allowed"), BAD, ids=[f"{f}={v!r}" for f, v, _ in BAD])
def test_bad_values_raise_invalid_request(field: str, value: object, allowed: str) -> None:
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**{field: value})
    assert isinstance(e.value, ValueError)
    assert e.value.field == field
    msg = str(e.value)
    assert msg.startswith(f"{field}: ") and allowed in msg


GOOD = [
    {},
    {"max_tokens": 1},
    {"max_tokens": 100_000},
    {"temperature": 0},
    {"temperature": 0.7, "top_p": 0.9, "top_k": 40},
    {"temperature": 100},
    {"top_p": 1},
    {"top_p": 1e-6},
    {"top_k": 0},
    {"seed": 0},
    {"seed": 2**63 - 1},
    {"stop": ["a", "bc"]},
    {"stop": ()},
    {"stop_token_ids": [0, 7]},
    {"stop_token_ids": 3},
    {"ignore_eos": True},
    {"logprobs": 0},
    {"logprobs": 20},
    {"logprobs": None},
]


@pytest.mark.parametrize("kwargs", GOOD, ids=[repr(k) for k in GOOD])
def test_good_values_pass(kwargs: dict) -> None:
    sp = SamplingParams(**kwargs)
    for k, v in kwargs.items():
        if k not in ("stop", "stop_token_ids"):
            assert getattr(sp, k) == v
    assert isinstance(sp.stop, tuple) and isinstance(sp.stop_token_ids, tuple)


def test_logit_bias_is_sorted_by_token_and_counts_as_adjusting_the_logits() -> None:
    sp = SamplingParams(logit_bias=[(9, -100), (2, 5.5)])
    assert sp.logit_bias == ((2, 5.5), (9, -100.0)) and sp.adjusts_logits
    assert not SamplingParams().adjusts_logits and hash(sp) == hash(SamplingParams(logit_bias=((2, 5.5), (9, -100))))


def test_single_values_become_tuples() -> None:
    assert SamplingParams(stop="x").stop == ("x",)
    assert SamplingParams(stop=["x", "yz"]).stop == ("x", "yz")
    assert SamplingParams(stop_token_ids=5).stop_token_ids == (5,)
    assert SamplingParams(stop_token_ids=[1, 2]).stop_token_ids == (1, 2)


def test_frozen_and_hashable() -> None:
    sp = SamplingParams(stop=["a"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        sp.max_tokens = 3  # type: ignore[misc]
    assert hash(sp) == hash(SamplingParams(stop=("a",)))


@pytest.mark.parametrize(("kwargs", "greedy"), [
    ({}, True), ({"temperature": 0.0}, True), ({"temperature": 1.0}, False),
    ({"temperature": 1.0, "top_k": 1}, True), ({"temperature": 1.0, "top_k": 2}, False),
    ({"temperature": 0.5, "top_p": 0.5}, False),
])
def test_greedy(kwargs: dict, greedy: bool) -> None:
    assert SamplingParams(**kwargs).greedy is greedy


# -- engine configuration --------------------------------------------------------------------------

@pytest.mark.parametrize(("kwargs", "field"), [
    ({"dtype": "int8"}, "dtype"),
    ({"dtype": "fp16"}, "dtype"),
    ({"dtype": "float16"}, "dtype"),  # float16 on cpu
    ({"dtype": "float16", "device": "cpu"}, "dtype"),
    ({"device": "tpu"}, "device"),
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
    ({"max_model_len": 1}, "max_model_len"),
    ({"num_threads": 0}, "num_threads"),
])
def test_engine_config_rejects(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        EngineConfig(**kwargs)


def test_engine_config_accepts() -> None:
    EngineConfig()
    EngineConfig(dtype="float16", device="cuda:0")
    EngineConfig(dtype="float32", device="cuda", max_num_seqs=1, max_num_batched_tokens=1, max_model_len=2)
    cfg = EngineConfig(cache=CacheConfig(block_size=1, memory_gib=0.001, enable_prefix_caching=False))
    assert cfg.cache.block_size == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.dtype = "float32"  # type: ignore[misc]


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"block_size": 0}, "block_size"),
    ({"block_size": -16}, "block_size"),
    ({"block_size": 2048}, "block_size"),
    ({"memory_gib": 0}, "memory_gib"),
    ({"memory_gib": -1.0}, "memory_gib"),
    ({"memory_gib": math.nan}, "memory_gib"),
])
def test_cache_config_rejects(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        CacheConfig(**kwargs)


def test_kv_layout_block_count() -> None:
    cache = CacheConfig(block_size=16, memory_gib=1.0)
    layout = KVLayout.from_budget(num_layers=4, num_kv_heads=2, head_dim=64, dtype_bytes=2, cache=cache)
    per_block = 2 * 4 * 16 * 2 * 64 * 2  # K and V, layers, tokens, heads, head dim, bytes = 32 KiB
    assert layout.bytes_per_block == per_block == 32 * 1024
    assert layout.num_blocks == (1 << 30) // per_block == 32768
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.block_size, layout.dtype_bytes) \
        == (4, 2, 64, 16, 2)


def test_kv_layout_rounds_down() -> None:
    cache = CacheConfig(block_size=4, memory_gib=1.0)
    layout = KVLayout.from_budget(num_layers=3, num_kv_heads=1, head_dim=5, dtype_bytes=4, cache=cache)
    per_block = 2 * 3 * 4 * 1 * 5 * 4
    assert layout.num_blocks == (1 << 30) // per_block
    assert layout.num_blocks * layout.bytes_per_block <= 1 << 30 < (layout.num_blocks + 1) * layout.bytes_per_block


def test_kv_layout_budget_too_small() -> None:
    per_block = 2 * 32 * 16 * 8 * 128 * 2  # 2 MiB
    tiny = CacheConfig(block_size=16, memory_gib=(per_block - 1) / (1 << 30))
    with pytest.raises(ValueError, match="holds no KV block") as e:
        KVLayout.from_budget(num_layers=32, num_kv_heads=8, head_dim=128, dtype_bytes=2, cache=tiny)
    assert "memory_gib" in str(e.value)
    exact = CacheConfig(block_size=16, memory_gib=per_block / (1 << 30))
    assert KVLayout.from_budget(num_layers=32, num_kv_heads=8, head_dim=128, dtype_bytes=2, cache=exact).num_blocks == 1
