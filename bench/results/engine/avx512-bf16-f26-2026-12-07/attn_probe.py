import torch, time, statistics, sys
sys.path.insert(0, '.')
from engine import kernels
torch.set_num_threads(2)
k = kernels.active().kernel
print(k)
H, KVH, D, bs = 9, 3, 64, 16
dt = torch.bfloat16
L = 30
for B, ctx_len in ((1, 264), (8, 264), (32, 264), (32, 1000)):
    nb = (ctx_len + bs) // bs + 1
    blocks = B * nb + 8
    pools = [(torch.randn(KVH, blocks, bs, D).to(dt), torch.randn(KVH, blocks, bs, D).to(dt)) for _ in range(L)]
    # contiguous per sequence
    tables = torch.arange(B * nb).view(B, nb)
    ctx = torch.full((B,), ctx_len, dtype=torch.long)
    slots = tables[:, (ctx_len - 1) // bs] * bs + (ctx_len - 1) % bs
    q = torch.randn(B, H, D).to(dt); kn = torch.randn(KVH, B, D).to(dt); vn = torch.randn(KVH, B, D).to(dt)
    ts = []
    for rep in range(30):
        t = time.perf_counter()
        for kp, vp in pools:
            k.paged_decode(q, kn, vn, slots, kp, vp, tables, ctx, 0.125)
        ts.append(time.perf_counter() - t)
    m = statistics.median(ts)
    byts = B * ctx_len * KVH * D * 2 * 2 * L
    print(f"B{B} ctx{ctx_len}: {m*1e3:.2f} ms per 30 layers, {byts/m/1e9:.1f} GB/s of KV")
x = torch.ones(64 << 20, dtype=torch.float32)
ts=[]
for _ in range(10):
    t=time.perf_counter(); x.sum(); ts.append(time.perf_counter()-t)
print(f"sum read {x.numel()*4/min(ts)/1e9:.1f} GB/s")
