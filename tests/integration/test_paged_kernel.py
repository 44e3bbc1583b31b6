"""Every kernel build this CPU runs agrees with the plain reference attention over the same paged pool."""
from __future__ import annotations

import copy

import pytest
import torch

from engine import CacheConfig, EngineConfig, LLMEngine, SamplingParams, hardware, kernels
from engine.attention import reference_decode, reference_prefill

CPU = hardware.this_cpu()
BUILDS = hardware.runnable(CPU)


def _loaded(build: hardware.KernelBuild) -> kernels.Kernel:
    try:
        return kernels.load(build)
    except kernels.KernelError as e:
        if build.needs:  # a vector build this CPU runs must build: a compiler that cannot is a finding
            raise
        pytest.skip(f"no C compiler for the portable kernel: {e}")


@pytest.mark.parametrize("build", BUILDS, ids=[b.name for b in BUILDS])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (12, 2), (4, 4), (8, 1), (32, 2), (16, 1)])
@pytest.mark.parametrize("d,bs", [(64, 16), (128, 16), (64, 8), (128, 32), (80, 16), (80, 32), (72, 8)])
def test_kernel_matches_reference(build, dtype, tol, heads, kv_heads, d, bs):
    """Head dims 64 and 128 (unrolled), 80 and 72 (generic; 72 is no multiple of 16), GQA groups of
    1 to 16 (3 and 6: the AVX-512 kernel's groups of three heads), blocks of 8 to 32 tokens, contexts of 1 token to many blocks, scattered block tables."""
    kernel = _loaded(build)
    g = torch.Generator().manual_seed(heads * 10 + kv_heads + d + bs)
    num_blocks = 100 * 16 // bs
    k_pool = torch.randn(kv_heads, num_blocks, bs, d, generator=g).to(dtype)
    v_pool = torch.randn(kv_heads, num_blocks, bs, d, generator=g).to(dtype)
    ctx = torch.tensor([1, 17, 100, 16, 250, 7])
    per_seq = (250 + bs - 1) // bs
    tables = torch.randperm(num_blocks, generator=g)[:per_seq * len(ctx)].view(len(ctx), per_seq)  # own blocks
    q = torch.randn(len(ctx), heads, d, generator=g).to(dtype)
    k_new = torch.randn(kv_heads, len(ctx), d, generator=g).to(dtype)
    v_new = torch.randn(kv_heads, len(ctx), d, generator=g).to(dtype)
    last = ctx - 1
    slots = tables[torch.arange(len(ctx)), last // bs] * bs + last % bs
    out = kernel.paged_decode(q, k_new, v_new, slots, k_pool, v_pool, tables, ctx, d ** -0.5)
    assert out.dtype == dtype and out.shape == q.shape
    for b, pos in enumerate(last.tolist()):  # the new K/V landed at each sequence's last slot
        blk = int(tables[b, pos // bs])
        assert torch.equal(k_pool[:, blk, pos % bs], k_new[:, b])
        assert torch.equal(v_pool[:, blk, pos % bs], v_new[:, b])
    torch.testing.assert_close(out.float(), reference_decode(q, k_pool, v_pool, tables, ctx, d ** -0.5),
                               atol=tol, rtol=tol)


@pytest.mark.parametrize("build", BUILDS, ids=[b.name for b in BUILDS])
def test_kernel_any_thread_count(build):
    """The tasks (sequence, kv head) split among 1 to more threads than there are tasks, over ragged
    contexts: every split gives the reference's answer and writes every new key."""
    kernel = _loaded(build)
    g = torch.Generator().manual_seed(7)
    kvh, heads, d, bs, blocks = 2, 6, 64, 16, 100
    ctx = torch.tensor([300, 1, 40, 2, 129])
    per_seq = (300 + bs - 1) // bs
    tables = torch.randperm(blocks, generator=g)[:per_seq * len(ctx)].view(len(ctx), per_seq)
    last = ctx - 1
    slots = tables[torch.arange(len(ctx)), last // bs] * bs + last % bs
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3, 7, 16):
            k_pool, v_pool = (torch.randn(kvh, blocks, bs, d, generator=g).bfloat16() for _ in range(2))
            q = torch.randn(len(ctx), heads, d, generator=g).bfloat16()
            k_new, v_new = (torch.randn(kvh, len(ctx), d, generator=g).bfloat16() for _ in range(2))
            torch.set_num_threads(threads)
            out = kernel.paged_decode(q, k_new, v_new, slots, k_pool, v_pool, tables, ctx, d ** -0.5)
            for b, pos in enumerate(last.tolist()):
                assert torch.equal(k_pool[:, int(tables[b, pos // bs]), pos % bs], k_new[:, b]), (threads, b)
            torch.testing.assert_close(out.float(), reference_decode(q, k_pool, v_pool, tables, ctx, d ** -0.5),
                                       atol=2e-2, rtol=2e-2, msg=lambda m, n=threads: f"{n} threads: {m}")
    finally:
        torch.set_num_threads(before)


def test_large_scores_stay_finite():
    """Scores far from zero (a softmax that needs its max subtracted) and a context of exactly one
    chunk: every build gives the reference's answer, no NaN or inf."""
    for build in BUILDS:
        kernel = _loaded(build)
        g = torch.Generator().manual_seed(1)
        k_pool = torch.randn(1, 4, 16, 64, generator=g) * 30
        v_pool = torch.randn(1, 4, 16, 64, generator=g)
        q = torch.randn(2, 2, 64, generator=g) * 30
        tables, ctx = torch.tensor([[0, 1], [2, 3]]), torch.tensor([8, 32])
        slots = torch.tensor([7, 3 * 16 + 15])
        k_new, v_new = k_pool.view(1, -1, 64)[:, slots].clone(), v_pool.view(1, -1, 64)[:, slots].clone()
        out = kernel.paged_decode(q, k_new, v_new, slots, k_pool, v_pool, tables, ctx, 0.125)
        assert torch.isfinite(out).all(), build.name
        torch.testing.assert_close(out, reference_decode(q, k_pool, v_pool, tables, ctx, 0.125), atol=1e-4,
                                   rtol=1e-4)


def test_the_active_kernel_is_the_best_build_this_cpu_runs():
    """Unforced, the process loads the first build of the list this CPU runs, and says so."""
    if hardware.forced_kernel():
        pytest.skip("a kernel is forced through the environment")
    sel = kernels.active()
    assert sel.name == BUILDS[0].name, sel.reason
    assert kernels.supports(torch.float32, torch.device("cpu"), 3)


def test_forcing_a_build_the_cpu_cannot_run_is_refused_by_name():
    missing = [b for b in hardware.KERNEL_BUILDS if b not in BUILDS]
    if not missing:
        pytest.skip("this CPU runs every build")
    with pytest.raises(ValueError, match=f"{hardware.FORCE_ENV}='{missing[0].name}' needs CPU flags"):
        kernels.select(CPU, missing[0].name)


def test_a_build_that_fails_falls_back_to_the_next(monkeypatch):
    """A vector build whose compile fails (here: the compiler refuses its flags) is logged and the
    next build this CPU runs is used; serving never depends on one build."""
    if len(BUILDS) < 2:
        pytest.skip("this CPU runs only the portable build")
    broken = hardware.KernelBuild(BUILDS[0].name, BUILDS[0].needs, ("-mno-such-flag-pdserve",))
    monkeypatch.setattr(hardware, "KERNEL_BUILDS",
                        tuple(broken if b is BUILDS[0] else b for b in hardware.KERNEL_BUILDS))
    monkeypatch.setattr(kernels, "_loaded", {})
    sel = kernels.select(CPU, None)
    assert sel.name == BUILDS[1].name
    assert "fallback" in sel.reason and BUILDS[0].name in sel.reason


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_torch_operator_is_the_active_kernel(dtype):
    """`torch.ops.pdserve_cpu.paged_decode` (what a compiled decode step calls) gives the same bytes
    as the ctypes call into the same build, and writes the new K/V the same way."""
    sel = kernels.active()
    if sel.kernel is None or sel.op is None:
        pytest.skip(f"no kernel or no torch operator here: {sel.reason}; {sel.calls}")
    g = torch.Generator().manual_seed(2)
    kv = torch.randn(2, 3, 40, 16, 64, generator=g).to(dtype)
    kv2 = kv.clone()
    q, k_new, v_new = (torch.randn(*shape, generator=g).to(dtype) for shape in ((4, 9, 64), (3, 4, 64), (3, 4, 64)))
    tables = torch.randperm(40, generator=g)[:32].view(4, 8)
    ctx = torch.tensor([1, 16, 77, 128])
    slots = tables[torch.arange(4), (ctx - 1) // 16] * 16 + (ctx - 1) % 16
    got = sel.op(q, k_new, v_new, slots, kv, tables, ctx, 0.125)
    want = sel.kernel.paged_decode(q, k_new, v_new, slots, kv2[0], kv2[1], tables, ctx, 0.125)
    assert torch.equal(got, want) and torch.equal(kv, kv2)


def test_the_torch_operator_checks_its_inputs_before_touching_the_pool():
    """Shapes that disagree are refused (the kernel would write where the pool is not); strided block
    tables and slots are read as the values they hold, not as raw memory."""
    sel = kernels.active()
    if sel.kernel is None or sel.op is None:
        pytest.skip(f"no kernel or no torch operator here: {sel.reason}; {sel.calls}")
    g = torch.Generator().manual_seed(3)
    kv = torch.randn(2, 3, 40, 16, 64, generator=g)
    q, k_new, v_new = (torch.randn(*shape, generator=g) for shape in ((4, 9, 64), (3, 4, 64), (3, 4, 64)))
    wide = torch.randperm(40, generator=g)[:32].view(8, 4).t()  # [4, 8], not contiguous
    ctx = torch.tensor([1, 16, 77, 128])
    slots = torch.stack([wide[torch.arange(4), (ctx - 1) // 16] * 16 + (ctx - 1) % 16] * 2, 1)[:, 0]  # strided
    kv2 = kv.clone()
    got = sel.op(q, k_new, v_new, slots, kv, wide, ctx, 0.125)
    want = sel.kernel.paged_decode(q, k_new, v_new, slots.contiguous(), kv2[0], kv2[1], wide.contiguous(), ctx, 0.125)
    assert torch.equal(got, want) and torch.equal(kv, kv2)
    with pytest.raises(RuntimeError, match="must match the batch"):
        sel.op(q, k_new, v_new, slots[:3], kv, wide, ctx, 0.125)
    with pytest.raises(RuntimeError, match="disagree"):
        sel.op(q, k_new[:, :3], v_new[:, :3], slots, kv, wide, ctx, 0.125)
    assert torch.equal(kv, kv2)


def test_without_the_torch_operator_the_ctypes_path_serves(monkeypatch):
    sel = kernels.active()
    if sel.kernel is None:
        pytest.skip(sel.reason)

    def broken() -> None:
        raise kernels.KernelError("g++ failed: no headers")
    monkeypatch.setattr(kernels, "_build_op", broken)
    op, calls = kernels._torch_op(sel.kernel)
    assert op is None and "ctypes" in calls and "no headers" in calls


@pytest.mark.parametrize("build", BUILDS, ids=[b.name for b in BUILDS])
def test_every_build_binds_its_torch_operator(build):
    """The operator library binds any build this CPU runs, whichever linear kernels it holds (the AVX2
    build has no bf16 one, the portable build none: their row limits read 0, torch's linear serves)."""
    kernel = _loaded(build)
    sel = kernels.active()
    if sel.op is None:
        pytest.skip(f"no torch operator here: {sel.calls}")
    try:
        op, calls = kernels._torch_op(kernel)
        assert op is not None, calls
        for dtype in (torch.float32, torch.bfloat16):
            assert (kernel.linear_max_rows(dtype) > 0) == kernel.has_linear(dtype)
    finally:
        kernels._torch_op(sel.kernel)  # the process's operator serves its active build again


PREFILL_BUILDS = [b for b in BUILDS if b.name in ("amx_bf16", "avx512_bf16")]  # bf16 prefill attention


@pytest.mark.parametrize("build", BUILDS, ids=[b.name for b in BUILDS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_picks_what_torch_max_picks(build, dtype):
    """Greedy picks: a vocabulary's rows (and odd widths whose last lanes are a tail), ties, NaN, -inf, rows a
    stride apart; the builds with vectors hold it, the portable one leaves it to torch."""
    kernel = _loaded(build)
    assert kernel.has_argmax(dtype) == (build.name != "portable")
    if not kernel.has_argmax(dtype):
        assert kernels.argmax(torch.zeros(2, 3, dtype=dtype)).tolist() == [0, 0]  # torch's, whatever is active
        return
    g = torch.Generator().manual_seed(1)
    for cols in (49152, 151936, 1, 7, 8, 15, 16, 17, 33):
        x = torch.randn(9, cols, generator=g).to(dtype)
        last = cols - 1
        x[1, last] = x[1].max() + 1  # the last column
        x[2, 0] = x[2].max() + 1  # the first
        x[3, last // 2] = x[3, last] = x[3].max() + 1  # a tie: the first of them
        x[4] = x[4, 0]  # one value everywhere: 0
        x[5] = float("-inf")
        x[6, last] = float("nan")  # a NaN beats every number
        x[7, last // 3] = x[7, last] = float("nan")  # the first NaN
        x[8, last] = float("inf")
        for rows in (x, x[::2], x[:, : max(1, cols - 1)]):
            assert torch.equal(kernel.argmax(rows), rows.max(dim=-1).indices), (cols, rows.shape)


def test_argmax_leaves_what_no_kernel_takes_to_torch():
    """fp16 logits, and a batch of matrices: torch's pick, the same one."""
    g = torch.Generator().manual_seed(2)
    for x in (torch.randn(3, 50, generator=g).half(), torch.randn(2, 3, 50, generator=g)):
        assert torch.equal(kernels.argmax(x), x.max(dim=-1).indices)


def _holds_prefill(build: hardware.KernelBuild, dtype: torch.dtype) -> bool:
    """bf16: the builds with AVX-512 BF16; fp32: every build with AVX2 + FMA (8 lanes, or 16 with AVX-512)."""
    return build in PREFILL_BUILDS if dtype == torch.bfloat16 else {"avx2", "fma"} <= build.needs


PREFILL_CASES = [(b, dt) for b in BUILDS for dt in (torch.bfloat16, torch.float32) if _holds_prefill(b, dt)]
PREFILL_IDS = [f"{b.name}-{str(dt).removeprefix('torch.')}" for b, dt in PREFILL_CASES]
_PREFILL_TOL = {torch.bfloat16: 2e-2, torch.float32: 1e-4}


@pytest.mark.parametrize("build,dtype", PREFILL_CASES, ids=PREFILL_IDS)
@pytest.mark.parametrize("d", kernels.PREFILL_HEAD_DIMS)
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4), (8, 1), (16, 2)])
@pytest.mark.parametrize("bs", [8, 16, 32])
@pytest.mark.parametrize("start,n", [(0, 1), (1, 1), (5, 3), (16, 16), (17, 40), (31, 33), (100, 136), (700, 70),
                                     (0, 300)])
def test_prefill_kernel_matches_reference(build, dtype, d, heads, kv_heads, bs, start, n):
    """A prompt chunk over its cached context (or a whole prompt) on the prefill kernel, head dims 64 and
    128: bf16 on AMX tiles (amx_bf16, blocks of 16 and 32) and AVX-512 BF16 dot products (avx512_bf16, and
    the AMX build's blocks of 8), fp32 on AVX-512 or AVX2 FMAs: chunks of 1 row to several tiles (partial ones),
    starting and ending inside blocks and tiles of 32 keys, scattered block tables, GQA groups of 1 to 8; the
    pool past the context holds NaN, which must never be read into the answer."""
    kernel = _loaded(build)
    assert kernel.has_prefill(dtype)
    g = torch.Generator().manual_seed(start * 7 + n + heads + bs + d)
    ctx = start + n
    blocks = -(-ctx // bs)
    k_pool, v_pool = (torch.randn(kv_heads, blocks + 5, bs, d, generator=g).to(dtype) for _ in range(2))
    table = torch.randperm(blocks + 5, generator=g)[:blocks]
    for pool in (k_pool, v_pool):  # the rest of the last block, and every block outside the table
        outside = torch.ones(blocks + 5, dtype=torch.bool)
        outside[table] = False
        pool[:, outside] = float("nan")
        if ctx % bs:
            pool[:, table[-1], ctx % bs:] = float("nan")
    q = (torch.randn(heads, n, d, generator=g) * 3).to(dtype)
    out = kernel.prefill_attention(q, k_pool, v_pool, table, start, d ** -0.5)
    assert out is not None and out.dtype == dtype and out.shape == q.shape
    want = reference_prefill(q, k_pool.nan_to_num(), v_pool.nan_to_num(), table, start, d ** -0.5)
    torch.testing.assert_close(out.float(), want, atol=_PREFILL_TOL[dtype], rtol=_PREFILL_TOL[dtype])


@pytest.mark.parametrize("build,dtype", PREFILL_CASES, ids=PREFILL_IDS)
@pytest.mark.parametrize("d", kernels.PREFILL_HEAD_DIMS)
@pytest.mark.parametrize("rise", [4.0, 400.0])
def test_prefill_kernel_keeps_its_softmax_exact_when_later_keys_dominate(build, dtype, d, rise):
    """The kernel moves a row's running maximum only when a score passes it by a margin. Scores that rise
    along the context by `rise` in all (far past what exp can take without the maximum moving), and one key
    that stands above them all: the output still equals the reference."""
    kernel = _loaded(build)
    g = torch.Generator().manual_seed(int(rise) + d)
    heads, kv_heads, bs, start, n = 9, 3, 16, 600, 72
    ctx, blocks = start + n, -(-(start + n) // bs)
    u = torch.nn.functional.normalize(torch.randn(kv_heads, d, generator=g), dim=-1)
    q = u.repeat_interleave(heads // kv_heads, 0)[:, None, :] * 8 + 0.1 * torch.randn(heads, n, d, generator=g)
    # q . k * d^-0.5 climbs by about `rise` over the context: k_t = u * rise * t / ctx * d^0.5 / 8
    keys = u[:, None, :] * (torch.linspace(0, rise, ctx)[None, :, None] * d ** 0.5 / 8)
    keys = keys + 0.1 * torch.randn(kv_heads, ctx, d, generator=g)
    keys[:, 450] = u * 1.2 * rise * d ** 0.5 / 8  # one key above them all, before the chunk
    pad = torch.zeros(kv_heads, blocks * bs - ctx, d)
    k_pool = torch.cat([keys, pad], 1).reshape(kv_heads, blocks, bs, d).to(dtype)
    v_pool = torch.randn(kv_heads, blocks, bs, d, generator=g).to(dtype)
    table = torch.arange(blocks)
    out = kernel.prefill_attention(q.to(dtype), k_pool, v_pool, table, start, d ** -0.5)
    want = reference_prefill(q.to(dtype), k_pool, v_pool, table, start, d ** -0.5)
    assert out is not None and torch.isfinite(out.float()).all()
    torch.testing.assert_close(out.float(), want, atol=_PREFILL_TOL[dtype], rtol=_PREFILL_TOL[dtype])


@pytest.mark.parametrize("build,dtype", PREFILL_CASES, ids=PREFILL_IDS)
def test_prefill_kernel_declines_what_it_cannot_run(build, dtype):
    """A head dim other than 64 and 128: the kernel declines (None), so the caller gathers instead."""
    kernel = _loaded(build)
    for bs, d in ((8, 80), (16, 80), (16, 96)):
        pool = torch.zeros(1, 4, bs, d, dtype=dtype)
        q = torch.zeros(1, 4, d, dtype=dtype)
        assert kernel.prefill_attention(q, pool, pool, torch.arange(4), 10, 0.125) is None


def test_the_builds_hold_the_prefill_kernel_for_their_dtypes():
    """bf16 prefill attention is in the builds with AVX-512 BF16, fp32 in every build with AVX2 + FMA; the others
    serve chunks over a context with SDPA. Without AMX tiles the bf16 kernel takes whole prompts too (torch's
    flash attention is slower there), and the fp32 one everywhere."""
    for build in BUILDS:
        kernel = _loaded(build)
        for dtype in (torch.bfloat16, torch.float32):
            assert kernel.has_prefill(dtype) == _holds_prefill(build, dtype)
        assert kernel.prefill_whole(torch.float32) == _holds_prefill(build, torch.float32)
        if build.name == "avx512_bf16":
            assert kernel.prefill_whole(torch.bfloat16)


@pytest.mark.parametrize("build", PREFILL_BUILDS, ids=[b.name for b in PREFILL_BUILDS])
@pytest.mark.parametrize("head_dim", kernels.PREFILL_HEAD_DIMS)
def test_engine_prompt_chunks_on_the_prefill_kernel_are_as_exact_as_sdpa(build, head_dim):
    """A bf16 decoder with head dim 64 or 128 in the engine: prompts over a cached prefix, prefilled in
    chunks of 24 tokens (one and a half blocks), get first-token log-probabilities within bf16's precision
    of the fp32 model's, on the prefill kernel as with gather + SDPA in an engine without it (both ~0.005
    here), and every block returns to the pool."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.conftest import random_prompt
    from tests.integration.test_engine_correctness import assert_all_free

    _loaded(build)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
                                         max_position_embeddings=1024)).eval()
    prefix = random_prompt(150, seed=1)
    prompts = [prefix + random_prompt(n, seed=n) for n in (1, 9, 40, 77)]
    with torch.no_grad():
        want = [torch.log_softmax(model(torch.tensor([p])).logits[0, -1], -1) for p in prompts]
    for on in (True, False):
        engine = LLMEngine(EngineConfig(dtype="bfloat16", prefill_chunk_tokens=24, cache=CacheConfig(memory_gib=0.02)),
                           model=copy.deepcopy(model).to(torch.bfloat16))
        assert engine.runner.prefill_kernel
        engine.runner.prefill_kernel = on
        engine.runner.prefill_kernel_whole &= on
        engine.generate([prefix], SamplingParams(max_tokens=1))
        outs = engine.generate(prompts, SamplingParams(max_tokens=1, logprobs=5))
        assert all(o.num_cached_tokens == 144 for o in outs)  # the prefix's nine full blocks
        for out, ref in zip(outs, want):
            got = out.logprobs[0]
            assert list(got.top_logprobs) == pytest.approx([float(ref[i]) for i in got.top_ids], abs=0.02)
        assert_all_free(engine)
