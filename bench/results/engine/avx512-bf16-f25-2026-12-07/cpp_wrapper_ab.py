"""The compiled decode step with inductor's C++ wrapper (what pdserve runs) and with its Python wrapper, alternating
every 5 engine steps in one process."""
import time, torch, statistics, sys, random
sys.path.insert(0, '.')  # run from the repository root
from engine import CacheConfig, EngineConfig, LLMEngine, SamplingParams
from engine import model_runner as mr
torch.set_num_threads(2)
eng = LLMEngine(EngineConfig(model=None, dtype="auto", num_threads=2, max_num_seqs=64, compile=True,
                             cache=CacheConfig(memory_gib=0.5, enable_prefix_caching=False)))
r = eng.runner
print("dtype", r.dtype if hasattr(r, "dtype") else "?", flush=True)
cpp = r._step
t0 = time.perf_counter()
mr.CPU_WRAPPER = {}
py = r._compile_decode()
r._step, r._step_ready = py, False
r._warm_compiled()
print("python wrapper graphs in", time.perf_counter() - t0, "ready", r._step_ready, flush=True)
steps = {"py": py, "cpp": cpp}
random.seed(0)
res = {}
for B in (1, 8, 32):
    sp = SamplingParams(max_tokens=200, ignore_eos=True)
    for _ in range(B):
        eng.add_request([random.randrange(100, 40000) for _ in range(200)], sp)
    eng.step(); eng.step()
    i = 0
    while eng.has_unfinished():
        name = "py" if (i // 5) % 2 == 0 else "cpp"
        r._step = steps[name]
        t = time.perf_counter(); eng.step(); res.setdefault((B, name), []).append(time.perf_counter() - t)
        i += 1
for (B, name), ts in sorted(res.items()):
    ts = ts[:-1]
    print(f"B{B} {name}: median {statistics.median(ts)*1e3:.2f} ms, p10 {sorted(ts)[len(ts)//10]*1e3:.2f} ms, n {len(ts)}")
