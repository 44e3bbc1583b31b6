import time, torch, logging, random, statistics, sys
from engine import CacheConfig, EngineConfig, LLMEngine, SamplingParams
logging.basicConfig(level=logging.WARNING)
torch.set_num_threads(2)
eng = LLMEngine(EngineConfig(model="/root/.cache/pdserve/models/SmolLM2-135M-Instruct", dtype="bfloat16", num_threads=2, compile=True, linear="auto", max_num_seqs=64, cache=CacheConfig(memory_gib=2.0)))
rng = random.Random(0)
def run(prompt):
    eng.add_request(prompt, SamplingParams(max_tokens=1, ignore_eos=True), request_id=str(rng.random()))
    t = time.perf_counter()
    while eng.has_unfinished(): eng.step()
    return time.perf_counter() - t
res = {"72/1400": [], "216/1400": [], "2000/0": []}
for rep in range(4):
    h = [rng.randrange(1000, 40000) for _ in range(1400)]
    run(h)
    res["72/1400"].append(run(h + [rng.randrange(1000, 40000) for _ in range(72)]))
    res["216/1400"].append(run(h + [rng.randrange(1000, 40000) for _ in range(216)]))
    res["2000/0"].append(run([rng.randrange(1000, 40000) for _ in range(2000)]))
print(sys.argv[1], {k: round(statistics.median(v), 4) for k, v in res.items()}, flush=True)
