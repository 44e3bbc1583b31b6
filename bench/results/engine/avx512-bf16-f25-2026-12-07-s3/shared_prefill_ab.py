"""Prefill with q / k / v and gate / up as one product each (new) against five products a layer (old): two engines
in one process, one prompt at a time (max_tokens=1), alternating, 7 rounds. With shared_input_tried.patch applied:
python shared_prefill_ab.py THREADS DTYPE"""
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, '.')
from engine import CacheConfig, EngineConfig, LLMEngine, SamplingParams, packed_linear  # noqa: E402

torch.set_num_threads(int(sys.argv[1]))


def engine():
    return LLMEngine(EngineConfig(model=None, dtype=sys.argv[2], num_threads=torch.get_num_threads(), max_num_seqs=64,
                                  compile=False, cache=CacheConfig(memory_gib=0.5, enable_prefix_caching=False)))


share = packed_linear.share_inputs
packed_linear.share_inputs = lambda layers: 0
engines = {"old": engine()}
packed_linear.share_inputs = share
engines["new"] = engine()
random.seed(0)
res = {}
for n in (200, 2000):
    for r in range(8):
        prompt = [random.randrange(100, 40000) for _ in range(n)]
        for name, e in engines.items():
            t = time.perf_counter()
            e.generate([prompt], SamplingParams(max_tokens=1))
            if r:  # the first round warms up
                res.setdefault((n, name), []).append(time.perf_counter() - t)
for (n, name), ts in sorted(res.items()):
    print(f"prefill {n}: {name} median {statistics.median(ts)*1e3:.1f} ms ({n / statistics.median(ts):.0f} tok/s), "
          f"best {min(ts)*1e3:.1f} ms")
