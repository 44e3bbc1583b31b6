import time, torch, statistics, sys, random
sys.path.insert(0, '.')
from engine import CacheConfig, EngineConfig, LLMEngine, SamplingParams
torch.set_num_threads(2)
eng = LLMEngine(EngineConfig(model=None, dtype="bfloat16", num_threads=2, max_num_seqs=64,
                             compile=True, cache=CacheConfig(memory_gib=0.5, enable_prefix_caching=False)))
random.seed(0)
from torch.profiler import profile, ProfilerActivity
for B in (1, 32):
    sp = SamplingParams(max_tokens=80, ignore_eos=True)
    for _ in range(B):
        eng.add_request([random.randrange(100, 40000) for _ in range(200)], sp)
    eng.step(); eng.step()
    ts=[]
    for _ in range(20):
        t=time.perf_counter(); eng.step(); ts.append(time.perf_counter()-t)
    print(f"B{B} step median {statistics.median(ts)*1e3:.2f} ms", flush=True)
    with profile(activities=[ProfilerActivity.CPU]) as p:
        for _ in range(20):
            eng.step()
    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
    while eng.has_unfinished(): eng.step()
