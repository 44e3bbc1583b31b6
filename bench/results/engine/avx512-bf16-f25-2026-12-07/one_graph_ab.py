"""The compiled decode step as one graph for every batch (what pdserve runs: the batch dimension unbacked, code tuned
for `model_runner.BATCH_HINT` rows) and as the two graphs pdserve ran before (batch 1, and batch > 1 with a backed
dynamic batch), alternating every 5 engine steps in one process.
Usage, from the repository root: python one_graph_ab.py THREADS DTYPE"""
import time, torch, statistics, sys, random
sys.path.insert(0, '.')  # run from the repository root
from engine import CacheConfig, EngineConfig, LLMEngine, SamplingParams
torch.set_num_threads(int(sys.argv[1]))
t0 = time.perf_counter()
eng = LLMEngine(EngineConfig(model=None, dtype=sys.argv[2], num_threads=torch.get_num_threads(), max_num_seqs=64,
                             compile=True, cache=CacheConfig(memory_gib=0.5, enable_prefix_caching=False)))
print(f"engine (one graph) up in {time.perf_counter() - t0:.1f} s", flush=True)
r = eng.runner
one_step, one_run = r._step, r._decode_compiled
two = r._compile_decode()

def run_two(*inputs):  # the marking of the two graphs' code
    ids, positions, slots, tables, ctx = inputs
    for t, dims in ((ids, (1,)), (positions, (1,)), (slots, (0,)), (tables, (0, 1)), (ctx, (0,))):
        for d in dims:
            torch._dynamo.mark_dynamic(t, d)
    if not r._step_ready:
        return two(*inputs)
    with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
        return two(*inputs)

t0 = time.perf_counter()
r._step, r._step_ready, r._decode_compiled = two, False, run_two
r._warm_compiled()  # batch 2 then batch 1: the two graphs
print(f"two graphs compiled and checked in {time.perf_counter() - t0:.1f} s, ready {r._step_ready}", flush=True)
ways = {"two": (two, run_two), "one": (one_step, one_run)}
random.seed(0)
res = {}
for B in (1, 4, 8, 32):
    sp = SamplingParams(max_tokens=150, ignore_eos=True)
    for _ in range(B):
        eng.add_request([random.randrange(100, 40000) for _ in range(200)], sp)
    eng.step(); eng.step()
    i = 0
    while eng.has_unfinished():
        name = "two" if (i // 5) % 2 == 0 else "one"
        r._step, r._decode_compiled = ways[name]
        t = time.perf_counter(); eng.step(); res.setdefault((B, name), []).append(time.perf_counter() - t)
        i += 1
for (B, name), ts in sorted(res.items()):
    ts = ts[:-1]
    print(f"B{B} {name}: median {statistics.median(ts)*1e3:.2f} ms, p10 {sorted(ts)[len(ts)//10]*1e3:.2f} ms, n {len(ts)}")
