"""Decode step time: context 64 vs 512, alone vs beside a Python thread (bursty / spinning)."""
import sys, threading, time, logging, torch
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[5]))
torch.set_num_threads(1)
from engine import CacheConfig, EngineConfig, LLMEngine
from engine.model_loader import load_model
from engine.profiling import time_decode_steps
model, _ = load_model(None, "float32", "cpu")
eng = LLMEngine(EngineConfig(dtype="float32", compile=True, cache=CacheConfig(memory_gib=0.5)), model=model)
stop = threading.Event()
def bursty():
    while not stop.is_set():
        t = time.perf_counter()
        while time.perf_counter() - t < 0.0003:
            sum(range(100))
        time.sleep(0.002)
def spin():
    while not stop.is_set():
        sum(range(100))
for ctx in (64, 512):
    for mode, fn in (("alone", None), ("bursty", bursty), ("spin", spin)):
        stop.clear()
        th = threading.Thread(target=fn, daemon=True) if fn else None
        if th: th.start()
        r = time_decode_steps(eng, [1, 4, 16], ctx, steps=6)
        stop.set()
        if th: th.join()
        print(f"ctx {ctx:4d} {mode:7s} " + "  ".join(f"b{b}={s*1e3:6.1f}ms" for b, s in zip([1, 4, 16], r)), flush=True)
