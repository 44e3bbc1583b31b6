import torch, time
torch.set_num_threads(2)
from engine import kernels, hardware, packed_linear
sel = kernels.active(); k = sel.kernel
for n, kk in ((576, 576), (1536, 576), (576, 1536), (192, 576)):
    w = torch.randn(n, kk); x = torch.randn(1, kk); b = k.block_weight(w)
    op = sel.blocked_op(torch.float32)
    f = {"plain": lambda: torch.nn.functional.linear(x, w), "ctypes": lambda: packed_linear._blocked_forward(x, b, None, n),
         "op": lambda: op(x, b, None, n)}
    print(n, kk, {name: round(hardware.best_of(fn, 200) * 1e6, 1) for name, fn in f.items()})
