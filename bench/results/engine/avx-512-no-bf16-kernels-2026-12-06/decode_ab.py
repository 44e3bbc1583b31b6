"""Decode attention A/B: the avx2 and avx512 builds on one layer of the embedded model's shape."""
import json, sys, time
import torch
from engine import hardware, kernels

torch.set_num_threads(2)
builds = {b.name: b for b in hardware.runnable(hardware.this_cpu())}
H, KVH, D, BS = 9, 3, 64, 16
rows = []
for dtype in (torch.float32, torch.bfloat16):
    for B, L in ((1, 264), (8, 264), (32, 264), (32, 1000)):
        g = torch.Generator().manual_seed(0)
        per = (L + BS - 1) // BS
        nb = per * B + 4
        k = torch.randn(KVH, nb, BS, D, generator=g).to(dtype); v = torch.randn_like(k)
        tables = torch.randperm(nb, generator=g)[:per * B].view(B, per)
        ctx = torch.full((B,), L)
        last = ctx - 1
        slots = tables[torch.arange(B), last // BS] * BS + last % BS
        q = torch.randn(B, H, D, generator=g).to(dtype)
        kn = torch.randn(KVH, B, D, generator=g).to(dtype); vn = torch.randn_like(kn)
        res = {}
        for name in ("avx2", "avx512"):
            ker = kernels.load(builds[name])
            for _ in range(20): ker.paged_decode(q, kn, vn, slots, k, v, tables, ctx, D ** -0.5)
            best = []
            for rep in range(7):
                t0 = time.perf_counter()
                for _ in range(50): ker.paged_decode(q, kn, vn, slots, k, v, tables, ctx, D ** -0.5)
                best.append((time.perf_counter() - t0) / 50)
            res[name] = sorted(best)[len(best) // 2]
        gb = 2 * B * L * KVH * D * k.element_size() / 1e9
        rows.append(dict(dtype=str(dtype).split('.')[1], B=B, L=L, avx2_us=res["avx2"] * 1e6, avx512_us=res["avx512"] * 1e6,
                         avx2_GBps=gb / res["avx2"], avx512_GBps=gb / res["avx512"]))
        print(json.dumps(rows[-1]), flush=True)
json.dump(rows, open(sys.argv[1], "w"), indent=1)
