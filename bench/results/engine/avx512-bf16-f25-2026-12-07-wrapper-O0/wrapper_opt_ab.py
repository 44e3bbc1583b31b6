"""The compiled decode step's C++ wrapper built at -O1 (inductor's default, what pdserve ran) and at -O0, alternating
every 5 engine steps in one process. Usage: python this.py DTYPE (auto, float32, bfloat16)."""
import time, torch, statistics, sys, random
sys.path.insert(0, '.')  # run from the repository root
from engine import CacheConfig, EngineConfig, LLMEngine, SamplingParams
from engine import model_runner as mr
torch.set_num_threads(2)
eng = LLMEngine(EngineConfig(model=None, dtype=sys.argv[1], num_threads=2, max_num_seqs=64, compile=True,
                             cache=CacheConfig(memory_gib=0.5, enable_prefix_caching=False)))
r = eng.runner
print("dtype", r.dtype if hasattr(r, "dtype") else "?", flush=True)
o1 = r._step
t0 = time.perf_counter()
mr.CPU_WRAPPER = {**mr.CPU_WRAPPER, "aot_inductor.compile_wrapper_opt_level": "O0"}  # a backend of its own
with torch._inductor.config.patch({"force_disable_caches": True}):
    o0 = r._compile_decode()
    r._step, r._step_ready = o0, False
    r._warm_compiled()
print("O0 wrapper graph in", time.perf_counter() - t0, "ready", r._step_ready, flush=True)
steps = {"O0": o0, "O1": o1}
random.seed(0)
res = {}
for B in (1, 8, 32):
    sp = SamplingParams(max_tokens=200, ignore_eos=True)
    for _ in range(B):
        eng.add_request([random.randrange(100, 40000) for _ in range(200)], sp)
    eng.step(); eng.step()
    i = 0
    while eng.has_unfinished():
        name = "O0" if (i // 5) % 2 == 0 else "O1"
        r._step = steps[name]
        t = time.perf_counter(); eng.step(); res.setdefault((B, name), []).append(time.perf_counter() - t)
        i += 1
for (B, name), ts in sorted(res.items()):
    ts = ts[:-1]
    print(f"B{B} {name}: median {statistics.median(ts)*1e3:.2f} ms, p10 {sorted(ts)[len(ts)//10]*1e3:.2f} ms, n {len(ts)}")
