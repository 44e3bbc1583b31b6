"""Discrete-event simulation of pdserve's router and pools, running the serving code's own decisions.

Life of a simulated request (the order of calls of `router.placer.Placer` and of the workers):
1. Arrival at the router (`TraceRequest.arrival_s`): its `RequestFeatures` (the expected output from the
   real `OutputLengthEstimator`); the real `Policy.place` on the `PoolState` the real `PoolBook.state()`
   gives (with the prompt tokens each worker's prefix cache holds, from the real `PrefixIndex`, when
   prompts share prefixes and `RouterConfig.prefix_aware`); `PoolBook.admit` books its worst-case KV.
   On NoCapacity it waits at the router and tries again whenever a booking is released; it is refused
   ("overloaded") when `RouterConfig.max_queued` already wait, or once it waited `queue_timeout_s`.
2. Remote path: decode worker D reserves the prompt's blocks (`Scheduler.reserve`, its cached prefix
   reused; a command its engine thread runs between steps: after the step under way), then prefill
   worker P queues it prefill-only; P's steps (the real `Scheduler`) prefill it in
   chunks beside other prompts, and the step computing its last chunk samples the first token:
   `PoolBook.prefilled`. The KV not hidden behind that chunk's later layers
   (`CostModel.exposed_transfer_s`) then travels; P frees the prompt's blocks once it is sent, and D
   starts the sequence (`Scheduler.activate`) `hop_s` after that, at its next step boundary (a step
   under way ends first): the first token reaches the client then.
   Local path: D queues it (`Scheduler.add`) and prefills it in chunks beside its running batch; the
   step computing the last chunk gives the first token.
3. Decode: D's steps (continuous batching, KV blocks, preemption and recompute: the real `Scheduler` and
   `BlockManager`) until the request has its output length; then `PoolBook.finished`, the estimator and
   the policy's `Correction` learn from it (as `Placer.release` / `Placer.observed`), and the requests
   waiting at the router try again.
Each worker calls `schedule()`, then, when the step's time has passed, `update()` with made-up token
ids, as `LLMEngine.step` does; nothing is sampled.

Step times, from the `CostModel` (a decode step's time grows with its sequences' context, `decode_s`; a
prompt chunk costs the same wherever it sits in its prompt, but for the prefix its cache held):
- a prefill worker's step of N prompt tokens (chunks of one or more prompts): `prefill_s(N)`, and
  `prefill_context_s` for each of a chunk's tokens per token of its prompt's prefix-cache hit (on every step
  below too);
- a decode worker's step of B decoding sequences holding C tokens of context and N prompt tokens:
  `decode_s(B, C)` when N = 0, `local_prefill_s(N)` when B = 0, else `local_prefill_s(N)` plus what B
  decoding rows add to one chunk's step (`local_prefill_wall_s(1, B) - local_prefill_s(1)` = decode_ride
  x `step_s(B)`) and what their context adds (`decode_s(B, C) - step_s(B)`).
A prefill worker's step that starts while a decode worker computes takes `prefill_beside_decode` times
longer (`ServingFactors.prefill_beside` where given), and a decode worker's decode-only step that starts
while a prefill worker computes `decode_beside_prefill` times (measured at start-up; 1 where they do not
share a node's memory).
Every step pays the fits' fixed cost, so a prompt prefilled in k chunks pays it k times. With
`ServingFactors` (what serving adds to the engine's calibrated times, measured by `--validate`), a
step's prompt tokens take `prefill` times those times and its decode rows `decode` times theirs, a step
with decode rows takes `decode_step_s` more, and each request's tokens reach the client `latency_s` later.

Not simulated: threads lent between roles (`--lend-threads`), role flips, worker failures and
retries, request deadlines, the network between clients and the router.

Boundary rule: never imports Ray, no torch.
"""
from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass, replace

from engine.block_manager import BlockManager, prefix_keys
from engine.config import CacheConfig, EngineConfig
from engine.sampling_params import SamplingParams
from engine.scheduler import Batch, Chunk, Scheduler
from engine.sequence import FinishReason, Sequence
from loadtest.metrics import summarize
from loadtest.records import RequestRecord
from planner.profiles import AS_CALIBRATED, ServingFactors
from planner.traces import Trace, TraceRequest
from router.book import Booking, DecodeSlot, PoolBook, PrefillSlot
from router.config import RouterConfig
from router.cost_model import Correction, CostModel, OutputLengthEstimator
from router.policy import NoCapacity, Policy, PoolState, RequestFeatures, make_policy
from router.prefix_index import PrefixIndex

_ENGINE, _CACHE = EngineConfig(), CacheConfig()
ERRORS = ("invalid", "overloaded", "unfinished")  # RequestOutcome.error: refused with 400, with 429, never ended


class SimulationError(RuntimeError):
    """The simulated system reached a state serving never does (a broken invariant)."""


@dataclass(frozen=True)
class WorkerSpec:
    """One worker's engine limits (the `pdserve serve` flags of the same names).

    Args:
        num_blocks: KV blocks in its pool (>= 1).
        block_size: tokens per KV block.
        max_num_seqs: most sequences it runs at once.
        max_num_batched_tokens: most tokens one step computes.
        prefill_chunk_tokens: most prompt tokens of a sequence per shared step.
        enable_prefix_caching: reuse cached prefix blocks.
    Defaults are `EngineConfig`'s and `CacheConfig`'s.
    """

    num_blocks: int
    block_size: int = _CACHE.block_size
    max_num_seqs: int = _ENGINE.max_num_seqs
    max_num_batched_tokens: int = _ENGINE.max_num_batched_tokens
    prefill_chunk_tokens: int = _ENGINE.prefill_chunk_tokens
    enable_prefix_caching: bool = _CACHE.enable_prefix_caching

    def __post_init__(self) -> None:
        for name in ("num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens", "prefill_chunk_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")

    @classmethod
    def from_memory(cls, cost: CostModel, memory_gib: float = _CACHE.memory_gib, **limits: int | bool) -> WorkerSpec:
        """A worker whose KV pool is `memory_gib` (`--kv-memory-gib`) of the cost model's KV bytes per token
        (the blocks `engine.config.KVLayout.from_budget` finds). `limits`: the other fields; the chunk size
        defaults to the one the cost model was measured with."""
        if not (math.isfinite(memory_gib) and memory_gib > 0):
            raise ValueError(f"memory_gib must be a finite number > 0, got {memory_gib!r}")
        block_size = int(limits.get("block_size", _CACHE.block_size))
        num_blocks = int(memory_gib * (1 << 30)) // (block_size * cost.kv_bytes_per_token)
        if num_blocks < 1:
            raise ValueError(f"memory_gib={memory_gib} holds no KV block of {block_size} tokens at "
                             f"{cost.kv_bytes_per_token} bytes per token")
        limits.setdefault("prefill_chunk_tokens", cost.prefill_chunk_tokens or _ENGINE.prefill_chunk_tokens)
        return cls(num_blocks=num_blocks, **limits)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Layout:
    """Args: prefill: prefill workers (>= 0; 0: local prefill only). decode: decode workers (>= 1)."""

    prefill: int
    decode: int

    def __post_init__(self) -> None:
        if not isinstance(self.prefill, int) or self.prefill < 0:
            raise ValueError(f"prefill must be an integer >= 0, got {self.prefill!r}")
        if not isinstance(self.decode, int) or self.decode < 1:
            raise ValueError(f"decode must be an integer >= 1, got {self.decode!r}")

    @property
    def label(self) -> str:
        return f"{self.prefill}P:{self.decode}D"

    @property
    def workers(self) -> int:
        return self.prefill + self.decode


@dataclass(frozen=True)
class RequestOutcome:
    """One simulated request. Times in seconds from its arrival (None when it never got there).

    Args: index: its position in the trace. arrival_s: from the trace's start. prompt_tokens, max_tokens.
    output_tokens: generated. path: "remote" / "local" (None: never placed). queue_s: waiting at the router.
    ttft_s, e2e_s: to its first and last token. preemptions: times its decode worker preempted it.
    error: one of ERRORS, None when it was served."""

    index: int
    arrival_s: float
    prompt_tokens: int
    max_tokens: int
    output_tokens: int = 0
    path: str | None = None
    queue_s: float | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    preemptions: int = 0
    error: str | None = None

    @property
    def tpot_s(self) -> float | None:
        if self.error or self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def record(self) -> RequestRecord:
        """The load generator's record of it (so both sides are summarised by `loadtest.metrics`)."""
        rec = RequestRecord(self.index, self.prompt_tokens, self.max_tokens, start_s=self.arrival_s,
                            scheduled_s=self.arrival_s, ttft_s=self.ttft_s, e2e_s=self.e2e_s,
                            output_tokens=self.output_tokens, output_tokens_source="usage",
                            timings={"path": self.path} if self.path else None)
        return rec.fail(self.error, f"simulated: {self.error}") if self.error else rec


@dataclass(frozen=True)
class Summary:
    """TTFT / TPOT percentiles (seconds; None without values), goodput and throughput of a run, as
    `loadtest.metrics.summarize` defines them (goodput: requests/s that were served within both targets,
    over the run's wall time, first arrival to last end)."""

    requests: int
    ok: int
    wall_time_s: float
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    tpot_p50_s: float | None
    tpot_p99_s: float | None
    goodput_rps: float
    good_fraction: float
    throughput_rps: float

    @classmethod
    def of(cls, records: list[RequestRecord], wall_time_s: float, ttft_target_s: float | None,
           tpot_target_s: float | None) -> Summary:
        """Args: the run's records, its wall time (> 0 s; smaller is raised to 1 ms), the targets."""
        s = summarize(records, max(wall_time_s, 1e-3), ttft_target_s, tpot_target_s)
        return cls(s["requests"]["total"], s["requests"]["ok"], s["wall_time_s"], s["ttft_s"]["p50"],
                   s["ttft_s"]["p99"], s["tpot_s"]["p50"], s["tpot_s"]["p99"], s["goodput"]["requests_per_s"],
                   s["goodput"]["fraction"], s["throughput"]["requests_per_s"])


@dataclass(frozen=True)
class SimResult:
    """Args: outcomes: one per trace request, in trace order. wall_time_s: first arrival to last end.
    prefill_steps / decode_steps: steps the pools ran. decode_rows: decoding sequences summed over decode
    workers' steps. preemptions: sequences preempted. remote: requests placed on the remote path.
    decode_only_steps: the decode workers' steps without prompt tokens. prefill_beside / decode_beside: the
    prefill workers' steps, and the decode workers' decode-only ones, that started while a worker of the
    other pool computed."""

    outcomes: tuple[RequestOutcome, ...]
    wall_time_s: float
    prefill_steps: int
    decode_steps: int
    decode_rows: int
    preemptions: int
    remote: int
    decode_only_steps: int = 0
    prefill_beside: int = 0
    decode_beside: int = 0

    @property
    def beside(self) -> tuple[float, float]:
        """The shares of the prefill workers' steps and of the decode workers' decode-only steps that started
        while a worker of the other pool computed (0 without such steps)."""
        return (self.prefill_beside / self.prefill_steps if self.prefill_steps else 0.0,
                self.decode_beside / self.decode_only_steps if self.decode_only_steps else 0.0)

    @property
    def mean_decode_batch(self) -> float:
        return self.decode_rows / self.decode_steps if self.decode_steps else 0.0

    def records(self) -> list[RequestRecord]:
        return [o.record() for o in self.outcomes]

    def summary(self, ttft_target_s: float | None, tpot_target_s: float | None) -> Summary:
        return Summary.of(self.records(), self.wall_time_s, ttft_target_s, tpot_target_s)


class _Req:
    """A request in flight (mutable; the simulator's own)."""

    __slots__ = ("booking", "end_at", "error", "features", "first_at", "index", "keys", "output", "placed_at",
                 "preemptions", "prompt", "spec", "waiting")

    def __init__(self, index: int, spec: TraceRequest, prompt: list[int]) -> None:
        self.index, self.spec, self.prompt = index, spec, prompt
        self.features: RequestFeatures | None = None
        self.keys: list[int] = []
        self.booking: Booking | None = None
        self.placed_at = self.first_at = self.end_at = None
        self.output = self.preemptions = 0
        self.error: str | None = None
        self.waiting = False


def _stop(seq: Sequence) -> FinishReason | None:
    """The engine's stop check, for made-up tokens: a sequence ends at its trace output length."""
    return FinishReason.LENGTH if seq.num_output_tokens >= seq.sampling.max_tokens else None


class _Worker:
    """One simulated engine: the real `Scheduler` and `BlockManager`; `busy` while a step runs."""

    def __init__(self, pool: str, index: int, spec: WorkerSpec) -> None:
        self.pool, self.index, self.spec = pool, index, spec
        self.blocks = BlockManager(spec.num_blocks, spec.block_size, spec.enable_prefix_caching)
        self.scheduler = Scheduler(self.blocks, spec.max_num_seqs, spec.max_num_batched_tokens, _stop,
                                   spec.prefill_chunk_tokens)
        self.busy = False
        self.landing: list[str] = []  # decode side: remote prefills whose KV landed, started at the next step
        # decode side: remote prompts placed here, reserved between steps: (request id, prompt, params, P)
        self.reserving: list[tuple[str, list[int], SamplingParams, int]] = []
        self.prefilling: dict[str, Sequence] = {}  # decode side: local prefills without their first token yet
        self.steps = self.rows = 0
        self.decode_only = 0  # decode side: steps without prompt tokens
        self.beside = 0  # steps started while a worker of the other pool computed (decode side: decode-only ones)


# event kinds, in the heap as (time, number, kind, a, b)
_ARRIVE, _STEP, _LANDED, _SENT, _TIMEOUT = range(5)


def prompt_ids(spec: TraceRequest, index: int, hash_block_tokens: int) -> list[int]:
    """The made-up token ids of a trace request's prompt: its own ids when the trace has them; else,
    block by block of `hash_block_tokens`, a first token naming the block's hash id (the request's own
    index past its hashes) and small filler ids, so prompts share exactly the prefixes their hashes share."""
    if spec.prompt_ids is not None:
        return list(spec.prompt_ids)
    ids = []
    for start in range(0, spec.prompt_tokens, hash_block_tokens):
        block = start // hash_block_tokens
        head = (spec.hash_ids[block] + 1) * 2 if block < len(spec.hash_ids) else (index + 1) * 2 + 1
        ids.append(-head)  # negative: never a filler id
        ids.extend(range(1, min(hash_block_tokens, spec.prompt_tokens - start)))
    return ids


class Simulator:
    """Runs a trace through simulated pools with the router's real policy and book.

    Args:
        trace: the requests.
        cost: the cost model (step and transfer times; the policy prices placements with it too).
        layout: workers per pool.
        worker: each decode worker's engine limits (and each prefill worker's, unless `prefill_worker`).
        router: policy, targets and admission limits (`flip_roles` is not simulated).
        policy: the placement policy (None: `make_policy(router.policy, ...)` with the router's correction,
            as `Placer` builds it).
        prefill_worker: each prefill worker's engine limits (None: `worker`'s).
        factors: how much longer than the cost model's times served steps take (see `ServingFactors`).
    """

    def __init__(self, trace: Trace, cost: CostModel, layout: Layout, worker: WorkerSpec,
                 router: RouterConfig | None = None, policy: Policy | None = None,
                 prefill_worker: WorkerSpec | None = None, factors: ServingFactors = AS_CALIBRATED) -> None:
        router = router or RouterConfig()
        if router.flip_roles:
            raise ValueError("flip_roles is not simulated: plan with flip_roles off")
        self.trace, self.cost, self.layout, self.router, self.factors = trace, cost, layout, router, factors
        self._served_cost = factors.applied(cost)  # what steps take when served; the policy prices with `cost`
        self.worker, self.prefill_worker = worker, prefill_worker or worker
        self.book = PoolBook([PrefillSlot(f"prefill-{i}") for i in range(layout.prefill)],
                             [DecodeSlot(f"decode-{i}", worker.num_blocks, worker.block_size, worker.max_num_seqs)
                              for i in range(layout.decode)])
        self.correction = Correction()
        self.policy = policy or make_policy(router.policy, cost, router.ttft_target_s, router.tpot_target_s,
                                            self.correction)
        self.estimator = OutputLengthEstimator()
        self.prefix = PrefixIndex()
        self.track_prefixes = router.prefix_aware and trace.shares_prefixes
        self.prefill = [_Worker("prefill", i, self.prefill_worker) for i in range(layout.prefill)]
        self.decode = [_Worker("decode", i, worker) for i in range(layout.decode)]
        self.reqs: list[_Req | None] = [None] * len(trace.requests)
        self.waiting: list[_Req] = []
        self.now = 0.0
        self._events: list[tuple] = []
        self._count = itertools.count()
        # what B decoding rows add to a step that computes prompt tokens: one chunk's ride
        self._ride = {}

    # -- the event loop --------------------------------------------------------------------------
    def run(self) -> SimResult:
        """Simulate the whole trace. Returns: the outcomes."""
        for i, spec in enumerate(self.trace.requests):
            self._push(spec.arrival_s, _ARRIVE, i)
        handlers = {_ARRIVE: self._arrive, _STEP: self._step_end, _LANDED: self._landed, _SENT: self._sent,
                    _TIMEOUT: self._timeout}
        events = self._events
        while events:
            self.now, _, kind, a, b = heapq.heappop(events)
            handlers[kind](a, b)
        return self._result()

    def _push(self, at: float, kind: int, a: object = None, b: object = None) -> None:
        heapq.heappush(self._events, (at, next(self._count), kind, a, b))

    # -- the router ------------------------------------------------------------------------------
    def _arrive(self, index: int, _: object) -> None:
        spec = self.trace.requests[index]
        req = self.reqs[index] = _Req(index, spec, prompt_ids(spec, index, self.trace.hash_block_tokens))
        if -(-(spec.prompt_tokens + spec.max_tokens) // self.worker.block_size) > self.worker.num_blocks:
            req.error = "invalid"  # the router refuses it: prompt + max_tokens exceed a decode worker's KV pool
            return
        req.features = RequestFeatures(spec.prompt_tokens, self.estimator.expected(spec.max_tokens, spec.ignore_eos),
                                       spec.max_tokens)
        if self.track_prefixes:
            req.keys = prefix_keys(req.prompt, self.worker.block_size)
        if self._place(req):
            return
        if len(self.waiting) >= self.router.max_queued:
            req.error = "overloaded"
            return
        req.waiting = True
        self.waiting.append(req)
        self._push(self.now + self.router.queue_timeout_s, _TIMEOUT, index)

    def _timeout(self, index: int, _: object) -> None:
        req = self.reqs[index]
        if req.waiting:
            req.waiting, req.error = False, "overloaded"
            self.waiting.remove(req)

    def _state(self, keys: list[int]) -> PoolState:
        """The book's view for one request, with the prompt tokens each worker's cache holds or is promised."""
        state = self.book.state()
        if not keys:
            return state
        bs = self.worker.block_size
        return PoolState(
            tuple(replace(p, cached_tokens=self.prefix.matched("prefill", i, keys) * bs)
                  for i, p in enumerate(state.prefill)),
            tuple(replace(d, cached_tokens=self.prefix.matched("decode", i, keys) * bs,
                          arriving_tokens=self.prefix.arriving_blocks("decode", i, keys) * bs)
                  for i, d in enumerate(state.decode)))

    def _place(self, req: _Req) -> bool:
        """Place and book `req` and start it on its workers. Returns False on NoCapacity."""
        try:
            placement = self.policy.place(req.features, self._state(req.keys))
        except NoCapacity:
            return False
        spec = req.spec
        if placement.path == "remote" and \
                -(-spec.prompt_tokens // self.prefill_worker.block_size) > self.prefill_worker.num_blocks:
            req.error = "invalid"  # the router refuses it: longer than a prefill worker's KV pool
            return True
        arriving = placement.prefill is None and self.prefix.arriving("decode", placement.decode, req.keys)
        req.booking = booking = self.book.admit(placement, spec.prompt_tokens, spec.max_tokens, arriving)
        req.placed_at = self.now
        if req.keys:  # as the placer promises: to the worker computing the prompt and to D
            booking.promise = self.prefix.promise_placed(placement.prefill, ("decode", placement.decode), req.keys)
        sampling = SamplingParams(max_tokens=spec.output_tokens, ignore_eos=True)
        rid, d = str(req.index), self.decode[placement.decode]
        if placement.path == "local":
            d.prefilling[rid] = seq = Sequence(rid, req.prompt, sampling)
            d.scheduler.add(seq)
            self._kick(d)
            return True
        d.reserving.append((rid, req.prompt, sampling, placement.prefill))
        if not d.busy:
            self._reserve(d)
        return True

    def _reserve(self, d: _Worker) -> None:
        """D reserves blocks for the remote prompts placed on it (a command its engine thread runs between
        its steps), and each prompt then goes to its prefill worker."""
        for rid, prompt, sampling, p_index in d.reserving:
            if not d.scheduler.reserve(Sequence(rid, prompt, sampling), reuse=self.router.prefix_aware):
                raise SimulationError(f"decode worker {d.index} refused a reservation the router booked "
                                      f"(request {rid})")
            p = self.prefill[p_index]
            p.scheduler.add(Sequence(rid, prompt, sampling, prefill_only=True))
            self._kick(p)
        d.reserving.clear()

    def _release(self, req: _Req, seq: Sequence) -> None:
        """`req` left its decode worker: the book, the estimator and the correction learn; waiters retry."""
        req.end_at, req.output, req.preemptions = self.now, seq.num_output_tokens, seq.num_preemptions
        booking = req.booking
        if booking.promise is not None:
            booking.promise.withdraw()
        self.book.finished(booking)
        spec = req.spec
        self.estimator.observe(req.output, spec.max_tokens, "length" if req.output >= spec.max_tokens else "stop")
        pl = booking.placement
        if booking.own_ttft:
            self.correction.observe("ttft", pl.path, req.first_at - req.placed_at, pl.est_ttft_s)
        if req.output > 1:
            self.correction.observe("tpot", pl.path, (req.end_at - req.first_at) / (req.output - 1), pl.est_tpot_s)
        if self.waiting:
            still = []
            for w in self.waiting:
                if self._place(w):
                    w.waiting = False
                else:
                    still.append(w)
            self.waiting = still

    # -- the workers -----------------------------------------------------------------------------
    def _kick(self, w: _Worker) -> None:
        if not w.busy:
            self._step(w)

    def _step(self, w: _Worker) -> None:
        """Start `w`'s next step (decode workers first reserve for the remote prompts placed on them and
        start the sequences whose KV landed)."""
        if w.reserving:
            self._reserve(w)
        if w.landing:
            self._land(w)
        batch = w.scheduler.schedule()
        if batch is None:
            w.busy = False
            return
        w.busy = True
        w.steps += 1
        w.rows += len(batch.decode)
        decode_only = w.pool == "decode" and not batch.is_prefill
        w.decode_only += decode_only
        others = self.decode if w.pool == "prefill" else self.prefill
        beside = (w.pool == "prefill" or decode_only) and any(o.busy for o in others)
        w.beside += beside
        self._push(self.now + self._duration(w, batch, beside), _STEP, w, batch)

    def _duration(self, w: _Worker, batch: Batch, beside: bool) -> float:
        """A step's seconds (see the module docstring); `beside`: a worker of the other pool computes."""
        cost, f, n, b = self._served_cost, self.factors, batch.num_prefill_tokens, len(batch.decode)
        over = cost.prefill_context_s * sum((c.end - c.start) * c.seq.num_cached_tokens for c in batch.prefill)
        if w.pool == "prefill":
            return (cost.prefill_s(n) + over) * f.prefill * cost.beside("prefill", float(beside))
        if not b:
            return (cost.local_prefill_s(n) + over) * f.prefill
        step = cost.step_s(b)
        context = cost.decode_s(b, sum(seq.num_tokens for seq in batch.decode)) - step  # its KV reads beyond
        if not n:
            return (step + context) * f.decode * cost.beside("decode", float(beside)) + f.decode_step_s
        ride = self._ride.get(b)
        if ride is None:
            ride = self._ride[b] = cost.local_prefill_wall_s(1, b) - cost.local_prefill_s(1)
        return (cost.local_prefill_s(n) + over) * f.prefill + (ride + context) * f.decode + f.decode_step_s

    def _step_end(self, w: _Worker, batch: Batch) -> None:
        sampled = batch.sampled
        finished = w.scheduler.update(batch, [1] * len(sampled))
        if w.pool == "prefill":
            for chunk in batch.prefill:
                if chunk.final:
                    self._prefilled(w, chunk)
        elif w.prefilling:  # a prompt's first token: after its last chunk, or as a decode row (one token left)
            for rid, seq in list(w.prefilling.items()):
                if seq.num_output_tokens:
                    del w.prefilling[rid]
                    req = self.reqs[int(rid)]
                    req.first_at = self.now
                    self.book.prefilled(req.booking)
        for seq in finished:
            self._release(self.reqs[int(seq.request_id)], seq)
        self._sync_prefixes(w)
        self._step(w)

    def _prefilled(self, p: _Worker, chunk: Chunk) -> None:
        """A remote prefill's last chunk ran on P: the router has the first token; the KV D lacks travels."""
        seq, rid = chunk.seq, chunk.seq.request_id
        req = self.reqs[int(rid)]
        self.book.prefilled(req.booking)
        d = self.decode[req.booking.placement.decode]
        receiving = d.scheduler.receiving[rid]
        shipped = max(1, receiving.num_tokens - receiving.num_cached_tokens)
        exposed = self.cost.exposed_transfer_s(shipped, whole=chunk.start == seq.num_cached_tokens)
        self._push(self.now + exposed, _SENT, p, rid)
        self._push(self.now + exposed + self.cost.hop_s, _LANDED, d, rid)

    def _sent(self, p: _Worker, rid: str) -> None:
        p.scheduler.release(rid)
        self._sync_prefixes(p)
        self._kick(p)  # blocks came back: a waiting prompt may fit now

    def _landed(self, d: _Worker, rid: str) -> None:
        d.landing.append(rid)
        self._kick(d)

    def _land(self, d: _Worker) -> None:
        for rid in d.landing:
            seq = d.scheduler.activate(rid, 1)
            req = self.reqs[int(rid)]
            req.first_at = self.now
            if seq.is_finished:
                self._release(req, seq)
        d.landing.clear()

    def _sync_prefixes(self, w: _Worker) -> None:
        """The router's copy of `w`'s prefix cache catches up (serving: at the next health poll)."""
        if self.track_prefixes:
            self.prefix.apply(w.pool, w.index, w.blocks.events.since(self.prefix.acked(w.pool, w.index)))

    # -- the result ------------------------------------------------------------------------------
    def _result(self) -> SimResult:
        outcomes = []
        for i, spec in enumerate(self.trace.requests):
            req = self.reqs[i]
            error = req.error if req.error else (None if req.end_at is not None else "unfinished")
            at, late = spec.arrival_s, self.factors.latency_s  # the client sees each token that much later
            served = error is None
            outcomes.append(RequestOutcome(
                i, at, spec.prompt_tokens, spec.max_tokens, req.output,
                req.booking.placement.path if req.booking else None,
                req.placed_at - at if req.placed_at is not None else None,
                req.first_at + late - at if served else None, req.end_at + late - at if served else None,
                req.preemptions, error))
        start = self.trace.requests[0].arrival_s
        end = max(o.arrival_s + (o.e2e_s or 0.0) for o in outcomes)
        return SimResult(tuple(outcomes), end - start, sum(w.steps for w in self.prefill),
                         sum(w.steps for w in self.decode), sum(w.rows for w in self.decode),
                         sum(w.scheduler.num_preemptions for w in self.prefill + self.decode),
                         sum(o.path == "remote" for o in outcomes), sum(w.decode_only for w in self.decode),
                         sum(w.beside for w in self.prefill), sum(w.beside for w in self.decode))


def simulate(trace: Trace, cost: CostModel, layout: Layout, worker: WorkerSpec, router: RouterConfig | None = None,
             policy: Policy | None = None, prefill_worker: WorkerSpec | None = None,
             factors: ServingFactors = AS_CALIBRATED) -> SimResult:
    """Run `trace` through a fresh `Simulator` (see its arguments). Returns: its result."""
    return Simulator(trace, cost, layout, worker, router, policy, prefill_worker, factors).run()
