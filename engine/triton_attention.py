"""Decode attention over the paged KV pool on CUDA, as Triton kernels (flash-decoding).

Boundary: same semantics as `engine.kernels.paged_decode` (the CPU C kernel); this module only
adds the CUDA implementation and never touches engine state. It imports without triton or CUDA;
`available()` says whether it can run.

One call is three launches: store each sequence's new K/V at its slot; attend each (sequence,
kv head, split of the context) with an online softmax over tiles of tokens read through the
block table, all query heads of the kv head at once; merge the splits by their log-sum-exp.
"""
from __future__ import annotations

import contextlib
import functools

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the module still imports, available() is False
    triton = None

TILE = 32  # tokens per inner-loop step (any block size: each token finds its block in the table)
MAX_SPLITS = 128


def available() -> bool:
    """Triton is importable and a CUDA device is present."""
    return triton is not None and torch.cuda.is_available()


if triton is not None:
    @triton.jit
    def _store_kernel(k_new, v_new, slots, k_pool, v_pool, s_nh, s_nb, NBS, B,
                      D: tl.constexpr, D_PAD: tl.constexpr):
        b = tl.program_id(0)
        kh = tl.program_id(1)
        d = tl.arange(0, D_PAD)
        dm = d < D
        src = kh * s_nh + b * s_nb + d
        dst = (kh * NBS + tl.load(slots + b)) * D + d  # int64: slots are
        tl.store(k_pool + dst, tl.load(k_new + src, mask=dm), mask=dm)
        tl.store(v_pool + dst, tl.load(v_new + src, mask=dm), mask=dm)

    @triton.jit
    def _split_kernel(q, k_pool, v_pool, tables, ctx, out, part_o, part_lse, s_qb, s_qh, qk_scale,
                      H, NB, MAXNB, split_tokens, S,
                      BS: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, G: tl.constexpr,
                      G_PAD: tl.constexpr, TILE_N: tl.constexpr, DIRECT: tl.constexpr):
        b = tl.program_id(0)
        kh = tl.program_id(1)
        s = tl.program_id(2)
        n = tl.load(ctx + b).to(tl.int32)
        start = s * split_tokens
        end = tl.minimum(start + split_tokens, n)
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, D_PAD)
        gm = g < G
        dm = d < D
        head = kh * G + g
        qv = tl.load(q + b * s_qb + head[:, None] * s_qh + d[None, :], mask=gm[:, None] & dm[None, :], other=0.0)
        m_i = tl.full([G_PAD], float("-inf"), tl.float32)  # running max, log2 domain
        l_i = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, D_PAD], tl.float32)
        for t0 in range(start, end, TILE_N):  # every tile holds >= 1 live token, so m_i turns finite
            tok = t0 + tl.arange(0, TILE_N)
            tm = tok < end
            blk = tl.load(tables + b * MAXNB + tok // BS, mask=tm, other=0)
            row = ((kh * NB + blk) * BS + tok % BS) * D  # int64: tables are
            lm = tm[:, None] & dm[None, :]
            k = tl.load(k_pool + row[:, None] + d[None, :], mask=lm, other=0.0)
            sc = tl.dot(qv, tl.trans(k), input_precision="ieee") * qk_scale  # [G_PAD, TILE_N]
            sc = tl.where(tm[None, :], sc, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(sc, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(sc - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_pool + row[:, None] + d[None, :], mask=lm, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            m_i = m_new
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # an empty split (past ctx) is never merged
        om = gm[:, None] & dm[None, :]
        if DIRECT:
            tl.store(out + (b * H + head[:, None]) * D + d[None, :], o.to(out.dtype.element_ty), mask=om)
        else:
            ph = (b * H + head) * S + s
            tl.store(part_o + ph[:, None] * D + d[None, :], o, mask=om)
            tl.store(part_lse + ph, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), mask=gm)  # empty: -inf

    @triton.jit
    def _merge_kernel(out, part_o, part_lse, ctx, H, split_tokens, S, D: tl.constexpr, D_PAD: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        d = tl.arange(0, D_PAD)
        dm = d < D
        n = tl.load(ctx + b).to(tl.int32)
        live = (n + split_tokens - 1) // split_tokens
        base = (b * H + h) * S
        m = tl.full([1], float("-inf"), tl.float32)
        den = tl.zeros([1], tl.float32)
        acc = tl.zeros([D_PAD], tl.float32)
        for s in range(live):
            lse = tl.load(part_lse + base + s + tl.zeros([1], tl.int32))
            o = tl.load(part_o + (base + s) * D + d, mask=dm, other=0.0)
            m_new = tl.maximum(m, lse)
            a = tl.exp2(m - m_new)
            w = tl.exp2(lse - m_new)
            den = den * a + w
            acc = acc * a + w * o
            m = m_new
        tl.store(out + (b * H + h) * D + d, (acc / tl.where(den > 0, den, 1.0)).to(out.dtype.element_ty), mask=dm)


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _next_pow2(x: int) -> int:
    return 1 << max(0, x - 1).bit_length()


def _launch(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, slots: torch.Tensor, k_pool: torch.Tensor,
            v_pool: torch.Tensor, tables: torch.Tensor, ctx: torch.Tensor, scale: float,
            num_splits: int | None = None) -> torch.Tensor:
    """The op's body; `num_splits` overrides the split heuristic (tests)."""
    assert triton is not None, "triton is not installed"
    b, h, d = q.shape
    kvh = k_pool.shape[0]
    assert h % kvh == 0 and k_pool.is_contiguous() and v_pool.is_contiguous(), "pools: [KVH, NB, BS, D] contiguous"
    assert q.dtype == k_pool.dtype == v_pool.dtype == k_new.dtype == v_new.dtype
    q = q if q.stride(-1) == 1 else q.contiguous()
    if k_new.stride(-1) != 1 or k_new.stride() != v_new.stride():
        k_new, v_new = k_new.contiguous(), v_new.contiguous()
    tables, ctx, slots = tables.contiguous(), ctx.contiguous(), slots.contiguous()
    out = torch.empty(b, h, d, dtype=q.dtype, device=q.device)
    if b == 0:
        return out
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():  # triton launches on the current one
        _run(q, k_new, v_new, slots, k_pool, v_pool, tables, ctx, scale, num_splits, out)
    return out


def _run(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, slots: torch.Tensor, k_pool: torch.Tensor,
         v_pool: torch.Tensor, tables: torch.Tensor, ctx: torch.Tensor, scale: float, num_splits: int | None,
         out: torch.Tensor) -> None:
    b, h, d = q.shape
    kvh, nb, bs, _ = k_pool.shape
    d_pad, group = max(16, _next_pow2(d)), h // kvh
    _store_kernel[(b, kvh)](k_new, v_new, slots, k_pool, v_pool, k_new.stride(0), k_new.stride(1), nb * bs, b,
                            D=d, D_PAD=d_pad)
    # splits: enough programs for ~2 waves over the SMs; sized from shapes only (CUDA-graph safe)
    tiles = triton.cdiv(tables.shape[1] * bs, TILE)
    sms = _num_sms(torch.cuda.current_device()) if q.is_cuda else 4
    splits = max(1, min(tiles, MAX_SPLITS, num_splits or triton.cdiv(2 * sms, b * kvh)))
    split_tokens = triton.cdiv(tiles, splits) * TILE
    splits = triton.cdiv(tiles * TILE, split_tokens)
    direct = splits == 1
    part_o = out if direct else torch.empty(b, h, splits, d, dtype=torch.float32, device=q.device)
    part_lse = out if direct else torch.empty(b, h, splits, dtype=torch.float32, device=q.device)
    _split_kernel[(b, kvh, splits)](
        q, k_pool, v_pool, tables, ctx, out, part_o, part_lse, q.stride(0), q.stride(1), scale * 1.4426950408889634,
        h, nb, tables.shape[1], split_tokens, splits,
        BS=bs, D=d, D_PAD=d_pad, G=group, G_PAD=max(16, _next_pow2(group)), TILE_N=TILE, DIRECT=direct)
    if not direct:
        _merge_kernel[(b, h)](out, part_o, part_lse, ctx, h, split_tokens, splits, D=d, D_PAD=d_pad)


@torch.library.custom_op("pdserve::paged_decode_triton", mutates_args=())
def paged_decode(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, slots: torch.Tensor,
                 k_pool: torch.Tensor, v_pool: torch.Tensor, tables: torch.Tensor, ctx: torch.Tensor,
                 scale: float) -> torch.Tensor:
    """One layer of a decode step over the paged pool: store the new K/V, then attend.

    Args and result as `engine.kernels.paged_decode`: q [B, H, D]; k_new, v_new [KVH, B, D] written
    at `slots` [B] (block * block_size + offset) of k_pool, v_pool [KVH, blocks, block_size, D]
    (contiguous, written in place); tables [B, max_blocks] and ctx [B] int64 (new token included).
    Returns [B, H, D] in q's dtype; fp32 scores, softmax and accumulation.

    An opaque custom op, so `torch.compile` keeps it whole and CUDA graphs capture its launches
    (their sizes come from shapes alone). Like `attention.paged_decode_step`, its write into the
    pools is not declared: declaring it would make a compiled graph copy the pool, and nothing in
    the graph reads the pool but this op. (`torch.library.triton_op` is not used for that reason:
    under compile it exposes the kernels, the compiler finds their stores to the pools and
    functionalizes them, cloning the pools unless Inductor manages to reinplace.)
    """
    return _launch(q, k_new, v_new, slots, k_pool, v_pool, tables, ctx, scale)


@paged_decode.register_fake
def _(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, slots: torch.Tensor, k_pool: torch.Tensor,
      v_pool: torch.Tensor, tables: torch.Tensor, ctx: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)
