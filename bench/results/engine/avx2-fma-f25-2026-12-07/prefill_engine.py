"""A lone prompt's prefill in pdserve's engine (fp32, 2 threads, random prompts: no prefix hits), its attention
on the fp32 prefill kernel against torch's SDPA (the same engine with the kernel switched off), interleaved
rounds, median seconds (a prompt alone in its step goes whole)."""
import json, statistics, sys
import torch
torch.set_num_threads(2)
from engine.config import EngineConfig, CacheConfig
from engine.llm_engine import LLMEngine
from engine import profiling
eng = LLMEngine(EngineConfig(dtype="float32", num_threads=2, compile=False, cache=CacheConfig(memory_gib=1.0)))
run = eng.runner
assert run.prefill_kernel and run.prefill_kernel_whole, "this build holds no fp32 prefill kernel"
ways = {"kernel": (True, True), "sdpa": (False, False)}
rows = []
for n in (200, 1024, 2000):
    t = {w: [] for w in ways}
    for r in range(5):
        for w, (on, whole) in ways.items():
            run.prefill_kernel, run.prefill_kernel_whole = on, whole
            t[w].append(profiling.time_prefill(eng, n, seed=r))
    med = {w: statistics.median(v) for w, v in t.items()}
    row = dict(prompt=n, kernel_s=round(med["kernel"], 3), sdpa_s=round(med["sdpa"], 3),
               kernel_tok_s=round(n / med["kernel"]), sdpa_tok_s=round(n / med["sdpa"]),
               speedup=round(med["sdpa"] / med["kernel"], 3))
    rows.append(row); print(json.dumps(row), flush=True)
json.dump(rows, open(sys.argv[1], "w"), indent=1)
