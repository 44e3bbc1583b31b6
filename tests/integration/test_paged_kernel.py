"""The in-place decode kernel agrees with gather + SDPA over the same paged pool."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import kernels

pytestmark = pytest.mark.skipif(kernels.load() is None, reason="no C compiler for the CPU kernel")


def reference(q, k_pool, v_pool, tables, ctx, scale):
    outs = []
    for b in range(q.shape[0]):
        n = int(ctx[b])
        blocks = tables[b, :(n + k_pool.shape[2] - 1) // k_pool.shape[2]]
        k = k_pool.index_select(1, blocks).flatten(1, 2)[:, :n].float()  # [KVH, n, D]
        v = v_pool.index_select(1, blocks).flatten(1, 2)[:, :n].float()
        o = F.scaled_dot_product_attention(q[b:b + 1, :, None].float(), k[None], v[None], scale=scale,
                                           enable_gqa=True)
        outs.append(o[0, :, 0])
    return torch.stack(outs)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4), (8, 1), (32, 2)])
@pytest.mark.parametrize("d,bs", [(64, 16), (128, 16), (64, 8), (128, 32), (80, 16)])
def test_kernel_matches_sdpa(dtype, tol, heads, kv_heads, d, bs):
    """Head dims 64 and 128 (the vectorised bf16 paths) and others, blocks of 8 to 32 tokens."""
    g = torch.Generator().manual_seed(heads * 10 + kv_heads + d + bs)
    num_blocks = 100 * 16 // bs
    k_pool = torch.randn(kv_heads, num_blocks, bs, d, generator=g).to(dtype)
    v_pool = torch.randn(kv_heads, num_blocks, bs, d, generator=g).to(dtype)
    ctx = torch.tensor([1, 17, 100, 16, 250])
    per_seq = (250 + bs - 1) // bs
    tables = torch.randperm(num_blocks, generator=g)[:per_seq * len(ctx)].view(len(ctx), per_seq)  # own blocks
    q = torch.randn(len(ctx), heads, d, generator=g).to(dtype)
    k_new = torch.randn(kv_heads, len(ctx), d, generator=g).to(dtype)
    v_new = torch.randn(kv_heads, len(ctx), d, generator=g).to(dtype)
    last = ctx - 1
    slots = tables[torch.arange(len(ctx)), last // bs] * bs + last % bs
    out = kernels.paged_decode(q, k_new, v_new, slots, k_pool, v_pool, tables, ctx, d ** -0.5)
    assert out.dtype == dtype and out.shape == q.shape
    for b, pos in enumerate(last.tolist()):  # the new K/V landed at each sequence's last slot
        blk = int(tables[b, pos // bs])
        assert torch.equal(k_pool[:, blk, pos % bs], k_new[:, b])
        assert torch.equal(v_pool[:, blk, pos % bs], v_new[:, b])
    torch.testing.assert_close(out.float(), reference(q, k_pool, v_pool, tables, ctx, d ** -0.5), atol=tol, rtol=tol)
