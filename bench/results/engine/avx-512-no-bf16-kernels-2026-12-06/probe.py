"""dtype auto and the linear-layer probe on this machine, with batches 1..32 (fp32; bf16 timings too)."""
import json, sys, time
import torch
torch.set_num_threads(2)
from engine import auto_dtype, hardware, packed_linear
from engine.model_loader import load_model
cpu = hardware.this_cpu()
print(cpu.model, cpu.machine_class(), cpu.isa_summary(), hardware.choose_dtype("cpu", cpu))
m, _ = load_model(None, "float32", "cpu")
print("dtype probe:", auto_dtype.measure(m))
# matmul limits
for dt in (torch.float32, torch.bfloat16):
    a = torch.randn(1024, 1024, dtype=dt); b = torch.randn(1024, 1024, dtype=dt)
    t = hardware.best_of(lambda: a @ b, 5); print(dt, "matmul 1024^3", 2 * 1024**3 / t / 1e9, "GFLOP/s")
packed_linear.PROBE_BATCHES = (1, 4, 16, 32)
res = packed_linear.measure(m, kernel=True, blocked=True)
for g, t in sorted(res.items()):
    print(g, {w: [round(x * 1e3, 3) for x in v] for w, v in t.items()})
print(hardware.pick_linear({g: {w: v[:3] for w, v in t.items()} for g, t in res.items()}).summary())
json.dump(res, open(sys.argv[1], "w"))
