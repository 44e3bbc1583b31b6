"""Engine steps at batch B, context C: a run on a fresh pool, then runs after earlier ones have scattered it.
Usage: python this.py B C small,huge (small: PDSERVE_HUGE_PAGES=0)."""
import logging, os, random, statistics, sys, time
import torch
from engine import CacheConfig, EngineConfig, LLMEngine, SamplingParams
logging.basicConfig(level=logging.WARNING)
MODEL = "/root/.cache/pdserve/models/SmolLM2-135M-Instruct"
torch.set_num_threads(2)
B = int(sys.argv[1]); ctx = int(sys.argv[2])
engines = {}
for name in sys.argv[3].split(","):
    os.environ["PDSERVE_HUGE_PAGES"] = "0" if name.startswith("small") else "1"
    cfg = EngineConfig(model=MODEL, dtype="bfloat16", num_threads=2, compile=True, linear="auto", max_num_seqs=64,
                   cache=CacheConfig(memory_gib=0.25, enable_prefix_caching=False))
    engines[name] = LLMEngine(cfg)
rng = random.Random(0); V = engines[name].vocab_size
def run(eng, n, ctx, new, measure):
    ids = [eng.add_request([rng.randrange(100, V) for _ in range(ctx)], SamplingParams(max_tokens=new, ignore_eos=True)) for _ in range(n)]
    while eng.scheduler.has_prefill_work(): eng.step()
    ts = []
    while eng.has_unfinished():
        t0 = time.perf_counter(); eng.step(); ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3
for rep in range(3):
    for name, eng in engines.items():
        print(rep, name, "fresh-order step ms" if rep == 0 else "after runs step ms", f"{run(eng, B, ctx, 128, True):.1f}", flush=True)
