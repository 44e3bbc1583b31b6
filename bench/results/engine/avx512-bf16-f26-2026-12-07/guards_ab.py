"""The compiled decode step with and without Dynamo's guards on nn modules, alternating every 5 engine steps."""
import time, torch, statistics, sys, random, types
sys.path.insert(0, '.')
from engine import CacheConfig, EngineConfig, LLMEngine, SamplingParams
torch.set_num_threads(int(sys.argv[1]))
dtype = sys.argv[2]
eng = LLMEngine(EngineConfig(model=None, dtype=dtype, num_threads=torch.get_num_threads(), max_num_seqs=64,
                             compile=True, cache=CacheConfig(memory_gib=0.5, enable_prefix_caching=False)))
r = eng.runner
new_step = r._step  # compiled with the nn-module guards filtered out (this tree's code)
real_compile = torch.compile
def keep_all(entries):
    return [True] * len(entries)
def patched(fn, **kw):
    kw["options"] = {**kw["options"], "guard_filter_fn": keep_all}
    fn = types.FunctionType(fn.__code__.replace(co_name="step_all_guards"), fn.__globals__, "step_all_guards",
                            fn.__defaults__, fn.__closure__)
    return real_compile(fn, **kw)
torch.compile = patched
t0 = time.perf_counter()
old_step = r._compile_decode()
torch.compile = real_compile
r._step, r._step_ready = old_step, False
r._warm_compiled()
print(f"the all-guards step compiled and checked in {time.perf_counter() - t0:.1f} s, ready {r._step_ready}", flush=True)
ways = {"all guards": old_step, "no nn-module guards": new_step}
random.seed(0)
res = {}
for B in (1, 8, 32):
    sp = SamplingParams(max_tokens=150, ignore_eos=True)
    for _ in range(B):
        eng.add_request([random.randrange(100, 40000) for _ in range(200)], sp)
    eng.step(); eng.step()
    i = 0
    while eng.has_unfinished():
        name = list(ways)[(i // 5) % 2]
        r._step = ways[name]
        t = time.perf_counter(); eng.step(); res.setdefault((B, name), []).append(time.perf_counter() - t)
        i += 1
for (B, name), ts in sorted(res.items()):
    ts = ts[:-1]
    print(f"B{B} {name}: median {statistics.median(ts)*1e3:.2f} ms, p10 {sorted(ts)[len(ts)//10]*1e3:.2f} ms, n {len(ts)}")
