"""A cold start of the compiled decode step: the first pair of graphs, then the 1-thread pair."""
import time, torch, sys, logging
sys.path.insert(0, '.')  # run from the repository root
logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
from engine import CacheConfig, EngineConfig, LLMEngine
torch.set_num_threads(2)
t=time.perf_counter()
eng = LLMEngine(EngineConfig(model=None, dtype="auto", num_threads=2, max_num_seqs=64, compile=True,
                             cache=CacheConfig(memory_gib=0.5, enable_prefix_caching=False)))
print("engine up in", time.perf_counter()-t)
t=time.perf_counter()
eng.runner.prepare_threads(1)
print("1-thread graphs in", time.perf_counter()-t)
