"""Blocked fp32 linear: the avx2 build (8-column blocks) against the avx512 build (16-column blocks), interleaved."""
import json, sys, time, statistics
import torch
torch.set_num_threads(2)
from engine import hardware, kernels
builds = {b.name: kernels.load(b) for b in hardware.runnable(hardware.this_cpu()) if b.name in ("avx2", "avx512")}
rows = []
for n, k in ((1536, 576), (576, 1536), (576, 576), (192, 576), (49152, 576)):
    w = torch.randn(n, k)
    blocked = {name: ker.block_weight(w) for name, ker in builds.items()}
    for m in (1, 4, 16, 32, 200, 2000):
        if n == 49152 and m > 32: continue
        x = torch.randn(m, k)
        t = {name: [] for name in builds}
        reps = max(1, int(2e8 / (m * n * k)))
        for _ in range(7):
            for name, ker in builds.items():
                t0 = time.perf_counter()
                for _ in range(reps): ker.blocked_linear(x, blocked[name], None, n)
                t[name].append((time.perf_counter() - t0) / reps)
        med = {name: statistics.median(v) for name, v in t.items()}
        row = dict(n=n, k=k, m=m, **{f"{name}_us": round(v * 1e6, 1) for name, v in med.items()},
                   ratio=round(med["avx512"] / med["avx2"], 3), avx512_gflops=round(2 * m * n * k / med["avx512"] / 1e9))
        rows.append(row); print(json.dumps(row), flush=True)
json.dump(rows, open(sys.argv[1], "w"), indent=1)
