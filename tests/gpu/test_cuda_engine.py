"""On CUDA, the engine's greedy output equals transformers `generate` on CUDA, token for token (fp32):
prompts of different lengths batched together, a prompt whose prefix is cached, the compiled decode
step. bf16 runs. Decode attention is the Triton kernel where triton is installed, else gather + SDPA."""
from __future__ import annotations

import copy

import pytest
import torch
from transformers import PreTrainedModel

from engine import CacheConfig, EngineConfig, LLMEngine, SamplingParams, triton_attention
from tests.conftest import random_prompt, tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def greedy_cuda(model: PreTrainedModel, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy `generate` on the model's device, one sequence at a time (no padding)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt], device=model.device), max_new_tokens=max_new_tokens,
                             do_sample=False, min_new_tokens=0)
    return out[0, len(prompt):].tolist()


def make_engine(model: PreTrainedModel, dtype: str, block_size: int = 16, memory_gib: float = 0.05,
                **kw: object) -> LLMEngine:
    cfg = EngineConfig(dtype=dtype, device="cuda", cache=CacheConfig(block_size=block_size, memory_gib=memory_gib),
                       **kw)
    engine = LLMEngine(cfg, model=model)
    assert engine.runner.attention_kernel == ("triton" if triton_attention.available() else "torch")
    return engine


def assert_all_free(engine: LLMEngine) -> None:
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


@pytest.fixture
def llama_pair() -> tuple[PreTrainedModel, PreTrainedModel]:
    """(reference, engine copy) on CUDA in fp32: the engine switches its copy's attention to paged."""
    ref = tiny_model("llama").to("cuda")
    return ref, copy.deepcopy(ref)


@pytest.mark.parametrize("block_size", [16, 8])
def test_batched_greedy_matches_generate(llama_pair, block_size: int) -> None:
    ref, model = llama_pair
    prompts = [random_prompt(n, seed=n) for n in (1, 7, 33, 150)]
    expected = [greedy_cuda(ref, p, 24) for p in prompts]
    engine = make_engine(model, "float32", block_size=block_size)
    assert engine.runner.device.type == "cuda" and engine.runner.kv.is_cuda
    outs = engine.generate(prompts, SamplingParams(max_tokens=24))
    for out, exp in zip(outs, expected):
        assert out.output_token_ids == exp
        assert out.finish_reason == "length"
    assert_all_free(engine)


def test_cached_prefix_matches_generate(llama_pair) -> None:
    ref, model = llama_pair
    prefix = random_prompt(96, seed=30)  # six full blocks of 16
    a, b = prefix + random_prompt(20, seed=31), prefix + random_prompt(37, seed=32)
    exp_a, exp_b = greedy_cuda(ref, a, 12), greedy_cuda(ref, b, 12)
    engine = make_engine(model, "float32")
    assert engine.generate([a], SamplingParams(max_tokens=12))[0].output_token_ids == exp_a
    before = engine.stats.prefill_tokens
    outs = engine.generate([b, random_prompt(11, seed=33)], SamplingParams(max_tokens=12))  # batched with another
    assert outs[0].num_cached_tokens == 96
    assert engine.stats.prefill_tokens - before == len(b) - 96 + 11
    assert outs[0].output_token_ids == exp_b
    assert_all_free(engine)


def test_bf16_runs() -> None:
    model = tiny_model("llama").to("cuda", torch.bfloat16)
    engine = make_engine(model, "bfloat16")
    assert engine.runner.kv.dtype == torch.bfloat16
    prompts = [random_prompt(n, seed=n) for n in (3, 40, 90)]
    outs = engine.generate(prompts, SamplingParams(max_tokens=16))
    for out in outs:
        assert len(out.output_token_ids) == 16 and out.finish_reason == "length"
        assert all(0 <= t < engine.vocab_size for t in out.output_token_ids)
    assert_all_free(engine)


def test_compiled_decode_matches_generate(llama_pair) -> None:
    """`compile=True` on CUDA: the decode step as one torch.compile graph, batch 1 and batched."""
    if not triton_attention.available():
        pytest.skip("compiled decode needs the Triton kernel")
    ref, model = llama_pair
    prompts = [random_prompt(n, seed=n) for n in (5, 37, 80)]
    expected = [greedy_cuda(ref, p, 16) for p in prompts]
    engine = make_engine(model, "float32", compile=True)
    assert engine.runner.compiled
    assert engine.generate([prompts[1]], SamplingParams(max_tokens=16))[0].output_token_ids == expected[1]
    assert [o.output_token_ids for o in engine.generate(prompts, SamplingParams(max_tokens=16))] == expected
    assert_all_free(engine)


def test_auto_dtype_follows_the_device(tmp_path) -> None:
    """`dtype="auto"` on CUDA: bfloat16 on devices that compute in bf16 natively (compute capability
    8.0 and later), float16 before them; the reason says which."""
    tiny_model("llama", seed=2).save_pretrained(tmp_path)
    engine = LLMEngine(EngineConfig(model=str(tmp_path), device="cuda", cache=CacheConfig(memory_gib=0.05)))
    major = torch.cuda.get_device_capability()[0]
    info = engine.describe()
    assert info["dtype"] == ("bfloat16" if major >= 8 else "float16") and "CUDA" in info["dtype_reason"]
    assert engine.runner.kv.dtype == getattr(torch, info["dtype"])
    out = engine.generate([random_prompt(20, seed=1)], SamplingParams(max_tokens=8))[0]
    assert len(out.output_token_ids) == 8
    assert_all_free(engine)
