"""The Triton paged-decode kernel equals plain attention over the same paged pool, and stores the new K/V.

On CUDA. `TRITON_INTERPRET=1` (with triton installed, no CUDA) runs it on CPU tensors in Triton's
interpreter instead: slow, and without bf16, whose dot the interpreter gets wrong."""
from __future__ import annotations

import itertools
import os

import pytest
import torch

from engine import triton_attention as ta

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and ta.triton is not None and not torch.cuda.is_available()
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_why = "needs triton" if ta.triton is None else "needs CUDA (or TRITON_INTERPRET=1 for Triton's CPU interpreter)"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not (ta.available() or INTERPRET), reason=_why)]

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}
DIMS, GROUPS, BLOCKS = (64, 80, 128), (1, 2, 4, 8, 16), (8, 16, 32)
# every dtype meets every head dim, GQA ratio and block size; bf16 at d=128 gets the full ratio x block grid
CASES = sorted({(dt, DIMS[(i + j) % 3], g, BLOCKS[(i + 2 * j) % 3])
                for j, dt in enumerate(TOL) for i, g in enumerate(GROUPS)}
               | {(torch.bfloat16, 128, g, bs) for g, bs in itertools.product(GROUPS, BLOCKS)}, key=str)
CTX = (1, 17, 100, 16, 250, 33)  # one token, ragged, exact block multiples and not


def reference(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, tables: torch.Tensor, ctx: torch.Tensor,
              scale: float) -> torch.Tensor:
    """Per sequence: gather its tokens through the table, repeat kv heads, softmax in fp32."""
    kvh, _, bs, _ = k_pool.shape
    group = q.shape[1] // kvh
    outs = []
    for b in range(q.shape[0]):
        n = int(ctx[b])
        blocks = tables[b, :(n + bs - 1) // bs]
        k = k_pool[:, blocks].flatten(1, 2)[:, :n].float().repeat_interleave(group, 0)  # [H, n, D]
        v = v_pool[:, blocks].flatten(1, 2)[:, :n].float().repeat_interleave(group, 0)
        p = (torch.einsum("hd,htd->ht", q[b].float(), k) * scale).softmax(-1)
        outs.append(torch.einsum("ht,htd->hd", p, v))
    return torch.stack(outs)


def make_inputs(dtype: torch.dtype, d: int, group: int, bs: int, kvh: int = 2, ctx: tuple[int, ...] = CTX,
                seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    n, h = len(ctx), kvh * group
    per_seq = (max(ctx) + bs - 1) // bs
    num_blocks = 2 * per_seq * n
    lens = torch.tensor(ctx)
    tables = torch.randperm(num_blocks, generator=g)[:per_seq * n].view(n, per_seq)  # scattered, own blocks
    last = lens - 1
    t = {
        "q": torch.randn(h, n, d, generator=g).transpose(0, 1),  # [B, H, D] strided, as attention.py passes it
        "k_new": torch.randn(n, kvh, d, generator=g).transpose(0, 1),  # [KVH, B, D] strided
        "v_new": torch.randn(n, kvh, d, generator=g).transpose(0, 1),
        "slots": tables[torch.arange(n), last // bs] * bs + last % bs,
        "k_pool": torch.randn(kvh, num_blocks, bs, d, generator=g),
        "v_pool": torch.randn(kvh, num_blocks, bs, d, generator=g),
        "tables": tables, "ctx": lens}
    return {k: v.to(DEVICE, dtype) if v.is_floating_point() else v.to(DEVICE) for k, v in t.items()}


def check(t: dict[str, torch.Tensor], out: torch.Tensor, before: dict[str, torch.Tensor], tol: float) -> None:
    kvh, _, _, d = t["k_pool"].shape
    for name, new in (("k_pool", "k_new"), ("v_pool", "v_new")):  # the new rows at the slots, nothing else
        want = before[name].clone()
        want.view(kvh, -1, d)[:, t["slots"]] = t[new]
        assert torch.equal(t[name], want), name
    assert out.dtype == t["q"].dtype and out.shape == t["q"].shape
    ref = reference(t["q"], t["k_pool"], t["v_pool"], t["tables"], t["ctx"], d ** -0.5)
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


def run(t: dict[str, torch.Tensor], num_splits: int | None) -> torch.Tensor:
    args = [t[k] for k in ("q", "k_new", "v_new", "slots", "k_pool", "v_pool", "tables", "ctx")]
    scale = t["q"].shape[-1] ** -0.5
    if num_splits is None:
        return torch.ops.pdserve.paged_decode_triton(*args, scale)
    return ta._launch(*args, scale, num_splits=num_splits)


@pytest.mark.parametrize("dtype,d,group,bs", CASES, ids=lambda x: str(x).replace("torch.", ""))
@pytest.mark.parametrize("num_splits", [None, 1, 3], ids=["auto", "one-split", "three-splits"])
def test_kernel_matches_reference(dtype: torch.dtype, d: int, group: int, bs: int, num_splits: int | None) -> None:
    if INTERPRET and dtype == torch.bfloat16:
        pytest.skip("Triton's interpreter multiplies bf16 bit patterns in tl.dot")
    t = make_inputs(dtype, d, group, bs, seed=d + group + bs)
    before = {k: t[k].clone() for k in ("k_pool", "v_pool")}
    check(t, run(t, num_splits), before, TOL[dtype])


def test_more_splits_than_a_short_context_fills() -> None:
    """Splits past a sequence's context are empty and must not enter its merge."""
    t = make_inputs(torch.float32, 64, 4, 16, ctx=(1, 40, 700), seed=7)
    before = {k: t[k].clone() for k in ("k_pool", "v_pool")}
    check(t, run(t, 64), before, TOL[torch.float32])


@pytest.mark.parametrize("num_splits", [1, 4])
def test_padding_row_with_empty_context_gives_zeros(num_splits: int) -> None:
    """A batch padded with a ctx=0 row (CUDA-graph buckets): that row comes out 0, not NaN; the rest exact."""
    t = make_inputs(torch.float32, 64, 2, 16, ctx=(30, 200, 1), seed=9)
    t["ctx"][2] = 0
    before = {k: t[k].clone() for k in ("k_pool", "v_pool")}
    out = run(t, num_splits)
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    kvh, d = t["k_pool"].shape[0], t["k_pool"].shape[-1]
    for pool, new in (("k_pool", "k_new"), ("v_pool", "v_new")):  # the padding row still stores at its slot
        before[pool].view(kvh, -1, d)[:, t["slots"][2]] = t[new][:, 2]
    first2 = {k: t[k] for k in ("k_pool", "v_pool", "tables")}
    first2.update(q=t["q"][:2], k_new=t["k_new"][:, :2], v_new=t["v_new"][:, :2], slots=t["slots"][:2],
                  ctx=t["ctx"][:2])
    check(first2, out[:2], before, TOL[torch.float32])


@pytest.mark.skipif(INTERPRET, reason="compile and CUDA graphs: CUDA only")
def test_compiled_and_cuda_graph_capture() -> None:
    """The op stays whole under torch.compile (fullgraph) and replays from a CUDA graph, pool writes included."""
    t = make_inputs(torch.bfloat16, 128, 4, 16, seed=3)
    eager = {k: v.clone() for k, v in t.items()}
    want = run(eager, None)

    def step(q, k_new, v_new, slots, k_pool, v_pool, tables, ctx):
        return torch.ops.pdserve.paged_decode_triton(q, k_new, v_new, slots, k_pool, v_pool, tables, ctx, 128 ** -0.5)
    args = [t[k] for k in ("q", "k_new", "v_new", "slots", "k_pool", "v_pool", "tables", "ctx")]
    got = torch.compile(step, fullgraph=True)(*args)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert torch.equal(t["k_pool"], eager["k_pool"]) and torch.equal(t["v_pool"], eager["v_pool"])

    graph_in = {k: v.clone() for k, v in t.items()}
    gargs = [graph_in[k] for k in ("q", "k_new", "v_new", "slots", "k_pool", "v_pool", "tables", "ctx")]
    step(*gargs)  # warm: Triton compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(*gargs)
    fresh = make_inputs(torch.bfloat16, 128, 4, 16, seed=4)  # same shapes, new values copied in
    for k in ("q", "k_new", "v_new", "slots", "tables", "k_pool", "v_pool"):
        graph_in[k].copy_(fresh[k])
    before = {k: graph_in[k].clone() for k in ("k_pool", "v_pool")}
    graph.replay()
    torch.cuda.synchronize()
    check(graph_in, out, before, TOL[torch.bfloat16])
