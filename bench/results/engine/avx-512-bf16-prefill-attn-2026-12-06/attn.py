import time, torch, statistics
from engine import kernels
torch.set_num_threads(2)
kern = kernels.active().kernel
H, KVH, D, bs = 9, 3, 64, 16
def bench(n, start, reps=20):
    ctx = start + n
    nb = (ctx + bs - 1) // bs + 4
    k = torch.randn(KVH, nb, bs, D).to(torch.bfloat16); v = torch.randn(KVH, nb, bs, D).to(torch.bfloat16)
    table = torch.randperm(nb)[: (ctx + bs - 1)//bs].to(torch.int64)
    q = torch.randn(H, n, D).to(torch.bfloat16)
    for _ in range(3): kern.prefill_attention(q, k, v, table, start, 0.125)
    ts = []
    for _ in range(reps):
        t = time.perf_counter(); kern.prefill_attention(q, k, v, table, start, 0.125); ts.append(time.perf_counter() - t)
    t = statistics.median(ts); fl = n * (start + n/2) * H * D * 4
    print(f"n {n} start {start}: {t*1e3:.3f} ms, {fl/t/1e9:.0f} GFLOP/s, x30 layers {30*t*1e3:.1f} ms")
for n, s in [(72, 1400), (216, 1400), (72, 1100), (72, 1700), (256, 1024), (1024, 0), (128, 512)]:
    bench(n, s)
