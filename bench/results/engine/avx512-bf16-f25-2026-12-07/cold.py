import time, torch, sys, os
sys.path.insert(0, '.')
from engine import CacheConfig, EngineConfig, LLMEngine
torch.set_num_threads(int(sys.argv[1]))
t0 = time.perf_counter()
eng = LLMEngine(EngineConfig(model=None, dtype=sys.argv[2], num_threads=int(sys.argv[1]), max_num_seqs=64, compile=True,
                             cache=CacheConfig(memory_gib=0.5, enable_prefix_caching=False)))
print(f"ONE_GRAPH={os.environ.get('ONE_GRAPH')} threads {sys.argv[1]} {sys.argv[2]}: engine up in {time.perf_counter() - t0:.1f} s, compiled {eng.runner.compiled}", flush=True)
t0 = time.perf_counter()
eng.runner.prepare_threads(2 * int(sys.argv[1]))
print(f"  then {2 * int(sys.argv[1])} threads in {time.perf_counter() - t0:.1f} s", flush=True)
