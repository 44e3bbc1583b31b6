"""Prefill 1024 tokens with T threads in one process while another process decodes batch 2 with 1 thread."""
import logging, multiprocessing as mp, sys, time, statistics
sys.path.insert(0, "/work/main")
logging.basicConfig(level=logging.WARNING)
MODEL = "/root/.cache/pdserve/models/SmolLM2-135M-Instruct"

def make(threads):
    import torch
    from engine import CacheConfig, EngineConfig, LLMEngine
    torch.set_num_threads(threads)
    return LLMEngine(EngineConfig(model=MODEL, dtype="bfloat16", num_threads=threads, compile=True, linear="auto",
                                  max_num_seqs=64, cache=CacheConfig(memory_gib=1.0)))

def decoder(stop, ready, out):
    from engine.profiling import time_decode_steps
    eng = make(1)
    time_decode_steps(eng, [2], 200, steps=4, seed=1)
    ready.set()
    ts = []
    while not stop.is_set():
        ts.append(time_decode_steps(eng, [2], 200, steps=10, seed=2)[0])
    out.put(statistics.median(ts) * 1e3)

if __name__ == "__main__":
    from engine.profiling import time_prefill
    for threads in (1, 2, 1, 2):
        eng = make(threads)
        time_prefill(eng, 1024, seed=0)
        alone = statistics.median(time_prefill(eng, 1024, seed=i) for i in range(2))
        stop, ready, out = mp.Event(), mp.Event(), mp.Queue()
        p = mp.Process(target=decoder, args=(stop, ready, out)); p.start(); ready.wait()
        busy = statistics.median(time_prefill(eng, 1024, seed=i) for i in range(3))
        stop.set(); step = out.get(); p.join()
        print(f"prefill threads {threads}: alone {alone:.2f} s, beside a 1-thread decoder {busy:.2f} s; decoder step {step:.1f} ms", flush=True)
