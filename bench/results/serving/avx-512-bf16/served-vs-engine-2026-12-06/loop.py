"""The engine alone, closed loop: C in flight, P-token random prompts, O output tokens. Usage: loop.py C N WARM"""
import logging, random, sys, time
import torch
from engine import CacheConfig, EngineConfig, LLMEngine, SamplingParams
logging.basicConfig(level=logging.WARNING)
MODEL = "/root/.cache/pdserve/models/SmolLM2-135M-Instruct"
C, N, W = (int(a) for a in sys.argv[1:4]); P, O = 128, 128
torch.set_num_threads(2)
eng = LLMEngine(EngineConfig(model=MODEL, dtype="bfloat16", num_threads=2, compile=True, linear="auto", max_num_seqs=64,
                             cache=CacheConfig(memory_gib=1.0)))
rng = random.Random(0); sent = 0; done = 0; t0 = None; toks = 0
def add():
    global sent
    eng.add_request([rng.randrange(eng.vocab_size) for _ in range(P)], SamplingParams(max_tokens=O, ignore_eos=True), request_id=f"r{sent}")
    sent += 1
while done < W + N:
    if sent < C: add()  # staggered start: one request a step, as clients drift
    for out in eng.step():
        if out.finished:
            done += 1
            if done == W: t0 = time.perf_counter()
            elif done > W: toks += O
            if sent < W + N + C: add()
dt = time.perf_counter() - t0
print(f"engine alone: {N} requests after {W}: {toks/dt:.1f} output tok/s ({dt:.2f} s)")
s = eng.stats
print(f"decode-only steps {s.decode_steps} mean {s.decode_seconds/max(1,s.decode_steps)*1e3:.2f} ms (decode_seconds over them); prefill steps {s.prefill_steps} mixed {s.mixed_steps} prefill_seconds {s.prefill_seconds:.2f}")
