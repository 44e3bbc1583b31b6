import torch, time, statistics
torch.set_num_threads(2)
def rms(x, w, eps: float):
    dt = x.dtype
    h = x.to(torch.float32)
    var = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(var + eps)
    return w * h.to(dt)
def silu_mul(g, u):
    return torch.nn.functional.silu(g) * u
crms = torch.compile(rms, dynamic=True)
csm = torch.compile(silu_mul, dynamic=True)
def t_(fn, n=30):
    fn(); ts=[]
    for _ in range(n):
        t=time.perf_counter(); fn(); ts.append(time.perf_counter()-t)
    return statistics.median(ts)*1e6
for dt in (torch.bfloat16, torch.float32):
    w = torch.randn(576).to(dt)
    for M in (16, 128, 2000):
        x = torch.randn(1, M, 576).to(dt); g = torch.randn(1, M, 1536).to(dt); u = torch.randn(1, M, 1536).to(dt)
        assert torch.equal(crms(x, w, 1e-5), rms(x, w, 1e-5)) or dt == torch.bfloat16
        print(dt, M, f"rms eager {t_(lambda: rms(x, w, 1e-5)):.0f} us compiled {t_(lambda: crms(x, w, 1e-5)):.0f} us | silu_mul eager {t_(lambda: silu_mul(g, u)):.0f} compiled {t_(lambda: csm(g, u)):.0f} us", flush=True)
        if dt == torch.bfloat16:
            print("  rms bf16 max diff", (crms(x, w, 1e-5).float() - rms(x, w, 1e-5).float()).abs().max().item(), " silu_mul diff", (csm(g,u).float()-silu_mul(g,u).float()).abs().max().item())
