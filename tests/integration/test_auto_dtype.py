"""`dtype="auto"`: the engine loads the dtype chosen for this machine and serves the same greedy
tokens as transformers `generate` in that dtype; where the flags do not decide, both are measured."""
from __future__ import annotations

import torch

from engine import CacheConfig, EngineConfig, LLMEngine, SamplingParams, hardware
from engine.auto_dtype import load_for, measure
from engine.model_loader import TORCH_DTYPES, load_model
from tests.conftest import greedy_reference, random_prompt, tiny_model


def test_auto_serves_what_generate_gives_in_the_chosen_dtype(tmp_path):
    tiny_model("llama", seed=3).save_pretrained(tmp_path)
    engine = LLMEngine(EngineConfig(model=str(tmp_path), cache=CacheConfig(memory_gib=0.02)))
    want = hardware.choose_dtype("cpu", hardware.this_cpu()).dtype
    info = engine.describe()
    assert engine.config.dtype == info["dtype"] != "auto"
    if want is not None:  # the flags decide here (AVX2: float32, AVX-512 BF16: bfloat16)
        assert info["dtype"] == want
    assert info["dtype_reason"] and info["attention"] == engine.runner.attention_kernel
    ref, _ = load_model(str(tmp_path), info["dtype"], "cpu")
    ref.generation_config.eos_token_id = None
    prompts = [random_prompt(n, seed=n) for n in (5, 40, 90)]
    outs = engine.generate(prompts, SamplingParams(max_tokens=12))
    for out, prompt in zip(outs, prompts):
        expected = greedy_reference(ref, prompt, 12)
        if info["dtype"] == "float32":
            assert out.output_token_ids == expected
        else:  # bf16: different summation orders may break a near-tie late in the sequence
            assert out.output_token_ids[:4] == expected[:4]


def test_undecided_flags_measure_both_dtypes_on_the_model(tmp_path):
    """Arm with BF16 does not decide: the model is probed in both dtypes, the faster one is loaded and the
    reason gives both timings."""
    tiny_model("qwen2", seed=4).save_pretrained(tmp_path)
    cpu = hardware.CpuInfo("test cpu", frozenset({"asimd", "bf16"}), "aarch64")
    model, _, choice = load_for("auto", str(tmp_path), "cpu", cpu=cpu)
    assert choice.reason.startswith("measured on the model: float32 ")
    assert next(model.parameters()).dtype == TORCH_DTYPES[choice.dtype]
    seconds = measure(model)
    assert set(seconds) == {"float32", "bfloat16"} and all(s > 0 for s in seconds.values())
    assert next(model.parameters()).dtype == TORCH_DTYPES[choice.dtype]  # the probe leaves the model as it was


def test_explicit_dtype_wins(tmp_path):
    tiny_model("llama", seed=5).save_pretrained(tmp_path)
    engine = LLMEngine(EngineConfig(model=str(tmp_path), dtype="bfloat16", cache=CacheConfig(memory_gib=0.02)))
    assert engine.describe()["dtype"] == "bfloat16" and engine.describe()["dtype_reason"] == "set explicitly"
    assert engine.runner.kv.dtype == torch.bfloat16
