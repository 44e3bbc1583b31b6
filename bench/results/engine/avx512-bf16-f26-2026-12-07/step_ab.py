"""The decode step before and after: (old) Dynamo's guards on every module, the kernel's inputs made contiguous in
the C++ operator, greedy picks by torch's max; (new) this tree. Alternating every 5 engine steps in one process.
Usage, from the repository root: python step_ab.py THREADS DTYPE"""
import time, torch, statistics, sys, random, types
sys.path.insert(0, '.')
from engine import CacheConfig, EngineConfig, LLMEngine, SamplingParams, attention, kernels, triton_attention
torch.set_num_threads(int(sys.argv[1]))
eng = LLMEngine(EngineConfig(model=None, dtype=sys.argv[2], num_threads=torch.get_num_threads(), max_num_seqs=64,
                             compile=True, cache=CacheConfig(memory_gib=0.5, enable_prefix_caching=False)))
r = eng.runner
new_step, new_kd, new_argmax = r._step, attention._kernel_decode, kernels.argmax

def old_kd(query, key, value, slots, kv_layer, meta, scaling):  # the kernel's inputs as they come
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    args = (query[0].transpose(0, 1), key[0], value[0], slots)
    op = kernels.active().op or attention.paged_decode_step
    return op(*args, kv_layer, meta.decode_blocks, meta.ctx_lens, scale).unsqueeze(0)

def old_argmax(logits):
    return logits.max(dim=-1).indices

real_compile = torch.compile
def keep_all(entries):
    return [True] * len(entries)
def patched(fn, **kw):
    kw["options"] = {**kw["options"], "guard_filter_fn": keep_all}
    return real_compile(fn, **kw)
ways = {"old": None, "new": (new_step, new_kd, new_argmax)}
def use(name):
    step, kd, am = ways[name]
    r._step, attention._kernel_decode, kernels.argmax = step, kd, am
torch.compile = patched
attention._kernel_decode = old_kd
t0 = time.perf_counter()
old_step = r._compile_decode()
torch.compile = real_compile
ways["old"] = (old_step, old_kd, old_argmax)
use("old")
r._step_ready = False
r._warm_compiled()
print(f"the old step compiled and checked in {time.perf_counter() - t0:.1f} s, ready {r._step_ready}", flush=True)
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
        use(name)
        t = time.perf_counter(); eng.step(); res.setdefault((B, name), []).append(time.perf_counter() - t)
        i += 1
for (B, name), ts in sorted(res.items()):
    ts = ts[:-1]
    print(f"B{B} {name}: median {statistics.median(ts)*1e3:.2f} ms, p10 {sorted(ts)[len(ts)//10]*1e3:.2f} ms, n {len(ts)}")
