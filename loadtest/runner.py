"""Drives a client through a workload: open loop (Poisson or, with a burstiness other than 1, gamma arrivals
at a rate; a sweep of rates), closed loop (fixed concurrency), or conversations (multi-turn: each sends its
turns in order); and the warm-up requests sent before a measured run (`warm_up`). A run ends when
every request is done or at max_duration_s: then no new request starts and the ones in flight are
cancelled and recorded with error kind "cancelled".
"""
from __future__ import annotations

import asyncio
import math
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from tqdm import tqdm

from loadtest import records as R
from loadtest.clients import Client
from loadtest.records import RequestRecord
from loadtest.workload import RequestSpec, with_replies


@dataclass
class RunResult:
    """One run. config: mode ("open" | "closed" | "conversations"), rate, burstiness (open loop and
    conversations), concurrency, num_requests (planned), sent, seed, max_duration_s, stopped_by_max_duration. wall_time_s: from the run's start until its last request ended.
    records: one per request sent, in workload order."""

    config: dict[str, Any]
    records: list[RequestRecord] = field(default_factory=list)
    wall_time_s: float = 0.0


def gamma_arrivals(rate: float, n: int, seed: int = 0, burstiness: float = 1.0) -> list[float]:
    """Send times of a renewal process: the first at 0, then gaps drawn from a gamma distribution of shape
    `burstiness` and mean 1/rate (scale 1 / (rate * burstiness)), seeded. Burstiness 1 is the Poisson
    process (exponential gaps: exactly `random.Random(seed).expovariate(rate)` draws); below 1 the gaps
    vary more (bursts and lulls), above 1 less; inf gives constant gaps of 1/rate.

    Args: rate: requests per second (> 0; inf sends all at once). n: how many. burstiness: > 0 (inf allowed).
    Returns: n sorted times (s). Raises: ValueError naming a bad rate or burstiness.
    """
    if not rate > 0:
        raise ValueError(f"rate must be > 0 requests/s (or inf), got {rate}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0 (1: Poisson; < 1 burstier; > 1 more uniform), got {burstiness}")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    times, t = [], 0.0
    for _ in range(n):
        times.append(t)
        if burstiness == 1.0:
            t += rng.expovariate(rate)  # the Poisson draw
        elif math.isinf(burstiness):
            t += 1.0 / rate
        else:
            t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return times


def poisson_arrivals(rate: float, n: int, seed: int = 0) -> list[float]:
    """Send times of a Poisson process: the first at 0, then exponential gaps of mean 1/rate, seeded
    (`gamma_arrivals` with burstiness 1).

    Args: rate: requests per second (> 0; inf sends all at once). n: how many. Returns: n sorted times (s).
    """
    return gamma_arrivals(rate, n, seed)


class _Tracker:
    """Launches request tasks, timestamps them against the run's start, and counts progress."""

    def __init__(self, client: Client, total: int, desc: str, progress: bool,
                 on_record: Callable[[RequestRecord], None] | None = None) -> None:
        self.client, self.on_record = client, on_record
        self.t0 = time.perf_counter()
        self.records: list[RequestRecord] = []
        self.inflight: set[asyncio.Task] = set()
        self.errors = 0
        self.stopping = False
        self.bar = tqdm(total=total, desc=desc, unit="req", disable=not progress, file=sys.stderr,
                        dynamic_ncols=True)

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def launch(self, spec: RequestSpec, scheduled_s: float) -> asyncio.Task:
        task = asyncio.create_task(self._one(spec, scheduled_s))
        self.inflight.add(task)
        task.add_done_callback(self.inflight.discard)
        return task

    async def _one(self, spec: RequestSpec, scheduled_s: float) -> RequestRecord:
        start = self.now()
        try:
            rec = await self.client.send(spec)
        except asyncio.CancelledError:  # only the runner cancels these tasks: at max_duration
            rec = RequestRecord(spec.index, spec.prompt_tokens, spec.output_tokens)
            rec.fail(R.CANCELLED, "the run's max duration ended while the request was in flight")
        rec.start_s, rec.scheduled_s = start, scheduled_s
        rec.conversation, rec.turn = spec.conversation, spec.turn
        self.records.append(rec)
        if self.on_record is not None:
            self.on_record(rec)
        self.errors += not rec.ok
        self.bar.update(1)
        self.bar.set_postfix(errors=self.errors, refresh=False)
        return rec

    async def cancel_inflight(self) -> None:
        self.stopping = True
        tasks = list(self.inflight)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def result(self, config: dict[str, Any], stopped: bool) -> RunResult:
        self.bar.close()
        wall = self.now()
        recs = sorted(self.records, key=lambda r: r.index)
        return RunResult({**config, "sent": len(recs), "stopped_by_max_duration": stopped}, recs, wall)


async def run_open_loop(client: Client, specs: list[RequestSpec], rate: float, seed: int = 0,
                        max_duration_s: float = math.inf, progress: bool = True,
                        burstiness: float = 1.0, on_record: Callable[[RequestRecord], None] | None = None) -> RunResult:
    """Sends specs at the arrival times `gamma_arrivals(rate, len(specs), seed, burstiness)` (Poisson for
    burstiness 1), never waiting for responses; `progress`: a bar on stderr; `on_record`: called with each
    request's record as it ends. Returns: the run's result."""
    arrivals = gamma_arrivals(rate, len(specs), seed, burstiness)
    tr = _Tracker(client, len(specs), f"rate {rate:g}/s", progress, on_record)
    stopped = False
    for spec, at in zip(specs, arrivals):
        if at >= max_duration_s:
            stopped = True
            break
        delay = at - tr.now()
        if delay > 0:
            await asyncio.sleep(delay)
        tr.launch(spec, at)
    if tr.inflight:
        _, pending = await asyncio.wait(set(tr.inflight), timeout=_left(tr, max_duration_s))
        if pending:
            stopped = True
            await tr.cancel_inflight()
    config = {"mode": "open", "rate": rate, "burstiness": burstiness, "concurrency": None,
              "num_requests": len(specs), "seed": seed, "max_duration_s": max_duration_s}
    return tr.result(config, stopped)


async def run_closed_loop(client: Client, specs: list[RequestSpec], concurrency: int,
                          max_duration_s: float = math.inf, progress: bool = True) -> RunResult:
    """Keeps `concurrency` requests in flight: each worker sends its next spec when its last one ends.
    Returns: the run's result."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    tr = _Tracker(client, len(specs), f"concurrency {concurrency}", progress)
    queue = iter(specs)

    async def worker() -> None:
        for spec in queue:
            if tr.stopping or tr.now() >= max_duration_s:
                return
            await tr.launch(spec, tr.now())

    workers = [asyncio.create_task(worker()) for _ in range(min(concurrency, len(specs)))]
    _, pending = await asyncio.wait(workers, timeout=_left(tr, max_duration_s))
    stopped = bool(pending)
    if pending:
        await tr.cancel_inflight()
        await asyncio.gather(*workers, return_exceptions=True)
    stopped = stopped or len(tr.records) < len(specs)
    config = {"mode": "closed", "rate": None, "concurrency": concurrency, "num_requests": len(specs), "seed": None,
              "max_duration_s": max_duration_s}
    return tr.result(config, stopped)


STAND_IN, ANSWERED = "stand-in", "answered"
REPLIES = (STAND_IN, ANSWERED)


async def run_conversations(client: Client, specs: list[RequestSpec], rate: float, think_s: float = 0.0,
                            seed: int = 0, max_duration_s: float = math.inf, progress: bool = True,
                            burstiness: float = 1.0, replies: str = STAND_IN) -> RunResult:
    """Multi-turn: conversations start at the arrival times `gamma_arrivals(rate, conversations, seed,
    burstiness)` (`rate` conversations/s, Poisson for burstiness 1; inf: all at once),
    and each sends its turns in order, the next one `think_s` after the last one ended (also after a failed
    turn). Specs without a conversation run as conversations of one turn.
    replies: STAND_IN, each history holds the workload's stand-in replies (every server gets the same
    prompts); ANSWERED, each turn's answer replaces its stand-in in the later turns (`with_replies`), as
    a chat client sends them: the output is kept (`RequestSpec.keep_output`), and where a turn failed or
    the server gave no token ids for a token-id prompt its stand-in stays (counted in the config as
    `stand_in_replies`). Returns: the run's result."""
    if think_s < 0:
        raise ValueError(f"think time must be >= 0 s, got {think_s}")
    if replies not in REPLIES:
        raise ValueError(f"replies must be one of {', '.join(REPLIES)}, got {replies!r}")
    answered = replies == ANSWERED
    stand_ins = 0
    conversations: dict[object, list[RequestSpec]] = {}
    for spec in specs:
        key = spec.conversation if spec.conversation is not None else ("single", spec.index)
        conversations.setdefault(key, []).append(spec)
    tr = _Tracker(client, len(specs), f"{len(conversations)} conversations at {rate:g}/s", progress)

    async def conversation(turns: list[RequestSpec], at: float) -> None:
        nonlocal stand_ins
        await asyncio.sleep(max(0.0, at - tr.now()))
        earlier: list[RequestRecord | None] = []
        for i, spec in enumerate(sorted(turns, key=lambda sp: sp.turn)):
            if i:
                await asyncio.sleep(think_s)
            if tr.stopping or tr.now() >= max_duration_s:
                return
            if answered:
                spec, kept = with_replies(spec, earlier)
                spec, stand_ins = replace(spec, keep_output=True), stand_ins + kept
            earlier.append(await tr.launch(spec, tr.now()))

    arrivals = gamma_arrivals(rate, len(conversations), seed, burstiness)
    tasks = [asyncio.create_task(conversation(turns, at)) for turns, at in zip(conversations.values(), arrivals)]
    _, pending = await asyncio.wait(tasks, timeout=_left(tr, max_duration_s))
    if pending:
        await tr.cancel_inflight()
        for t in pending:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    config = {"mode": "conversations", "rate": rate, "burstiness": burstiness, "concurrency": None,
              "num_requests": len(specs),
              "conversations": len(conversations), "think_s": think_s, "seed": seed, "max_duration_s": max_duration_s,
              "replies": replies, **({"stand_in_replies": stand_ins} if answered else {})}
    return tr.result(config, bool(pending) or len(tr.records) < len(specs))


async def run_sweep(client: Client, specs: list[RequestSpec], rates: list[float], seed: int = 0,
                    max_duration_s: float = math.inf, progress: bool = True,
                    burstiness: float = 1.0) -> list[RunResult]:
    """One open-loop run per rate, in the given order, each with the same specs, seed and burstiness."""
    return [await run_open_loop(client, specs, rate, seed, max_duration_s, progress, burstiness) for rate in rates]


@dataclass(frozen=True)
class WarmupResult:
    """The warm-up before the measured runs. requests: how many were sent; ok: how many succeeded;
    errors_by_kind: the failed ones by error kind; wall_time_s: how long the warm-up took."""

    requests: int
    ok: int
    errors_by_kind: dict[str, int]
    wall_time_s: float

    def __post_init__(self) -> None:
        if not 0 <= self.ok <= self.requests or self.wall_time_s < 0:
            raise ValueError(f"inconsistent warm-up counts: {self.ok} ok of {self.requests} in {self.wall_time_s} s")


async def warm_up(client: Client, specs: list[RequestSpec], concurrency: int | None = None,
                  max_duration_s: float = math.inf) -> WarmupResult:
    """Sends `specs` before a measured run and waits for them all; their records are dropped, so nothing of
    them reaches any metric. concurrency: requests in flight (None: all at once). Returns: what ran."""
    if not specs:
        return WarmupResult(0, 0, {}, 0.0)
    run = await run_closed_loop(client, [replace(s, conversation=None, turn=0) for s in specs],
                                concurrency or len(specs), max_duration_s, progress=False)
    kinds: dict[str, int] = {}
    for r in run.records:
        if not r.ok:
            kinds[r.error_kind or "unknown"] = kinds.get(r.error_kind or "unknown", 0) + 1
    return WarmupResult(len(run.records), sum(r.ok for r in run.records), dict(sorted(kinds.items())),
                        run.wall_time_s)


def _left(tr: _Tracker, max_duration_s: float) -> float | None:
    return None if math.isinf(max_duration_s) else max(0.0, max_duration_s - tr.now())
