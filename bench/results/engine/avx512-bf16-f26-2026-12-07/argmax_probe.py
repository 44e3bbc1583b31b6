import torch, time, statistics, sys
sys.path.insert(0, '.')
from engine import kernels
torch.set_num_threads(2)
k = kernels.active().kernel
print(k.name)
def t_(fn, n=200):
    ts=[]
    for _ in range(n):
        t=time.perf_counter(); fn(); ts.append(time.perf_counter()-t)
    return statistics.median(ts)*1e6
for dt in (torch.bfloat16, torch.float32):
  for B in (1, 8, 32):
    x = torch.randn(B, 49152).to(dt)
    assert torch.equal(k.argmax(x), x.max(dim=-1).indices)
    print(dt, B, f"torch max {t_(lambda: x.max(dim=-1).indices):.0f} us, kernel {t_(lambda: k.argmax(x)):.0f} us")
