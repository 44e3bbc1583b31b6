"""Decode step at batch 12 / ctx 200, quiet and beside a spinner (1 ms busy of every 10). Usage: python noise.py ROUNDS"""
import logging, multiprocessing as mp, sys, time, statistics
import torch
from engine import CacheConfig, EngineConfig, LLMEngine
from engine.profiling import time_decode_steps
logging.basicConfig(level=logging.WARNING)
MODEL = "/root/.cache/pdserve/models/SmolLM2-135M-Instruct"

def spin(stop, busy=0.001, period=0.010):
    while not stop.is_set():
        t = time.perf_counter()
        while time.perf_counter() - t < busy: pass
        time.sleep(period - busy)

if __name__ == "__main__":
    torch.set_num_threads(2)
    eng = LLMEngine(EngineConfig(model=MODEL, dtype="bfloat16", num_threads=2, compile=True, linear="auto", max_num_seqs=64,
                                 cache=CacheConfig(memory_gib=1.0)))
    time_decode_steps(eng, [12], 200, steps=6, seed=99)
    import threading
    def pyspin(stop, busy=0.0002, period=0.002):
        while not stop.is_set():
            t = time.perf_counter()
            while time.perf_counter() - t < busy: pass
            time.sleep(period - busy)
    res = {"quiet": [], "spin": [], "pythread": []}
    for r in range(int(sys.argv[1])):
        for mode in ("quiet", "spin", "pythread"):
            stop = mp.Event(); p = None
            if mode == "pythread":
                p = threading.Thread(target=pyspin, args=(stop,)); p.start(); time.sleep(0.2)
            if mode == "spin":
                p = mp.Process(target=spin, args=(stop,)); p.start(); time.sleep(0.2)
            t = time_decode_steps(eng, [12], 200, steps=20, seed=r)[0]
            if p: stop.set(); p.join()
            res[mode].append(t * 1e3)
    for m, v in res.items():
        print(m, " ".join(f"{x:.2f}" for x in v), "median", f"{statistics.median(v):.2f}", flush=True)
