"""Timing probes a router calibrates its cost model with: prefill time by prompt length and decode
step time by batch size, measured on a worker's own engine before it serves."""
from __future__ import annotations

import random
import statistics
import time

from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams


def _prompt(engine: LLMEngine, n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(engine.vocab_size) for _ in range(n)]  # random: no prefix-cache hits


def time_prefill(engine: LLMEngine, num_tokens: int, seed: int = 0) -> float:
    """Seconds to prefill a `num_tokens` prompt, every chunk of it (engine otherwise idle)."""
    assert not engine.has_unfinished(), "profile an idle engine"
    rng = random.Random(seed)
    rid = engine.add_request(_prompt(engine, num_tokens, rng), SamplingParams(max_tokens=1, ignore_eos=True),
                             request_id=f"profile-prefill-{num_tokens}-{seed}")
    t0 = time.perf_counter()
    while not (outs := engine.step()):
        pass
    seconds = time.perf_counter() - t0
    assert outs[0].finished, rid
    return seconds


def time_decode_step(engine: LLMEngine, batch: int, context: int, steps: int = 4, seed: int = 0) -> float:
    """Median seconds of one decode step of `batch` sequences holding about `context` tokens each."""
    assert not engine.has_unfinished(), "profile an idle engine"
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=steps + 2, ignore_eos=True)
    ids = [engine.add_request(_prompt(engine, context, rng), params, request_id=f"profile-decode-{batch}-{i}-{seed}")
           for i in range(batch)]
    try:
        while engine.scheduler.has_prefill_work():
            engine.step()  # prefills
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)
    finally:
        for rid in ids:
            engine.abort(rid)
