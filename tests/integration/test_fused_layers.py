"""The fused pointwise kernels (RMSNorm, SiLU(gate) * up) of every build this CPU runs agree with transformers'
operators, and an engine whose eager steps run them still equals `generate` token for token (fp32)."""
from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from engine import CacheConfig, EngineConfig, LLMEngine, SamplingParams, hardware, kernels
from engine.fused_layers import FusedGatedMLP, FusedRMSNorm, fuse, reference_rms_norm
from tests.conftest import TINY, greedy_reference, random_prompt

BUILDS = hardware.runnable(hardware.this_cpu())


def _loaded(build: hardware.KernelBuild) -> kernels.Kernel:
    try:
        return kernels.load(build)
    except kernels.KernelError as e:
        if build.needs:  # a vector build this CPU runs must build
            raise
        pytest.skip(f"no C compiler for the portable kernel: {e}")


def _assert_matches(got_norm, want_norm, got_silu, want_silu, dtype, where) -> None:
    assert got_norm.dtype == got_silu.dtype == dtype
    if dtype == torch.bfloat16:  # a row's sum of squares in another order: the norm may round a bit apart
        torch.testing.assert_close(got_norm, want_norm, rtol=2 ** -7, atol=1e-6, msg=str(where))
        assert torch.equal(got_silu, want_silu), where
    else:
        torch.testing.assert_close(got_norm, want_norm, rtol=2e-6, atol=1e-6, msg=str(where))
        torch.testing.assert_close(got_silu, want_silu, rtol=4e-6, atol=1e-6, msg=str(where))


@pytest.mark.parametrize("build", BUILDS, ids=[b.name for b in BUILDS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pointwise_kernels_match_torch(build, dtype):
    """Through the torch operators bound to each build: rows of widths with and without a tail past the vectors
    (1 to 4,099: past one thread's chunk of SiLU * up, with a tail), one row to hundreds, large and small values,
    gates whose e^-gate the vector exp cannot build (-88.5, -200) and non-contiguous inputs. SiLU * up in bf16 bit for
    bit (both round where torch's operators round); the rest within a rounding."""
    kernel = _loaded(build)
    sel = kernels.active()
    if sel.op is None:
        pytest.skip(f"no torch operator here: {sel.calls}")
    assert kernel.has_pointwise(torch.float32) == kernel.has_pointwise(torch.bfloat16) == (build.name != "portable")
    if not kernel.has_pointwise(dtype):
        return
    try:
        op, calls = kernels._torch_op(kernel)
        assert op is not None, calls
        norm, silu_mul = torch.ops.pdserve_cpu.rms_norm.default, torch.ops.pdserve_cpu.silu_mul.default
        g = torch.Generator().manual_seed(0)
        for rows, cols in ((1, 576), (7, 576), (300, 64), (3, 100), (3, 4099), (5, 13), (4, 1), (1, 17)):
            x = (torch.randn(rows, cols, generator=g) * 3).to(dtype)
            w = torch.randn(cols, generator=g).to(dtype)
            gate = (torch.randn(rows, cols, generator=g) * 8).to(dtype)
            gate[0, 0], gate[-1, -1] = -200.0, 200.0  # e^-gate past what fp32 holds, and its inverse
            gate.view(-1)[gate.numel() // 2] = -88.5  # e^88.5 holds in fp32, past what the vector exp builds
            up = torch.randn(rows, cols, generator=g).to(dtype)
            _assert_matches(norm(x, w, 1e-5), reference_rms_norm(x, w, 1e-5), silu_mul(gate, up),
                            torch.nn.functional.silu(gate) * up, dtype, (rows, cols))
            if rows > 1:  # the ctypes entry points (the load-time check's) compute the same
                _assert_matches(kernel.rms_norm(x, w, 1e-5), reference_rms_norm(x, w, 1e-5),
                                kernel.silu_mul(gate, up), torch.nn.functional.silu(gate) * up, dtype, "ctypes")
        base = torch.randn(64, 300, generator=g).to(dtype)
        strided, w = base.t(), torch.randn(64, generator=g).to(dtype)  # [300, 64], not contiguous
        assert not strided.is_contiguous()
        gate, up = base[:, ::2], base[:, 1::2]
        _assert_matches(norm(strided, w, 1e-6), reference_rms_norm(strided, w, 1e-6), silu_mul(gate, up),
                        torch.nn.functional.silu(gate) * up, dtype, "strided")
    finally:
        kernels._torch_op(sel.kernel)  # the process's operator serves its active build again


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


def _counted(model: torch.nn.Module) -> list[int]:
    """Count the fused modules' kernel calls (one counter for the norms, one for the MLPs)."""
    calls = [0, 0]

    def counting(op: object, i: int) -> object:
        def call(*args: object) -> torch.Tensor:
            calls[i] += 1
            return op(*args)
        return call

    for m in model.modules():
        if isinstance(m, (FusedRMSNorm, FusedGatedMLP)):
            m._op = counting(m._op, int(isinstance(m, FusedGatedMLP)))
    return calls


def test_engine_on_fused_layers_matches_generate(tiny_pair):
    """Prompts whole, in chunks (one block, uneven) and next to decoding sequences: every eager step runs the
    fused layers' kernels, and the greedy tokens are `generate`'s."""
    ref, model = tiny_pair
    if kernels.active().pointwise_ops(torch.float32) is None:
        pytest.skip("no pointwise kernels in this process's build")
    prompts = [random_prompt(n, seed=n) for n in (5, 40, 97, 150)]
    expected = [greedy_reference(ref, p, 16) for p in prompts]
    layers = model.config.num_hidden_layers
    for chunk in (16, 23, 256):
        engine = LLMEngine(EngineConfig(dtype="float32", prefill_chunk_tokens=chunk,
                                        cache=CacheConfig(block_size=16, memory_gib=0.02)), model=model)
        assert _fused(engine.runner.model) == (2 * layers + 1, layers)
        calls = _counted(engine.runner.model)
        outs = engine.generate(prompts, SamplingParams(max_tokens=16))
        assert [o.output_token_ids for o in outs] == expected, chunk
        assert calls[0] >= 16 * (2 * layers + 1) and calls[1] >= 16 * layers, calls  # every step, every layer


def test_qwen3_with_its_head_norms_fused_matches_generate():
    """Qwen3 norms each head's queries and keys too (rows of the head dimension): fused, greedy equals `generate`."""
    if kernels.active().pointwise_ops(torch.float32) is None:
        pytest.skip("no pointwise kernels in this process's build")
    torch.manual_seed(0)
    ref = Qwen3ForCausalLM(Qwen3Config(**{**TINY, "head_dim": 64})).eval()
    ref.generation_config.eos_token_id, ref.generation_config.pad_token_id = None, 0
    model = copy.deepcopy(ref)
    engine = LLMEngine(EngineConfig(dtype="float32", prefill_chunk_tokens=23,
                                    cache=CacheConfig(block_size=16, memory_gib=0.02)), model=model)
    layers = model.config.num_hidden_layers
    assert _fused(engine.runner.model) == (4 * layers + 1, layers)  # input, post-attention, q and k norms; final
    calls = _counted(engine.runner.model)
    prompts = [random_prompt(n, seed=n) for n in (9, 70)]
    outs = engine.generate(prompts, SamplingParams(max_tokens=12))
    assert [o.output_token_ids for o in outs] == [greedy_reference(ref, p, 12) for p in prompts]
    assert calls[0] > 0 and calls[1] > 0


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
