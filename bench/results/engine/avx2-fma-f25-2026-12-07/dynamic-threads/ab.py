"""The compiled decode step with inductor's C++ kernels fixed to the thread count they were compiled for
(`static`) or reading it at run time (`dynamic`, `cpp.dynamic_threads`): decode steps at batch 1, 8 and 32
(context 200), on 1 and on 2 threads. Usage: ab.py static|dynamic OUT.json (run each with its own
TORCHINDUCTOR_CACHE_DIR, warm)."""
import json, sys, time
import torch
variant = sys.argv[1]
if variant == "static":
    real = torch.compile
    def compile_static(fn, **kw):
        kw.pop("options", None)
        return real(fn, **kw)
    torch.compile = compile_static
torch.set_num_threads(1)
from engine.config import EngineConfig, CacheConfig
from engine.llm_engine import LLMEngine
from engine import profiling
eng = LLMEngine(EngineConfig(dtype="float32", num_threads=1, compile=True, cache=CacheConfig(memory_gib=0.5)))
eng.runner.prepare_threads(2)
rows = []
for threads in (1, 2, 1, 2):
    torch.set_num_threads(threads)
    steps = profiling.time_decode_steps(eng, [1, 8, 32], context=200, steps=8)
    row = dict(variant=variant, threads=threads, **{f"b{b}_ms": round(s * 1e3, 2) for b, s in zip((1, 8, 32), steps)})
    rows.append(row); print(json.dumps(row), flush=True)
json.dump(rows, open(sys.argv[2], "w"), indent=1)
