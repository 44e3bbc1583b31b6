"""A wave of W prompts (S cached tokens + N new each) arriving at one engine while R sequences decode: each prompt's
TTFT, in-process. Usage: wave.py W N S R"""
import logging, random, sys, time, statistics
import torch
from engine import CacheConfig, EngineConfig, LLMEngine, SamplingParams
logging.basicConfig(level=logging.WARNING)
MODEL = "/root/.cache/pdserve/models/SmolLM2-135M-Instruct"
W, N, S, R = (int(a) for a in sys.argv[1:5])
torch.set_num_threads(2)
eng = LLMEngine(EngineConfig(model=MODEL, dtype="bfloat16", num_threads=2, compile=True, linear="auto", max_num_seqs=64,
                             cache=CacheConfig(memory_gib=2.0)))
rng = random.Random(0)
V = eng.vocab_size
def run_wave(rep):
    hist = [[rng.randrange(V) for _ in range(S)] for _ in range(W)]
    for i, h in enumerate(hist):  # cache each history
        eng.add_request(h, SamplingParams(max_tokens=1, ignore_eos=True), request_id=f"h{rep}-{i}")
        while eng.has_unfinished(): eng.step()
    for i in range(R):
        eng.add_request([rng.randrange(V) for _ in range(S)], SamplingParams(max_tokens=10000, ignore_eos=True), request_id=f"d{rep}-{i}")
    while eng.scheduler.has_prefill_work(): eng.step()
    for _ in range(3): eng.step()
    t0 = time.perf_counter(); ttft = {}
    for i, h in enumerate(hist):
        eng.add_request(h + [rng.randrange(V) for _ in range(N)], SamplingParams(max_tokens=2, ignore_eos=True), request_id=f"w{rep}-{i}")
    steps = 0
    while len(ttft) < W:
        outs = eng.step(); steps += 1
        now = time.perf_counter() - t0
        for o in outs:
            if o.request_id.startswith("w") and o.request_id not in ttft: ttft[o.request_id] = now
    for i in range(R): eng.abort(f"d{rep}-{i}")
    while eng.has_unfinished(): eng.step()
    v = sorted(ttft.values())
    return v, steps
for rep in range(3):
    v, steps = run_wave(rep)
    print(f"rep {rep}: steps {steps} ttft " + " ".join(f"{x:.3f}" for x in v) + f" | p50 {statistics.median(v):.3f} last {v[-1]:.3f}", flush=True)
