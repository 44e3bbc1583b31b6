"""fp32 prefill attention: the build's kernel (avx2 here) against causal SDPA (whole prompts) and gather + SDPA (chunks)."""
import json, sys, statistics, time
import torch
import torch.nn.functional as F
torch.set_num_threads(2)
from engine import hardware, kernels
ker = kernels.active().kernel
H, KVH, D, BS = 9, 3, 64, 16
rows = []
for start, n in ((0, 200), (0, 1024), (0, 2000), (1400, 72), (1400, 216), (512, 128), (1024, 512)):
    ctx = start + n; blocks = -(-ctx // BS)
    g = torch.Generator().manual_seed(0)
    k_pool, v_pool = (torch.randn(KVH, blocks, BS, D, generator=g) for _ in range(2))
    table = torch.arange(blocks)
    q = torch.randn(H, n, D, generator=g)
    kf = k_pool.reshape(KVH, -1, D)[:, :ctx]; vf = v_pool.reshape(KVH, -1, D)[:, :ctx]
    mask = torch.ones(n, ctx, dtype=torch.bool).tril(start)
    def sdpa():
        if start == 0:
            return F.scaled_dot_product_attention(q[None], kf[None], vf[None], is_causal=True, enable_gqa=True)
        return F.scaled_dot_product_attention(q[None], kf[None], vf[None], attn_mask=mask, enable_gqa=True)
    def kern():
        return ker.prefill_attention(q, k_pool, v_pool, table, start, D ** -0.5)
    t = {"sdpa": [], "kernel": []}
    for _ in range(5):
        for name, fn in (("sdpa", sdpa), ("kernel", kern)):
            t[name].append(hardware.best_of(fn, 2))
    med = {k: statistics.median(v) for k, v in t.items()}
    fl = 4 * H * D * (n * start + n * (n + 1) / 2)
    row = dict(start=start, n=n, sdpa_ms=round(med["sdpa"] * 1e3, 2), kernel_ms=round(med["kernel"] * 1e3, 2),
               speedup=round(med["sdpa"] / med["kernel"], 2), kernel_gflops=round(fl / med["kernel"] / 1e9))
    rows.append(row); print(json.dumps(row), flush=True)
json.dump(rows, open(sys.argv[1], "w"), indent=1)
