import time, torch, logging, random, statistics, sys
from engine import CacheConfig, EngineConfig, LLMEngine, SamplingParams
from engine.fused_layers import FusedRMSNorm, FusedGatedMLP, reference_rms_norm
logging.basicConfig(level=logging.WARNING)
torch.set_num_threads(2)
dtype = sys.argv[1]
eng = LLMEngine(EngineConfig(model="/root/.cache/pdserve/models/SmolLM2-135M-Instruct", dtype=dtype, num_threads=2, compile=True, linear="auto", max_num_seqs=64, cache=CacheConfig(memory_gib=2.0)))
mods = [m for m in eng.runner.model.modules() if isinstance(m, (FusedRMSNorm, FusedGatedMLP))]
fused_ops = {id(m): m._op for m in mods}
print("fused modules", len(mods))
def set_on(on):
    for m in mods:
        if on: m._op = fused_ops[id(m)]
        elif isinstance(m, FusedRMSNorm): m._op = reference_rms_norm
        else: m._op = lambda g, u: torch.nn.functional.silu(g) * u
rng = random.Random(0)
def run(prompt, k=1):
    eng.add_request(prompt, SamplingParams(max_tokens=k, ignore_eos=True), request_id=str(rng.random()))
    t = time.perf_counter()
    while eng.has_unfinished(): eng.step()
    return time.perf_counter() - t
res = {}
for rep in range(int(sys.argv[2])):
  for on in (False, True, True, False):
    set_on(on)
    h = [rng.randrange(1000, 40000) for _ in range(1400)]
    run(h)
    res.setdefault(("72/1400",on),[]).append(run(h + [rng.randrange(1000, 40000) for _ in range(72)]))
    res.setdefault(("216/1400",on),[]).append(run(h + [rng.randrange(1000, 40000) for _ in range(216)]))
    res.setdefault(("2000/0",on),[]).append(run([rng.randrange(1000, 40000) for _ in range(2000)]))
for k in ("72/1400","216/1400","2000/0"):
    a=statistics.median(res[(k,False)]); b=statistics.median(res[(k,True)])
    print(dtype, k, "unfused %.4f fused %.4f  ratio %.3f" % (a,b,b/a), "n=%d" % len(res[(k,True)]), flush=True)
