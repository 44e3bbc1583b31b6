"""Decode steps compiled with inductor's cpp.min_chunk_size=CHUNK (new) against the default (old): two engines in one
process, stepped alternately 5 steps at a time. Usage: python chunk_ab.py THREADS DTYPE CHUNK"""
import random, statistics, sys, time
import torch
sys.path.insert(0, '.')
from engine import CacheConfig, EngineConfig, LLMEngine, SamplingParams
torch.set_num_threads(int(sys.argv[1]))
def engine():
    return LLMEngine(EngineConfig(model=None, dtype=sys.argv[2], num_threads=torch.get_num_threads(), max_num_seqs=64,
                                  compile=True, cache=CacheConfig(memory_gib=0.5, enable_prefix_caching=False)))
real = torch.compile
engines = {"old": engine()}
def patched(fn, **kw):
    kw["options"] = {**kw["options"], "cpp.min_chunk_size": int(sys.argv[3])}
    return real(fn, **kw)
torch.compile = patched
engines["new"] = engine()
torch.compile = real
random.seed(0)
res = {}
for B in (1, 8, 32):
    sp = SamplingParams(max_tokens=150, ignore_eos=True)
    prompts = [[random.randrange(100, 40000) for _ in range(200)] for _ in range(B)]
    for e in engines.values():
        for p in prompts: e.add_request(p, sp)
        e.step(); e.step()
    i = 0
    while any(e.has_unfinished() for e in engines.values()):
        name = list(engines)[(i // 5) % 2]; e = engines[name]
        if e.has_unfinished():
            t = time.perf_counter(); e.step(); res.setdefault((B, name), []).append(time.perf_counter() - t)
        i += 1
for (B, name), ts in sorted(res.items()):
    ts = ts[:-1]
    print(f"B{B} {name}: median {statistics.median(ts)*1e3:.2f} ms, p10 {sorted(ts)[len(ts)//10]*1e3:.2f} ms, n {len(ts)}")
