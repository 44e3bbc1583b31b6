"""Batch-12 decode step beside an in-process Python thread (0.2 ms busy of every 2 ms), per switch interval."""
import logging, sys, time, statistics, threading
import torch
sys.path.insert(0, "/work/main")
from engine import CacheConfig, EngineConfig, LLMEngine
from engine.profiling import time_decode_steps
logging.basicConfig(level=logging.WARNING)
MODEL = "/root/.cache/pdserve/models/SmolLM2-135M-Instruct"
def pyspin(stop, busy=0.0002, period=0.002):
    while not stop.is_set():
        t = time.perf_counter()
        while time.perf_counter() - t < busy: pass
        time.sleep(period - busy)
torch.set_num_threads(2)
eng = LLMEngine(EngineConfig(model=MODEL, dtype="bfloat16", num_threads=2, compile=True, linear="auto", max_num_seqs=64,
                             cache=CacheConfig(memory_gib=1.0)))
time_decode_steps(eng, [12], 200, steps=6, seed=99)
res = {}
for r in range(int(sys.argv[1])):
    for mode in ("quiet", "py5ms", "py0.5ms", "py0.1ms"):
        stop = threading.Event(); p = None
        sys.setswitchinterval({"py0.5ms": 0.0005, "py0.1ms": 0.0001}.get(mode, 0.005))
        if mode != "quiet":
            p = threading.Thread(target=pyspin, args=(stop,)); p.start(); time.sleep(0.2)
        t = time_decode_steps(eng, [12], 200, steps=20, seed=r)[0]
        if p: stop.set(); p.join()
        res.setdefault(mode, []).append(t * 1e3)
for m, v in res.items():
    print(m, " ".join(f"{x:.2f}" for x in v), "median", f"{statistics.median(v):.2f}", flush=True)
