"""Attention over the paged KV pool, plugged into transformers' attention interface.

The model runs on packed inputs: all of a step's new tokens in one row (batch dim 1),
positions given explicitly: decoding sequences' newest tokens first, then prompt chunks.
Each layer writes its new K/V into the pool at `slot_mapping`, then attends each sequence's
queries to that sequence's keys, read through its block table (decode rows with the paged
kernel where there is one). No sequence's cache is ever moved or copied to make room for another.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from engine import kernels, triton_attention

ATTN_NAME = "pdserve_paged"


@dataclass
class PrefillSlice:
    """One sequence in a prefill batch: its queries are packed rows [start, end)."""

    start: int
    end: int
    num_cached: int  # keys before the first query that already sit in the pool
    blocks: torch.Tensor | None  # its block table, when num_cached > 0
    mask: torch.Tensor | None  # [q, ctx] additive (0 / -inf, the queries' dtype), when num_cached > 0


@dataclass
class AttnMetadata:
    """What every layer needs to find and place K/V for this step."""

    slot_mapping: torch.Tensor  # [N] pool slot (block * block_size + offset) of each new token
    prefill: list[PrefillSlice] | None = None  # None: every row is a decoding sequence's
    num_decode: int = 0  # with `prefill`: rows [0, num_decode) are decoding sequences'; the decode fields are theirs
    decode_blocks: torch.Tensor | None = None  # [B, max_blocks] block tables, padded
    ctx_lens: torch.Tensor | None = None  # [B] context length of each decoding sequence
    max_ctx: int = 0  # longest context in the decode batch
    decode_mask: torch.Tensor | None = None  # [B, 1, 1, max_ctx] bool, None when lengths agree
    use_kernel: bool = False  # decode with the in-place kernel (CPU C build, CUDA Triton) instead of gather + SDPA
    prefill_kernel: bool = False  # chunks over a cached context on the CPU prefill kernel (`kernels.supports_prefill`)
    prefill_kernel_whole: bool = False  # and chunks with none (`kernels.prefill_whole`); else causal SDPA
    layer_kv: bool = False  # `kv_cache` is already this layer's [2, KVH, blocks, block_size, D] (compiled decode)


def paged_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                    attn_meta: AttnMetadata | None = None, kv_cache: torch.Tensor | None = None,
                    **kwargs: object) -> tuple[torch.Tensor, None]:
    """query [1, H, N, D], key/value [1, KVH, N, D] → output [1, N, H, D].

    `kv_cache` is the whole pool [layers, 2, KVH, blocks, block_size, D], or this layer's part of it
    when `attn_meta.layer_kv`."""
    assert attn_meta is not None and kv_cache is not None, "paged attention needs attn_meta and kv_cache"
    kv_layer = kv_cache if attn_meta.layer_kv else kv_cache[module.layer_idx]
    if attn_meta.prefill is None and attn_meta.use_kernel:  # a decode step: the kernel alone
        return _kernel_decode(query, key, value, attn_meta.slot_mapping, kv_layer, attn_meta, scaling), None
    nd = query.shape[2] if attn_meta.prefill is None else attn_meta.num_decode
    outs = []
    written = 0  # leading rows whose K/V the kernel wrote
    if nd and attn_meta.use_kernel:  # a mixed step: the kernel takes whole tensors of the decode rows
        outs.append(_kernel_decode(query[:, :, :nd].contiguous(), key[:, :, :nd].contiguous(),
                                   value[:, :, :nd].contiguous(), attn_meta.slot_mapping[:nd].contiguous(),
                                   kv_layer, attn_meta, scaling))
        written = nd
    k_pool, v_pool = kv_layer  # [KVH, blocks, block_size, D] each
    kvh, d = k_pool.shape[0], k_pool.shape[-1]
    k_pool.view(kvh, -1, d).index_copy_(1, attn_meta.slot_mapping[written:], key[0, :, written:])
    v_pool.view(kvh, -1, d).index_copy_(1, attn_meta.slot_mapping[written:], value[0, :, written:])
    if nd and not written:
        outs.append(_decode(query[:, :, :nd], k_pool, v_pool, attn_meta, scaling))
    if attn_meta.prefill is not None:
        outs.append(_prefill(query, key, value, k_pool, v_pool, attn_meta.prefill, scaling, attn_meta.prefill_kernel,
                             attn_meta.prefill_kernel_whole))
    return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)), None


def _kernel_decode(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor,
                   kv_layer: torch.Tensor, meta: AttnMetadata, scaling: float | None) -> torch.Tensor:
    """Decode rows on the paged kernel, which writes their K/V: query [1, H, B, D] → [1, B, H, D]."""
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    args = (query[0].transpose(0, 1), key[0], value[0], slots)
    if query.is_cuda:
        out = triton_attention.paged_decode(*args, kv_layer[0], kv_layer[1], meta.decode_blocks, meta.ctx_lens, scale)
    else:
        # contiguous here, not in the operator: a compiled step then lays them out so in the kernels that
        # compute them (RoPE) instead of copying each one per layer through the dispatcher
        args = tuple(t.contiguous() for t in args)
        op = kernels.active().op or paged_decode_step  # the C++ operator, or the Python one over ctypes
        out = op(*args, kv_layer, meta.decode_blocks, meta.ctx_lens, scale)
    return out.unsqueeze(0)


def _prefill(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_pool: torch.Tensor,
             v_pool: torch.Tensor, slices: list[PrefillSlice], scaling: float | None, use_kernel: bool,
             whole_on_kernel: bool = False) -> torch.Tensor:
    """Each chunk's queries over its own keys alone (causal SDPA), or over its cached context too: on the
    prefill kernel, in place, where `use_kernel` (and it takes the call), else gather + SDPA with the
    chunk's mask. `whole_on_kernel`: chunks with no cached context go to the kernel too. The chunks' K/V
    are in the pool already."""
    outs = []
    for s in slices:
        q = query[:, :, s.start:s.end]
        o = None
        if use_kernel and (s.num_cached or whole_on_kernel):
            scale = scaling if scaling is not None else q.shape[-1] ** -0.5
            o = kernels.prefill_attention(q[0], k_pool, v_pool, s.blocks[0], s.num_cached, scale)
        if o is not None:
            o = o[None]
        elif s.num_cached == 0:
            k, v = key[:, :, s.start:s.end], value[:, :, s.start:s.end]
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=True)
        else:
            ctx = s.mask.shape[1]
            k = _gather(k_pool, s.blocks)[:, :, :ctx]
            v = _gather(v_pool, s.blocks)[:, :, :ctx]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=s.mask, scale=scaling, enable_gqa=True)
        outs.append(o)
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)  # [1, H, N, D]
    return out.transpose(1, 2)


def _decode(query: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, meta: AttnMetadata,
            scaling: float | None) -> torch.Tensor:
    b = query.shape[2]
    q = query[0].transpose(0, 1).unsqueeze(2)  # [B, H, 1, D]
    k = _gather(k_pool, meta.decode_blocks)[:, :, :meta.max_ctx]  # [B, KVH, ctx, D]
    v = _gather(v_pool, meta.decode_blocks)[:, :, :meta.max_ctx]
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=meta.decode_mask, scale=scaling, enable_gqa=True)
    return o.transpose(1, 2).reshape(1, b, o.shape[1], o.shape[3])


@torch.library.custom_op("pdserve::paged_decode_step", mutates_args=())
def paged_decode_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
                      kv_layer: torch.Tensor, tables: torch.Tensor, ctx: torch.Tensor, scale: float) -> torch.Tensor:
    """One layer of a decode step on the CPU kernel: write the new K/V [KVH, B, D] at `slots` of
    `kv_layer` [2, KVH, blocks, block_size, D], then attend q [B, H, D] over each sequence's
    blocks. Returns [B, H, D]. The same contract as the C++ `pdserve_cpu::paged_decode`, which
    serves in its place where it builds (no Python per call).

    An opaque op, so `torch.compile` keeps it whole. Its write into `kv_layer` is not declared:
    declaring it would make the compiled graph copy the pool; nothing in the graph reads the
    pool but this op."""
    return kernels.paged_decode(q, k, v, slots, kv_layer[0], kv_layer[1], tables, ctx, scale)


@paged_decode_step.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, kv_layer: torch.Tensor,
      tables: torch.Tensor, ctx: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def reference_decode(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, tables: torch.Tensor,
                     ctx: torch.Tensor, scale: float) -> torch.Tensor:
    """Decode attention the plain way, in fp32, one sequence at a time: q [B, H, D] over each
    sequence's first ctx[b] keys of the pool [KVH, blocks, block_size, D] → [B, H, D] fp32.
    The yardstick every kernel is checked against."""
    outs = []
    bs = k_pool.shape[2]
    for b in range(q.shape[0]):
        n = int(ctx[b])
        blocks = tables[b, :(n + bs - 1) // bs]
        k = k_pool.index_select(1, blocks).flatten(1, 2)[:, :n].float()  # [KVH, n, D]
        v = v_pool.index_select(1, blocks).flatten(1, 2)[:, :n].float()
        o = F.scaled_dot_product_attention(q[b:b + 1, :, None].float(), k[None], v[None], scale=scale,
                                           enable_gqa=True)
        outs.append(o[0, :, 0])
    return torch.stack(outs)


def reference_prefill(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor,
                      start: int, scale: float) -> torch.Tensor:
    """A prompt chunk's attention the plain way, in fp32: q [H, n, D] at positions [start, start + n), each
    over the keys of the pool [KVH, blocks, block_size, D] (through `table`) up to its own → [H, n, D] fp32.
    The yardstick the prefill kernel is checked against."""
    ctx = start + q.shape[1]
    k, v = (_gather(pool, table[None])[0, :, :ctx].float() for pool in (k_pool, v_pool))
    mask = torch.arange(ctx)[None, :] <= torch.arange(start, ctx)[:, None]
    return F.scaled_dot_product_attention(q.float()[None], k[None], v[None], attn_mask=mask, scale=scale,
                                          enable_gqa=True)[0]


def _gather(pool: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """Whole blocks of each table, in order: [B, blocks] → [B, KVH, blocks * block_size, D].
    Copies block-sized rows, far cheaper than indexing token by token."""
    b, nb = tables.shape
    kvh, _, bs, d = pool.shape
    return pool.index_select(1, tables.reshape(-1)).view(kvh, b, nb * bs, d).transpose(0, 1)


AttentionInterface.register(ATTN_NAME, paged_attention)
