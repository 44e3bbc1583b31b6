"""Measures the cost model on the actual workers at start-up, before serving.

1. Prefill time by prompt length on a prefill worker, and on a decode worker (local prefill); on the
   decode worker, what a cached prefix adds to a prompt computed over it (its attention reads it).
2. Decode step time by batch size on a decode worker, what a longer context adds to a decode step,
   and what a decode batch adds to a step that prefills a chunk beside it. Each worker's probes run
   while the other is idle: steps 1 and 2 time each worker alone, step 4 what they do to each other
   (a prefill worker's fit timed beside the decode worker's probes priced prompts 15-22% above their
   time alone, and a cost model that multiplied them by step 4's factor as well priced that twice).
3. KV transfer time by size between a prefill and a decode worker, over the configured backend.
4. What each of the two computes slower while the other computes too (they share a node's memory
   bandwidth and caches; on separate devices, nothing): decode steps during prompts, prompts during
   decode steps, the decode batch holding the long context of step 2, as served sequences do.
5. The extra round trips of the remote path (actor call latency).
Each probe runs on an idle worker and leaves every block free. The first call of each kind is
a warm-up and is not counted. Each measurement reports its start (`engine.progress.Steps`: i of n,
seconds so far, an estimate of the time left).
"""
from __future__ import annotations

import asyncio
import logging
import statistics
import time
import uuid
from collections.abc import Callable

import ray

from engine import SamplingParams
from engine.progress import Steps
from kv_transfer import TransferState
from router.cost_model import CostModel, LinearFit
from router.pools import Pools
from worker_core.protocol import WorkerInfo

log = logging.getLogger(__name__)


def _lengths(max_model_len: int, num_blocks: int, block_size: int) -> list[int]:
    cap = min(max_model_len - 2, num_blocks * block_size // 2)
    return sorted({max(1, min(n, cap)) for n in (16, 128, 512)})


async def _prefill_fit(worker: ray.actor.ActorHandle, lengths: list[int]) -> LinearFit:
    times = await worker.profile_prefill.remote([lengths[0]] + lengths)
    return LinearFit.fit(lengths, times[1:])


async def _transfer_fit(prefill: ray.actor.ActorHandle, decode: ray.actor.ActorHandle, pools: Pools,
                        info: WorkerInfo, lengths: list[int]) -> LinearFit:
    sizes, times = [], []
    for n in [lengths[0]] + lengths:
        rid = f"calibrate-transfer-{uuid.uuid4().hex[:8]}"
        prompt = [1] * n
        await decode.reserve.remote(rid, prompt, SamplingParams(max_tokens=1), pools.prefill_peers[0])
        try:
            seconds = await prefill.probe_transfer.remote(rid, prompt, pools.decode_peers[0])
            while await decode.transfer_state.remote(rid) != TransferState.DONE:
                await asyncio.sleep(0.001)
        finally:
            await decode.abort.remote(rid)
        blocks = -(-n // info.block_size)
        sizes.append(blocks * info.block_size * info.kv_bytes_per_token)
        times.append(seconds)
    return LinearFit.fit(sizes[1:], times[1:])


async def _decode_ride(worker: ray.actor.ActorHandle, prefill: LinearFit, steps: dict[int, float], context: int,
                       chunk: int, max_num_seqs: int) -> float:
    """What the largest measured decode batch that leaves a sequence slot free adds to a step that
    prefills a chunk of up to `chunk` tokens beside it, as a fraction of its own decode step (in [0, 1];
    1 where no slot is left: a worker of one sequence never mixes)."""
    batch = max((b for b in steps if b < max_num_seqs), default=None)
    if batch is None:
        return 1.0
    mixed, tokens = await worker.profile_mixed.remote(batch, context, chunk)
    return min(1.0, max(0.0, (mixed - prefill(tokens)) / steps[batch]))


async def _context_s(worker: ray.actor.ActorHandle, steps: dict[int, float], context: int, long: int,
                     pool_tokens: int) -> float:
    """Seconds a decode step adds per token of context beyond `context` per sequence, between `context` and
    `long` tokens, on a batch of 4 (or the largest measured batch below it whose KV fits half the pool;
    0 when `long` is no longer than `context`)."""
    fitting = [b for b in steps if b <= 4 and b * long <= pool_tokens // 2]
    if long <= context or not fitting:
        return 0.0
    return max(0.0, await worker.profile_context.remote(max(fitting), context, long))


async def _neighbours(prefill: ray.actor.ActorHandle, decode: ray.actor.ActorHandle, steps: dict[int, float],
                      context: int, length: int, max_model_len: int, pool_tokens: int) -> tuple[float, float]:
    """What a decode worker's steps and a prefill worker's prompts take while the other computes, over
    what they take alone (each >= 1). Two prompts of `length` tokens on the prefill worker alone, and
    decode steps (a batch of 4, or the largest measured below it whose KV fits half the pool) of
    sequences holding `context` tokens alone; those steps inside two such prompts; then two prompts
    inside a run of those steps that outlasts them. The decode probes draw the same prompts each time:
    after the first, the prefix cache holds them and each starts stepping at once, beside the prompts
    (with new prompts each, the decode worker spent the first prompts' time prefilling its own)."""
    batch = max((b for b in steps if b <= 4 and b * context <= pool_tokens // 2), default=min(steps))
    alone = await prefill.profile_prefill.remote([length] * 2)  # each probe draws prompts of its own
    (step_s,) = await decode.profile_decode.remote([batch], context, repeat=True)
    prompt_s = statistics.median(alone)
    room = max_model_len - context - 4  # a decode sequence's steps end before its context fills the model

    def run(seconds: float) -> int:
        return max(4, min(room, int(seconds / step_s)))
    _, (beside_prompts,) = await asyncio.gather(prefill.profile_prefill.remote([length] * 2),
                                                decode.profile_decode.remote([batch], context, run(1.2 * prompt_s),
                                                                             repeat=True))
    prompts, _ = await asyncio.gather(prefill.profile_prefill.remote([length] * 2),
                                      decode.profile_decode.remote([batch], context, run(2.6 * prompt_s) + 8,
                                                                   repeat=True))
    return max(1.0, beside_prompts / step_s), max(1.0, statistics.median(prompts) / prompt_s)


def _over_prefix(lengths: list[int], info: WorkerInfo) -> tuple[int, int]:
    """The probe of a prompt over a cached prefix: (its new tokens, the prefix): the second prompt length
    over the longest, in whole blocks, the two within the model's context and half the KV pool."""
    chunk = lengths[1] if len(lengths) > 1 else lengths[0]
    room = min(info.max_model_len - 2, info.num_blocks * info.block_size // 2) - chunk
    prefix = min(lengths[-1], max(0, room))
    return chunk, prefix - prefix % info.block_size


async def _prefill_context_s(worker: ray.actor.ActorHandle, prefix: int, chunk: int) -> float:
    """Seconds a prompt token adds per token of cached prefix it attends over (`chunk` tokens over `prefix`);
    0 without a prefix cache, or a prefix shorter than a block (nothing to measure: none is ever read)."""
    if prefix < 1:
        return 0.0
    seconds = await worker.profile_prefill_over.remote(prefix, chunk)
    return 0.0 if seconds is None else seconds


async def _round_trip_s(worker: ray.actor.ActorHandle) -> float:
    rtts = []
    for _ in range(6):
        t0 = time.perf_counter()
        await worker.load.remote()
        rtts.append(time.perf_counter() - t0)
    return statistics.median(rtts[1:])


async def calibrate(pools: Pools, info: WorkerInfo, report: Callable[[str], None] | None = None) -> CostModel:
    """Measure the cost model on pools' first prefill and first decode worker.

    Args:
        pools: live workers (at least one decode worker).
        info: a decode worker's `info()` (KV geometry and limits).
        report: receives a line as each measurement starts (default: this module's log, at INFO).
    Returns:
        The fitted cost model. Without prefill workers, remote costs are copied from local ones.
    """
    t0 = time.perf_counter()
    decode = pools.decode[0]
    lengths = _lengths(info.max_model_len, info.num_blocks, info.block_size)
    batches = sorted({b for b in (1, 4, 16, 32) if b <= info.max_num_seqs} | {1})
    context = min(64, lengths[-1])
    progress = Steps("calibrating", 9 if pools.prefill else 6, report or log.info)
    sizes = f"{len(lengths)} prompt lengths ({', '.join(map(str, lengths))} tokens)"

    async def decode_side() -> tuple[LinearFit, tuple[tuple[int, float], ...], float, float, float, float]:
        progress.step(f"prefill on the decode worker: {sizes}")
        local = await _prefill_fit(decode, lengths)
        chunk, prefix = _over_prefix(lengths, info)
        progress.step(f"prompts of {chunk} tokens over a cached prefix of {prefix}")
        over = await _prefill_context_s(decode, prefix, chunk)
        progress.step(f"decode steps at {len(batches)} batch sizes ({', '.join(map(str, batches))})")
        steps = tuple(zip(batches, await decode.profile_decode.remote(batches, context)))
        progress.step(f"decode steps at {context} and at {lengths[-1]} tokens of context (3 pairs)")
        per_context = await _context_s(decode, dict(steps), context, lengths[-1], info.num_blocks * info.block_size)
        progress.step("a prefill chunk beside a decode batch")
        ride = await _decode_ride(decode, local, dict(steps), context, min(info.prefill_chunk_tokens, lengths[-1]),
                                  info.max_num_seqs)
        progress.step("the round trip of an actor call (6 calls)")
        return local, steps, ride, await _round_trip_s(decode), per_context, over

    async def prefill_side() -> LinearFit:
        progress.step(f"prefill on the prefill worker: {sizes}")
        return await _prefill_fit(pools.prefill[0], lengths)

    if pools.prefill:  # each worker's own probes alone, then the transfer between them
        local, steps, ride, rtt, per_context, over = await decode_side()
        prefill = await prefill_side()
        progress.step(f"KV transfer at {len(lengths)} sizes")
        transfer = await _transfer_fit(pools.prefill[0], decode, pools, info, lengths)
        chunk = min(info.prefill_chunk_tokens, lengths[-1])  # the prompt steps a loaded prefill worker runs
        long = lengths[-1]  # the context of the decode steps beside the prompts
        progress.step(f"decode steps at {long} tokens of context during prompts of {chunk} tokens on the "
                      "prefill worker, and back")
        beside = await _neighbours(pools.prefill[0], decode, dict(steps), long, chunk, info.max_model_len,
                                   info.num_blocks * info.block_size)
    else:
        local, steps, ride, rtt, per_context, over = await decode_side()
        prefill, transfer, beside = local, LinearFit(0.0, 0.0), (1.0, 1.0)
    cost = CostModel(prefill=prefill, local_prefill=local, decode_step=steps, transfer=transfer,
                     kv_bytes_per_token=info.kv_bytes_per_token, num_layers=info.num_layers, hop_s=3 * rtt,
                     prefill_chunk_tokens=info.prefill_chunk_tokens, decode_ride=ride, decode_context=context,
                     decode_context_s=per_context, prefill_context_s=over, decode_beside_prefill=beside[0],
                     prefill_beside_decode=beside[1])
    log.info("calibrated in %.1f s: %s", time.perf_counter() - t0, cost.to_dict())
    return cost
