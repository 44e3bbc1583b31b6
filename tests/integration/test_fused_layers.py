"""The fused pointwise kernels (RMSNorm, SiLU(gate) * up) of every build this CPU runs agree with transformers'
operators, and an engine whose eager steps run them still equals `generate` token for token (fp32)."""
from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from engine import CacheConfig, EngineConfig, LLMEngine, SamplingParams, hardware, kernels
from engine.fused_layers import FusedGatedMLP, FusedRMSNorm, fuse, reference_rms_norm
from tests.conftest import TINY, greedy_reference, random_prompt

BUILDS = hardware.runnable(hardware.this_cpu())


def _bound(build: hardware.KernelBuild) -> tuple[object, object] | None:
    """The operators bound to `build` (None: it holds no pointwise kernels); the caller rebinds the active one."""
    try:
        kernel = kernels.load(build)
    except kernels.KernelError as e:
        if build.needs:
            raise
        pytest.skip(f"no C compiler for the portable kernel: {e}")
    if kernels.active().op is None:
        pytest.skip("no torch operator here")
    op, calls = kernels._torch_op(kernel)
    assert op is not None, calls
    has = kernel.has_pointwise(torch.float32)
    assert has == kernel.has_pointwise(torch.bfloat16) == (build.name != "portable")
    return (torch.ops.pdserve_cpu.rms_norm.default, torch.ops.pdserve_cpu.silu_mul.default) if has else None


@pytest.mark.parametrize("build", BUILDS, ids=[b.name for b in BUILDS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pointwise_kernels_match_torch(build, dtype):
    """Rows of widths with and without a tail past the vectors (1 to 4,096), one row to hundreds, large and small
    values. SiLU * up in bf16 bit for bit (both round where torch's operators round); the rest within a rounding."""
    try:
        ops = _bound(build)
        if ops is None:
            return
        norm, silu_mul = ops
        g = torch.Generator().manual_seed(0)
        for rows, cols in ((1, 576), (7, 576), (300, 64), (3, 100), (2, 4096), (5, 13), (4, 1), (1, 17)):
            x = (torch.randn(rows, cols, generator=g) * 3).to(dtype)
            w = torch.randn(cols, generator=g).to(dtype)
            gate = (torch.randn(rows, cols, generator=g) * 8).to(dtype)
            gate[0, 0], gate[-1, -1] = -200.0, 200.0  # e^-gate past what fp32 holds, and its inverse
            up = torch.randn(rows, cols, generator=g).to(dtype)
            got_norm, want_norm = norm(x, w, 1e-5), reference_rms_norm(x, w, 1e-5)
            got_silu, want_silu = silu_mul(gate, up), torch.nn.functional.silu(gate) * up
            assert got_norm.dtype == got_silu.dtype == dtype and got_norm.shape == got_silu.shape == x.shape
            if dtype == torch.bfloat16:  # a row's sum of squares in another order: the norm may round a bit apart
                torch.testing.assert_close(got_norm, want_norm, rtol=2 ** -7, atol=1e-6)
                assert torch.equal(got_silu, want_silu), (rows, cols)
            else:
                torch.testing.assert_close(got_norm, want_norm, rtol=2e-6, atol=1e-6)
                torch.testing.assert_close(got_silu, want_silu, rtol=4e-6, atol=1e-6)
        strided = x.t()  # not contiguous: the operator lays it out
        torch.testing.assert_close(norm(strided, x.new_ones(rows), 1e-6).float(),
                                   reference_rms_norm(strided, x.new_ones(rows), 1e-6).float(), rtol=1e-2, atol=1e-2)
    finally:
        kernels._torch_op(kernels.active().kernel)


def test_pointwise_operators_refuse_bad_input_by_name():
    ops = kernels.active().pointwise_ops(torch.float32)
    if ops is None:
        pytest.skip("no pointwise kernels in this process's build")
    norm, silu_mul = ops
    x = torch.randn(3, 8)
    with pytest.raises(RuntimeError, match="weight"):
        norm(x, torch.ones(7), 1e-6)
    with pytest.raises(RuntimeError, match="weight"):
        norm(x, torch.ones(8, dtype=torch.bfloat16), 1e-6)
    with pytest.raises(RuntimeError, match="Half"):
        norm(x.half(), torch.ones(8).half(), 1e-6)
    with pytest.raises(RuntimeError, match="gate and up"):
        silu_mul(x, torch.randn(3, 9))


def _fused(model: torch.nn.Module) -> tuple[int, int]:
    mods = list(model.modules())
    return sum(isinstance(m, FusedRMSNorm) for m in mods), sum(isinstance(m, FusedGatedMLP) for m in mods)


def test_engine_on_fused_layers_matches_generate(tiny_pair):
    """Prompts whole, in chunks (one block, uneven) and next to decoding sequences: every eager step runs the
    fused layers, and the greedy tokens are `generate`'s."""
    ref, model = tiny_pair
    if kernels.active().pointwise_ops(torch.float32) is None:
        pytest.skip("no pointwise kernels in this process's build")
    prompts = [random_prompt(n, seed=n) for n in (5, 40, 97, 150)]
    expected = [greedy_reference(ref, p, 16) for p in prompts]
    for chunk in (16, 23, 256):
        engine = LLMEngine(EngineConfig(dtype="float32", prefill_chunk_tokens=chunk,
                                        cache=CacheConfig(block_size=16, memory_gib=0.02)), model=model)
        layers = model.config.num_hidden_layers
        assert _fused(engine.runner.model) == (2 * layers + 1, layers)
        outs = engine.generate(prompts, SamplingParams(max_tokens=16))
        assert [o.output_token_ids for o in outs] == expected, chunk


def test_fuse_swaps_only_what_it_computes_the_same():
    """An MLP whose activation is no SiLU keeps transformers' module; its norms are fused; a second call swaps
    nothing more and counts what is fused; the fused model's eager forward is the original's."""
    if kernels.active().pointwise_ops(torch.float32) is None:
        pytest.skip("no pointwise kernels in this process's build")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**TINY, "hidden_act": "gelu"})).eval()
    original = copy.deepcopy(model)
    layers = model.config.num_hidden_layers
    assert fuse(model) == 2 * layers + 1
    assert _fused(model) == (2 * layers + 1, 0)
    assert fuse(model) == 2 * layers + 1
    ids = torch.tensor([random_prompt(30, seed=1)])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, original(ids).logits, rtol=1e-5, atol=1e-5)
        norm = model.model.norm
        x = torch.randn(4, TINY["hidden_size"], dtype=torch.bfloat16)  # not the weight's dtype: transformers' formula
        torch.testing.assert_close(norm(x), reference_rms_norm(x, norm.weight, norm.variance_epsilon))
