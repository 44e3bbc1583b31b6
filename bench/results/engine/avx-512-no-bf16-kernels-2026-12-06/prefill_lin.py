import torch
torch.set_num_threads(2)
from engine import kernels, hardware, packed_linear
sel = kernels.active(); k = sel.kernel; op = sel.blocked_op(torch.float32)
for n, kk in ((1536, 576), (576, 1536), (576, 576), (49152, 576)):
    w = torch.randn(n, kk); b = k.block_weight(w)
    for m in (64, 200, 2000):
        x = torch.randn(m, kk)
        tp = hardware.best_of(lambda: torch.nn.functional.linear(x, w), 5)
        tb = hardware.best_of(lambda: op(x, b, None, n), 5)
        fl = 2 * m * n * kk
        print(n, kk, m, f"plain {fl/tp/1e9:.0f} GFLOP/s  blocked {fl/tb/1e9:.0f} GFLOP/s")
