"""Kernel A/B: the old and new cpu_kernels.c built with the same flags (gcc $FLAGS -mavx2 -mfma -mf16c or the
AVX-512 BF16 flags, to $LIBS/{old,new}-{avx2,avx512}.so, LIBS default /tmp/pdserve-ab), loaded in one process, alternating 9 rounds of
30 layers of paged decode. Usage: python this.py avx512|avx2 bfloat16|float32 CONTEXT [BATCH]."""
import ctypes, os, sys, time, statistics, torch
torch.set_num_threads(2)
P = ctypes.c_void_p
build, DT = sys.argv[1], getattr(torch, sys.argv[2]); ctx_len = int(sys.argv[3]); B = int(sys.argv[4]) if len(sys.argv) > 4 else 32
libs = {v: ctypes.CDLL(f"{os.environ.get('LIBS', '/tmp/pdserve-ab')}/{v}-{build}.so") for v in ("old", "new")}
entry = "paged_decode_f32" if DT == torch.float32 else "paged_decode_bf16"
def call(lib, q, kn, vn, slots, kp, vp, tables, ctx, scale):
    out = torch.empty_like(q); b, h, d = q.shape; kvh, nb, bs, _ = kp.shape
    getattr(lib, entry)(P(q.data_ptr()), P(kn.data_ptr()), P(vn.data_ptr()), P(slots.data_ptr()), P(kp.data_ptr()), P(vp.data_ptr()),
        P(tables.data_ptr()), P(ctx.data_ptr()), P(out.data_ptr()), b, h, kvh, d, nb, bs, tables.shape[1], ctypes.c_float(scale), 2)
    return out
L, H, KVH, D, BS = 30, 9, 3, 64, 16
nbper = (ctx_len + BS) // BS + 1; NB = B * nbper + 8
pool = torch.randn(L, 2, KVH, NB, BS, D).to(DT)
contig = torch.arange(B * nbper).view(B, nbper)
inter = torch.arange(B * nbper).view(nbper, B).t().contiguous()
perm = torch.randperm(B * nbper)[contig]
ctx = torch.full((B,), ctx_len, dtype=torch.long); last = ctx - 1
q = torch.randn(B, H, D).to(DT); kn = torch.randn(KVH, B, D).to(DT)
for tname, tables in (("contiguous", contig), ("interleaved", inter), ("random", perm)):
    slots = tables[torch.arange(B), last // BS] * BS + last % BS
    res = {v: [] for v in libs}
    for rep in range(9):
        for v, lib in libs.items():
            t0 = time.perf_counter()
            for l in range(L): call(lib, q, kn, kn, slots, pool[l, 0], pool[l, 1], tables, ctx, 0.125)
            res[v].append(time.perf_counter() - t0)
    med = {v: statistics.median(x) * 1e3 for v, x in res.items()}
    print(f"{build} {sys.argv[2]} B{B} ctx {ctx_len} {tname:12s} old {med['old']:.2f} ms  new {med['new']:.2f} ms  old/new {med['old']/med['new']:.2f}x")
