"""Timing probes a router calibrates its cost model with: prefill time by prompt length and what a cached
prefix adds to it, decode step time by batch size, and a step that prefills a chunk beside a decode batch,
measured on a worker's own engine before it serves."""
from __future__ import annotations

import itertools
import random
import statistics
import time

import torch

from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

_PROBES = itertools.count()  # probes run in this process so far (`_rng`)


def _rng(seed: int) -> random.Random:
    """The random prompts of one probe, from `seed` and this process's probe count: a probe repeated on
    the same engine (a speedup measured in rounds, a second calibration by a router that adopts a live
    worker) draws new prompts, and never times a prefill of the few tokens its prefix cache lacks."""
    return random.Random(f"{seed}:{next(_PROBES)}")


def _prompt(engine: LLMEngine, n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(engine.vocab_size) for _ in range(n)]  # random: no prefix-cache hits


def time_prefill(engine: LLMEngine, num_tokens: int, seed: int = 0) -> float:
    """Seconds to prefill a `num_tokens` prompt, every chunk of it (engine otherwise idle)."""
    assert not engine.has_unfinished(), "profile an idle engine"
    return _timed_prefill(engine, _prompt(engine, num_tokens, _rng(seed)), f"profile-prefill-{num_tokens}-{seed}")


def _timed_prefill(engine: LLMEngine, prompt: list[int], request_id: str) -> float:
    """Seconds to prefill `prompt` to its first token, every chunk of it (engine otherwise idle)."""
    engine.add_request(prompt, SamplingParams(max_tokens=1, ignore_eos=True), request_id=request_id)
    t0 = time.perf_counter()
    while not (outs := engine.step()):
        pass
    seconds = time.perf_counter() - t0
    assert outs[0].finished, request_id
    return seconds


def time_prefill_over(engine: LLMEngine, prefix: int, chunk: int, rounds: int = 3, seed: int = 0) -> float | None:
    """Seconds a prompt token adds per token of cached prefix it attends over: a prompt of `chunk` new tokens
    after `prefix` tokens the prefix cache holds (one prefix, computed once), against `chunk` tokens alone,
    the median of `rounds` pairs timed one right after the other, over `chunk * prefix`. A pair whose prefix
    was not read from the cache (evicted) is left out. None when the engine keeps no prefix cache, the
    prefix is not whole blocks (it would be computed again, not read), or no pair read it."""
    assert not engine.has_unfinished(), "profile an idle engine"
    if not engine.block_manager.enable_prefix_caching or prefix % engine.block_manager.block_size:
        return None
    rng = _rng(seed)

    def prefill(prompt: list[int], name: str) -> tuple[float, int]:
        """Its seconds, and the prompt tokens the engine computed for it."""
        computed = engine.stats.prefill_tokens
        return _timed_prefill(engine, prompt, f"profile-over-{name}-{seed}"), engine.stats.prefill_tokens - computed
    head = _prompt(engine, prefix, rng)
    prefill(head, "head")  # now cached
    slopes = []
    for r in range(rounds):
        (over, computed), (alone, _) = prefill(head + _prompt(engine, chunk, rng), f"over-{r}"), \
            prefill(_prompt(engine, chunk, rng), f"alone-{r}")
        if computed == chunk:  # it read the prefix from the cache
            slopes.append((over - alone) / (chunk * prefix))
    return max(0.0, statistics.median(slopes)) if slopes else None


def _decoding(engine: LLMEngine, batch: int, context: int, steps: int, rng: random.Random, name: str,
              prompts: list[list[int]] | None = None) -> list[str]:
    """Start `batch` sequences of `context` random tokens (or those `prompts`), good for `steps` more decode
    steps, and run their prefills. Returns their ids (the caller aborts them)."""
    assert not engine.has_unfinished(), "profile an idle engine"
    params = SamplingParams(max_tokens=steps + 2, ignore_eos=True)
    prompts = prompts or [_prompt(engine, context, rng) for _ in range(batch)]
    ids = [engine.add_request(prompt, params, request_id=f"profile-{name}-{batch}-{i}")
           for i, prompt in enumerate(prompts)]
    while engine.scheduler.has_prefill_work():
        engine.step()
    return ids


def _abort(engine: LLMEngine, ids: list[str]) -> None:
    for rid in ids:
        engine.abort(rid)


def _median_step_s(engine: LLMEngine, steps: int) -> float:
    """Median seconds of the engine's next `steps` steps."""
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_decode_steps(engine: LLMEngine, batches: list[int], context: int, steps: int = 4,
                      seed: int = 0, repeat: bool = False) -> list[float]:
    """Median seconds of one decode step at each batch size of `batches`, sequences of about `context`
    tokens. One prefill serves every size: the largest batch is started and stepped once untimed (a
    first step pays one-off costs), then timed, then aborted down to each smaller size in turn.
    `repeat`: the prompts of every call with `repeat` and this `seed` (new ones otherwise); once the
    prefix cache holds them, the steps start at once, for a probe timed beside another worker's."""
    sizes = sorted(set(batches), reverse=True)
    rng = random.Random(f"{seed}:repeat") if repeat else _rng(seed)
    ids = _decoding(engine, sizes[0], context, len(sizes) * steps + 1, rng, f"decode-{seed}")
    try:
        engine.step()
        median: dict[int, float] = {}
        for size in sizes:
            _abort(engine, ids[size:])
            del ids[size:]
            median[size] = _median_step_s(engine, steps)
        return [median[b] for b in batches]
    finally:
        _abort(engine, ids)


def time_context_cost(engine: LLMEngine, batch: int, short: int, long: int, rounds: int = 3, steps: int = 8,
                      seed: int = 0) -> float:
    """Seconds a decode step adds per token of context a sequence holds: `batch` sequences of `long` tokens
    against `batch` of `short` (`long` > `short`), the median of `rounds` pairs timed one right after the
    other (the machine's drift between pairs cancels; one pair alone was off by 2x at times). The long
    prompts are the same every round: after the first, the prefix cache holds them."""
    assert long > short, "the long context must be longer"
    rng = _rng(seed)
    prompts = [_prompt(engine, long, rng) for _ in range(batch)]
    slopes = []
    for r in range(rounds):
        pair = []
        for context, given in ((short, None), (long, prompts)):
            ids = _decoding(engine, batch, context, steps + 1, rng, f"context-{context}-{r}-{seed}", given)
            try:
                engine.step()  # a first step pays one-off costs
                pair.append(_median_step_s(engine, steps))
            finally:
                _abort(engine, ids)
        slopes.append((pair[1] - pair[0]) / (batch * (long - short)))
    return statistics.median(slopes)


def time_mixed_step(engine: LLMEngine, batch: int, context: int, chunk: int, steps: int = 3,
                    seed: int = 0) -> tuple[float, int]:
    """Median seconds of one step that prefills a prompt of at most `chunk` tokens (one chunk, as
    many as a step takes beside the batch) beside `batch` decoding sequences of about `context`
    tokens. Returns (seconds, the chunk's tokens)."""
    sched = engine.scheduler
    assert batch < sched.max_num_seqs, "a sequence slot must stay free for the chunk"
    chunk = min(chunk, sched.prefill_chunk_tokens, sched.max_num_batched_tokens - batch)
    assert chunk >= 1, "the step's token budget has no room for a chunk beside the batch"
    rng = _rng(seed)
    ids = _decoding(engine, batch, context, steps, rng, f"mixed-{seed}")
    try:
        times = []
        for i in range(steps):
            rid = engine.add_request(_prompt(engine, chunk, rng), SamplingParams(max_tokens=1, ignore_eos=True),
                                     request_id=f"profile-chunk-{chunk}-{i}-{seed}")
            ids.append(rid)
            t0 = time.perf_counter()
            outs = engine.step()
            times.append(time.perf_counter() - t0)
            assert any(o.request_id == rid for o in outs), "the chunk did not fit one step"
        return statistics.median(times), chunk
    finally:
        _abort(engine, ids)


def time_threads_speedup(engine: LLMEngine, threads: int, rounds: int = 3, batch: int = 8, context: int = 16,
                         prompt_tokens: int = 512) -> tuple[float, float]:
    """How much faster the engine computes with `threads` torch threads than with its current count,
    (decode, prefill) apart: a decode step of `batch` sequences and a prefill of `prompt_tokens`, each
    timed with the current count over with `threads`; the medians of `rounds` interleaved pairs, after
    a warm-up of each (the current count is restored; call after the engine's decode step is ready for
    both counts)."""
    def work(n: int) -> tuple[float, float]:
        torch.set_num_threads(n)
        return time_decode_steps(engine, [batch], context)[0], time_prefill(engine, prompt_tokens)

    own = torch.get_num_threads()
    try:
        work(own), work(threads)  # one-off costs (new shapes, thread pools) stay out of the ratios
        pairs = [(work(own), work(threads)) for _ in range(rounds)]
    finally:
        torch.set_num_threads(own)
    return (statistics.median(slow[0] / fast[0] for slow, fast in pairs),
            statistics.median(slow[1] / fast[1] for slow, fast in pairs))
