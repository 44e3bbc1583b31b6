"""Attention over the paged KV pool, plugged into transformers' attention interface.

The model runs on packed inputs: all of a step's new tokens in one row (batch dim 1),
positions given explicitly. Each layer writes its new K/V into the pool at `slot_mapping`,
then attends each sequence's queries to that sequence's keys, read through its block
table. No sequence's cache is ever moved or copied to make room for another.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

ATTN_NAME = "pdserve_paged"


@dataclass
class PrefillSlice:
    """One sequence in a prefill batch: its queries are packed rows [start, end)."""

    start: int
    end: int
    num_cached: int  # keys before the first query that already sit in the pool
    context_slots: torch.Tensor | None  # pool slots of all its keys, when num_cached > 0
    mask: torch.Tensor | None  # [q, ctx] bool, when num_cached > 0


@dataclass
class AttnMetadata:
    """What every layer needs to find and place K/V for this step."""

    slot_mapping: torch.Tensor  # [N] pool slot of each new token
    prefill: list[PrefillSlice] | None = None
    decode_slots: torch.Tensor | None = None  # [B, max_ctx] pool slots of each sequence's keys
    decode_mask: torch.Tensor | None = None  # [B, 1, 1, max_ctx] bool, None when lengths agree


def paged_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                    attn_meta: AttnMetadata | None = None, kv_cache: torch.Tensor | None = None,
                    **kwargs: object) -> tuple[torch.Tensor, None]:
    """query [1, H, N, D], key/value [1, KVH, N, D] → output [1, N, H, D]."""
    assert attn_meta is not None and kv_cache is not None, "paged attention needs attn_meta and kv_cache"
    k_pool, v_pool = kv_cache[module.layer_idx]  # [slots, KVH, D] each
    k_new = key[0].transpose(0, 1)  # [N, KVH, D]
    v_new = value[0].transpose(0, 1)
    k_pool.index_copy_(0, attn_meta.slot_mapping, k_new)
    v_pool.index_copy_(0, attn_meta.slot_mapping, v_new)
    if attn_meta.prefill is not None:
        out = _prefill(query, key, value, k_pool, v_pool, attn_meta.prefill, scaling)
    else:
        out = _decode(query, k_pool, v_pool, attn_meta, scaling)
    return out, None


def _prefill(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_pool: torch.Tensor,
             v_pool: torch.Tensor, slices: list[PrefillSlice], scaling: float | None) -> torch.Tensor:
    outs = []
    for s in slices:
        q = query[:, :, s.start:s.end]
        if s.num_cached == 0:
            k, v = key[:, :, s.start:s.end], value[:, :, s.start:s.end]
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=True)
        else:
            k = k_pool[s.context_slots].transpose(0, 1).unsqueeze(0)
            v = v_pool[s.context_slots].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=s.mask, scale=scaling, enable_gqa=True)
        outs.append(o)
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)  # [1, H, N, D]
    return out.transpose(1, 2)


def _decode(query: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, meta: AttnMetadata,
            scaling: float | None) -> torch.Tensor:
    b = query.shape[2]
    q = query[0].transpose(0, 1).unsqueeze(2)  # [B, H, 1, D]
    k = k_pool[meta.decode_slots].transpose(1, 2)  # [B, KVH, ctx, D]
    v = v_pool[meta.decode_slots].transpose(1, 2)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=meta.decode_mask, scale=scaling, enable_gqa=True)
    return o.transpose(1, 2).reshape(1, b, o.shape[1], o.shape[3])


AttentionInterface.register(ATTN_NAME, paged_attention)
