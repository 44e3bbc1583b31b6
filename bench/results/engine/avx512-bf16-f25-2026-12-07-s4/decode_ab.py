import time, torch, logging, random, statistics, sys
from engine import CacheConfig, EngineConfig, LLMEngine, SamplingParams
import engine.fused_layers as fl, engine.llm_engine as le
if sys.argv[1] == "off": le.fused_layers.fuse = lambda m: 0
logging.basicConfig(level=logging.WARNING)
torch.set_num_threads(2)
eng = LLMEngine(EngineConfig(model="/root/.cache/pdserve/models/SmolLM2-135M-Instruct", dtype="bfloat16", num_threads=2, compile=True, linear="auto", max_num_seqs=64, cache=CacheConfig(memory_gib=2.0)))
print(sys.argv[1], "fused modules", sum(isinstance(m,(fl.FusedRMSNorm, fl.FusedGatedMLP)) for m in eng.runner.model.modules()), "compiled", eng.runner.compiled)
rng = random.Random(0)
for B in (1, 32):
    for i in range(B):
        eng.add_request([rng.randrange(1000, 40000) for _ in range(200)], SamplingParams(max_tokens=100, ignore_eos=True), request_id=f"{B}-{i}")
    ts=[]
    while eng.has_unfinished():
        t=time.perf_counter(); eng.step(); ts.append(time.perf_counter()-t)
    dec = ts[-90:]
    print(sys.argv[1], "B", B, "decode step median %.2f ms" % (statistics.median(dec)*1e3), flush=True)
