"""The blocked kernel called from Python for 30 layers: q, k, v, gate, up apart (five calls a layer) against q/k/v and
gate/up concatenated (two). Usage, from the repository root: PYTHONPATH=. python kernel_calls.py bfloat16|float32"""
import time, torch, sys
from engine import kernels

sel = kernels.active()
DT = getattr(torch, sys.argv[1])
op = sel.blocked_op(DT)
K = 576
torch.manual_seed(0)
def mk(n, k=K): return sel.kernel.block_weight(torch.randn(n, k, dtype=DT) * 0.05)
for threads in (2,):
    torch.set_num_threads(threads)
    for M in (1, 8, 32):
        x = torch.randn(M, K, dtype=DT)
        # 30 layers of weights, cold-ish like a real step
        L = 30
        q = [mk(576) for _ in range(L)]; k_ = [mk(192) for _ in range(L)]; v = [mk(192) for _ in range(L)]
        qkv = [torch.cat([a, b, c]) for a, b, c in zip(q, k_, v)]
        g = [mk(1536) for _ in range(L)]; u = [mk(1536) for _ in range(L)]
        gu = [torch.cat([a, b]) for a, b in zip(g, u)]
        def sep():
            for i in range(L):
                op(x, q[i], None, 576); op(x, k_[i], None, 192); op(x, v[i], None, 192)
                op(x, g[i], None, 1536); op(x, u[i], None, 1536)
        def fused():
            for i in range(L):
                op(x, qkv[i], None, 960); op(x, gu[i], None, 3072)
        # check equality
        a = torch.cat([op(x, q[0], None, 576), op(x, k_[0], None, 192), op(x, v[0], None, 192)], -1)
        b = op(x, qkv[0], None, 960)
        eq = torch.equal(a, b)
        ts = {"sep": [], "fused": []}
        for r in range(15):
            for name, f in (("sep", sep), ("fused", fused)):
                t = time.perf_counter(); f(); ts[name].append(time.perf_counter() - t)
        med = {n: sorted(v)[len(v)//2]*1e3 for n, v in ts.items()}
        print(f"threads {threads} M {M}: sep {med['sep']:.3f} ms fused {med['fused']:.3f} ms  diff {med['sep']-med['fused']:.3f} ms  bit-equal {eq}")
