"""Decode step time vs context (is the batch-only decode step missing a context term?). Usage: python this.py THREADS"""
import logging, sys, time
import torch
from engine import CacheConfig, EngineConfig, LLMEngine
from engine.profiling import time_decode_steps
logging.basicConfig(level=logging.WARNING)
MODEL = "/root/.cache/pdserve/models/SmolLM2-135M-Instruct"
T = int(sys.argv[1])
torch.set_num_threads(T)
eng = LLMEngine(EngineConfig(model=MODEL, dtype="bfloat16", num_threads=T, compile=True, linear="auto", max_num_seqs=64,
                             cache=CacheConfig(memory_gib=1.0)))
for rep in range(2):
    for ctx in (64, 256, 1024, 2000):
        r = time_decode_steps(eng, [1, 2, 4, 8], ctx, steps=6, seed=rep * 10 + ctx)
        print(f"threads {T} ctx {ctx}: " + "  ".join(f"b{b} {t*1e3:.2f}" for b, t in zip([1, 2, 4, 8], r)), flush=True)
