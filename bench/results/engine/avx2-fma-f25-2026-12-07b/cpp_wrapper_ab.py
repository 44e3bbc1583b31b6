"""The compiled decode step with inductor's Python wrapper and with its C++ wrapper, alternating in one process."""
# Run at b42e4eb^ (before pdserve took the C++ wrapper): "py" was then what pdserve ran, "cpp" what it runs now.
# in-process A/B of the compiled decode step: inductor's Python wrapper vs its C++ wrapper (built separately)
import time, torch, statistics, sys, random
sys.path.insert(0, '.')  # run from the repository root
from engine import CacheConfig, EngineConfig, LLMEngine, SamplingParams
from engine import model_runner as mr
torch.set_num_threads(2)
eng = LLMEngine(EngineConfig(model=None, dtype="auto", num_threads=2, max_num_seqs=64, compile=True,
                             cache=CacheConfig(memory_gib=0.5, enable_prefix_caching=False)))
r = eng.runner
dec, kv, lm_head = r.decoder, r.kv, r.lm_head
def step_cpp(input_ids, positions, slots, tables, ctx):
    hidden = dec.embed_tokens(input_ids)
    cos, sin = dec.rotary_emb(hidden, position_ids=positions)
    for i, layer in enumerate(dec.layers):
        hidden = mr._decode_layer(layer, hidden, cos, sin, slots, tables, ctx, kv[i])
    return lm_head(dec.norm(hidden)[0])
orig = r._step
t0 = time.perf_counter()
mine = torch.compile(step_cpp, dynamic=False, options={"cpp.dynamic_threads": True, "cpp_wrapper": True,
                                                      "cpp_wrapper_build_separate": True})
r._step, r._step_ready = mine, False
r._warm_compiled()
print("cpp wrapper graphs in", time.perf_counter() - t0, "ready", r._step_ready, flush=True)
steps = {"py": orig, "cpp": mine}
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
