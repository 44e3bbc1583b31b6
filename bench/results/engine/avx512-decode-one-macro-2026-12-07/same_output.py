"""Old and new cpu_kernels.c (built to /tmp/pdserve-ab/{old,new}-{avx512,avx512_bf16}.so with the builds' flags) give the same
bits: the output and both pools after one decode layer, for fp32 and bf16 caches and several head groupings."""
import ctypes, torch
P = ctypes.c_void_p
torch.manual_seed(0)
def call(lib, entry, q, kn, vn, slots, kp, vp, tables, ctx, scale):
    out = torch.empty_like(q); b, h, d = q.shape; kvh, nb, bs, _ = kp.shape
    getattr(lib, entry)(P(q.data_ptr()), P(kn.data_ptr()), P(vn.data_ptr()), P(slots.data_ptr()), P(kp.data_ptr()), P(vp.data_ptr()),
        P(tables.data_ptr()), P(ctx.data_ptr()), P(out.data_ptr()), b, h, kvh, d, nb, bs, tables.shape[1], ctypes.c_float(scale), 2)
    return out
for build in ("avx512", "avx512_bf16"):
    libs = {v: ctypes.CDLL(f"/tmp/pdserve-ab/{v}-{build}.so") for v in ("old", "new")}
    for DT, entry in ((torch.float32, "paged_decode_f32"), (torch.bfloat16, "paged_decode_bf16")):
        for H, KVH, D in ((9, 3, 64), (12, 3, 64), (6, 6, 64), (8, 2, 128), (4, 4, 128), (15, 5, 64), (7, 1, 64), (6, 2, 128), (10, 2, 128)):
            B, BS = 5, 16
            NB = 80
            ctx = torch.tensor([1, 17, 33, 100, 200])
            tables = torch.randperm(NB)[:B * 13].view(B, 13).contiguous()
            last = ctx - 1
            slots = tables[torch.arange(B), last // BS] * BS + last % BS
            pool = torch.randn(2, KVH, NB, BS, D).to(DT)
            q = torch.randn(B, H, D).to(DT); kn = torch.randn(KVH, B, D).to(DT); vn = torch.randn(KVH, B, D).to(DT)
            outs = {}
            for v, lib in libs.items():
                kp, vp = pool[0].clone(), pool[1].clone()
                outs[v] = (call(lib, entry, q, kn, vn, slots, kp, vp, tables, ctx, 0.125), kp, vp)
            same = all(torch.equal(a, b) for a, b in zip(outs["old"], outs["new"]))
            diff = (outs["old"][0].float() - outs["new"][0].float()).abs().max().item()
            print(build, DT, H, KVH, D, "equal" if same else f"DIFF max {diff:.3g}")
