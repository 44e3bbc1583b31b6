"""torch.profiler over eager bf16 prefills of 2000 tokens (2 threads). Usage, from the repository root: python profile_prefill.py"""
import sys, random, torch, time
sys.path.insert(0,'.')
from engine import CacheConfig, EngineConfig, LLMEngine, SamplingParams
torch.set_num_threads(2)
e = LLMEngine(EngineConfig(model=None, dtype="bfloat16", num_threads=2, compile=False, cache=CacheConfig(memory_gib=0.5, enable_prefix_caching=False)))
random.seed(0)
def run():
    e.generate([[random.randrange(100, 40000) for _ in range(2000)]], SamplingParams(max_tokens=1))
run(); run()
t=time.perf_counter(); run(); print("prefill 2000:", time.perf_counter()-t)
with torch.profiler.profile() as p:
    for _ in range(3): run()
ka = p.key_averages()
tot = sum(k.self_cpu_time_total for k in ka)
for k in sorted(ka, key=lambda k: -k.self_cpu_time_total)[:22]:
    print(f"  {k.key[:50]:50s} n={k.count:6d} self={k.self_cpu_time_total/3/1e3:8.1f} ms/prefill {100*k.self_cpu_time_total/tot:5.1f}%")
