"""Placement: per request, remote prefill (prefill worker P, then decode worker D) or local prefill on D.

The ratio policy (default) estimates both paths from the measured `CostModel`, each on the prompt
tokens the worker's prefix cache does not hold (`cached_tokens`). Remote pays P's queue, the prefill
(in chunks beside P's own batch, whose stall counts as a slowdown, when P is flipped to decode), the
transfer (of what D lacks) not hidden behind the last chunk's later layers and the extra round trips;
local pays D's queued local prefills and the prefill in chunks, each in a step that also decodes D's
running batch (what that adds is measured), after the wait for its prefix where that is on its way to D
(while a prefill worker computes it, at most that worker's queue), and D's batch loses what those steps
take beyond its own decode steps (requests there still waiting for their KV lose nothing: under a burst of long prompts
D prefills its share instead of leaving every prompt queued on P). A decode worker computing with a
prefill worker's lent threads (`Loan`) decodes and prefills that much faster (each by its own
measured factor: a prefill gains more from a core than a decode step), and a prompt sent to that
prefill worker takes the threads back, priced as what the borrower's running batch loses until they
are lent again; a prefill worker computing with a decode worker's threads prefills that much faster,
and a local prefill on that decode worker takes them back, priced as the delay it adds to P's
queue. Each option costs (TTFT + that delay) / TTFT target + decode slowdown + crowding (what one
more sequence in D's batch costs those already there)
+ 1 per missed SLO (a lost request of goodput); the cheapest wins, ties go remote. So the switch
point follows measured prefill, transfer and decode-step costs; no hard-coded thresholds. With a
`Correction`, every estimate is multiplied by what serving has shown the cost model to miss (actual /
predicted, per path), before it is priced. Only healthy workers, and decode workers with KV room for
prompt + max_tokens.
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, replace

from router.cost_model import Correction, CostModel, OutputLengthEstimator

__all__ = ["POLICIES", "AlwaysLocalPolicy", "AlwaysRemotePolicy", "CostModel", "DecodeLoad", "Loan", "NoCapacity",
           "OutputLengthEstimator", "Placement", "Policy", "PoolState", "PrefillLoad", "RatioPolicy",
           "RequestFeatures", "RoundRobinPolicy", "make_policy"]

POLICIES = ("ratio", "always_remote", "always_local", "round_robin")
PATHS = ("remote", "local")


@dataclass(frozen=True)
class RequestFeatures:
    """Args: prompt_tokens: >= 1. expected_output_tokens: 1..max_tokens (see `OutputLengthEstimator`).
    max_tokens: worst-case output, for KV admission."""

    prompt_tokens: int
    expected_output_tokens: int
    max_tokens: int

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1:
            raise ValueError(f"prompt_tokens must be >= 1, got {self.prompt_tokens}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 1 <= self.expected_output_tokens <= self.max_tokens:
            raise ValueError(f"expected_output_tokens must be in [1, max_tokens={self.max_tokens}], "
                             f"got {self.expected_output_tokens}")


@dataclass(frozen=True)
class Loan:
    """Threads lent between a prefill worker and decode worker `decode` on one node
    (`router.elastic.ThreadLender`): the prefill worker's to the decode worker (`to_decode`), or the
    decode worker's to the prefill worker. With them the borrower decodes `decode_speedup` and prefills
    `prefill_speedup` times faster (measured); the lender takes them back when it gets work, until
    `relend_s` after it runs out."""

    decode: int
    decode_speedup: float
    prefill_speedup: float
    relend_s: float
    to_decode: bool = True

    def __post_init__(self) -> None:
        if self.decode < 0:
            raise ValueError(f"decode must be an index >= 0, got {self.decode}")
        for name in ("decode_speedup", "prefill_speedup"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 1):
                raise ValueError(f"{name} must be a finite number >= 1, got {value!r}")
        if not (math.isfinite(self.relend_s) and self.relend_s >= 0):
            raise ValueError(f"relend_s must be a finite number >= 0, got {self.relend_s!r}")


@dataclass(frozen=True)
class PrefillLoad:
    """Args: worker_id: the worker. queued_tokens: prompt tokens waiting on it (>= 0). healthy: usable.
    decoding: requests it runs whole (flipped to decode), whose decode rows ride in its prefill steps.
    cached_tokens: leading tokens of the request's prompt its prefix cache holds (it computes the rest).
    loan: threads lent between it and a decode worker now, either way, or offered to that decode worker's next
    local prompt, which gets them at once (`router.elastic.ThreadLender.offers`; None: each computes with its own)."""

    worker_id: str
    queued_tokens: int
    healthy: bool = True
    decoding: int = 0
    cached_tokens: int = 0
    loan: Loan | None = None

    def __post_init__(self) -> None:
        for name in ("queued_tokens", "decoding", "cached_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class DecodeLoad:
    """Args: worker_id: the worker. running: sequences decoding or admitted on it. free_blocks: free KV blocks.
    block_size: tokens per block. queued_prefill_tokens: local prefill tokens waiting on it. healthy: usable.
    local_only: a prefill worker flipped to decode: it runs whole requests and never receives KV.
    awaiting_kv: of `running`, the requests whose remote prefill is not done yet (not decoding).
    cached_tokens: leading tokens of the request's prompt its prefix cache holds: a local prefill computes
    only the rest, and a remote one ships only the rest.
    arriving_tokens: how many of those tokens, from the first it lacks, are on their way to it (other
    requests' remote prefills compute and ship them): a local prefill waits there for them and takes no
    lent threads back meanwhile (`arriving`)."""

    worker_id: str
    running: int
    free_blocks: int
    block_size: int
    queued_prefill_tokens: int = 0
    healthy: bool = True
    local_only: bool = False
    awaiting_kv: int = 0
    cached_tokens: int = 0
    arriving_tokens: int = 0

    def __post_init__(self) -> None:
        for name in ("running", "free_blocks", "queued_prefill_tokens", "awaiting_kv", "cached_tokens",
                     "arriving_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.awaiting_kv > self.running:
            raise ValueError(f"awaiting_kv must be <= running={self.running}, got {self.awaiting_kv}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")

    @property
    def arriving(self) -> bool:
        """Whether a local prefill here would wait for KV on its way (see `arriving_tokens`)."""
        return self.arriving_tokens > 0

    def has_room(self, request: RequestFeatures) -> bool:
        """Returns: whether the KV blocks for prompt + max_tokens fit in `free_blocks`."""
        return math.ceil((request.prompt_tokens + request.max_tokens) / self.block_size) <= self.free_blocks


@dataclass(frozen=True)
class PoolState:
    """Args: prefill / decode: one load per worker (lists are stored as tuples)."""

    prefill: tuple[PrefillLoad, ...]
    decode: tuple[DecodeLoad, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "prefill", tuple(self.prefill))
        object.__setattr__(self, "decode", tuple(self.decode))
        for p in self.prefill:
            if p.loan is not None and p.loan.decode >= len(self.decode):
                raise ValueError(f"prefill worker {p.worker_id} lends to decode index {p.loan.decode}, "
                                 f"beyond the {len(self.decode)} decode workers")

    def lent_to(self, decode: int) -> Loan | None:
        """The loan of a prefill worker's threads decode worker `decode` computes with now, if any."""
        return next((p.loan for p in self.prefill
                     if p.loan is not None and p.loan.to_decode and p.loan.decode == decode), None)

    def lending(self, decode: int) -> int | None:
        """The prefill worker computing with decode worker `decode`'s threads now, if any."""
        return next((i for i, p in enumerate(self.prefill)
                     if p.loan is not None and not p.loan.to_decode and p.loan.decode == decode), None)


@dataclass(frozen=True)
class Placement:
    """Args: path: "remote" | "local". prefill: index into PoolState.prefill (None for local).
    decode: index into PoolState.decode. reason: short label for metrics. est_ttft_s / est_tpot_s: the
    cost model's estimates. detail: human-readable numbers for debug logs. cost: what the ratio policy
    priced it at (None from the fixed policies). computed_tokens: the prompt tokens the worker that
    prefills it computes (its cache holds or is promised the rest; None: all of them)."""

    path: str
    prefill: int | None
    decode: int
    reason: str
    est_ttft_s: float
    est_tpot_s: float
    detail: str = ""
    cost: float | None = None
    computed_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.path not in PATHS:
            raise ValueError(f"path must be one of {PATHS}, got {self.path!r}")
        if (self.prefill is None) != (self.path == "local"):
            raise ValueError(f"prefill must be None exactly for the local path, got {self.prefill!r} "
                             f"for path {self.path!r}")
        if self.decode < 0 or (self.prefill is not None and self.prefill < 0):
            raise ValueError(f"prefill / decode must be indices >= 0, got {self.prefill!r} / {self.decode}")
        if not self.reason:
            raise ValueError("reason must be a non-empty label")
        if self.computed_tokens is not None and self.computed_tokens < 1:
            raise ValueError(f"computed_tokens must be >= 1 or None, got {self.computed_tokens}")


class NoCapacity(Exception):
    """No healthy decode worker has KV room for the request's prompt + max_tokens."""


@dataclass(frozen=True)
class _Option:
    path: str
    prefill: int | None
    decode: int
    ttft_s: float
    tpot_s: float
    slowdown: float
    computed: int  # prompt tokens the prefilling worker computes
    crowding: float = 0.0  # what joining D's batch costs the sequences already there (see `_crowding`)
    delay_s: float = 0.0  # what it adds to the TTFT of prompts queued elsewhere (taking lent threads back)
    cost: float = 0.0

    def describe(self) -> str:
        return (f"{self.path} ttft={self.ttft_s:.4f}s tpot={self.tpot_s:.4f}s slowdown={self.slowdown:.4f} "
                f"crowding={self.crowding:.4f} delay={self.delay_s:.4f}s cost={self.cost:.4f}")


def _crowding(cost: CostModel, running: int) -> float:
    """What one more sequence in a decode batch of `running` costs the sequences already there: each
    step grows by step(r + 1) - step(r) for all r of them, as long as the newcomer runs; in units of
    the newcomer's own decode time. It steers decode-heavy load to the emptier batch."""
    if running == 0:
        return 0.0
    grown = cost.step_s(running + 1)
    return running * (grown - cost.step_s(running)) / grown


def _uncached(req: RequestFeatures, cached_tokens: int) -> int:
    """The prompt tokens a worker holding `cached_tokens` of them computes (or receives): at least one."""
    return max(1, req.prompt_tokens - cached_tokens)


def _prefill_speedup(load: PrefillLoad) -> float:
    """How much faster a prefill worker computes prompts now: with a decode worker's lent threads, or not."""
    return load.loan.prefill_speedup if load.loan and not load.loan.to_decode else 1.0


def _remote(cost: CostModel, req: RequestFeatures, state: PoolState, p: int, d: int) -> _Option:
    load = state.prefill[p]
    lent = load.loan if load.loan and load.loan.to_decode else None  # the prompt takes P's threads back
    borrowing = bool(load.loan and not load.loan.to_decode)  # P computes with D's threads (and holds its layers)
    fast = _prefill_speedup(load)
    on_d = None if lent and lent.decode == d else state.lent_to(d)  # the prompt takes back what P lent D
    step = cost.step_s(state.decode[d].running + 1) / (on_d.decode_speedup if on_d else 1.0)
    n = _uncached(req, load.cached_tokens)  # what P computes; it ships what D lacks
    cached = req.prompt_tokens - n  # what its chunks attend over without computing it
    prefill, slowdown = cost.prefill_s(n, cached) / fast, 1.0
    if load.decoding:  # flipped to decode: the prompt's chunks run beside P's own batch, which they hold up
        prefill = cost.local_prefill_wall_s(n, load.decoding, cached)
        slowdown += load.decoding * cost.local_stall_s(n, load.decoding, cached) / (req.expected_output_tokens * step)
    queued = load.queued_tokens * cost.prefill.per_unit_s / fast
    if lent:  # the borrower's decoding batch runs 1 / speedup as fast until the threads are lent again
        borrower = state.decode[lent.decode]
        lost = (queued + prefill + lent.relend_s) * (1 - 1 / lent.decode_speedup)
        slowdown += (borrower.running - borrower.awaiting_kv) * lost / (req.expected_output_tokens * step)
    alone = not load.queued_tokens and not load.decoding  # P prefills the prompt whole (engine.scheduler)
    ttft = (queued + prefill + cost.exposed_transfer_s(_uncached(req, state.decode[d].cached_tokens), alone, borrowing)
            + cost.hop_s + step / 2)
    return _Option("remote", p, d, ttft, step, slowdown, n, _crowding(cost, state.decode[d].running))


def _landing_s(cost: CostModel, state: PoolState, tokens: int) -> float:
    """How long until `tokens` of KV on their way to a decode worker land: the prefill worker bringing them
    computes them, at most its whole queue (whose prompts it computes side by side, `engine.scheduler`);
    the longest healthy queue stands for that worker (the index does not say which)."""
    return max((min(p.queued_tokens, tokens) * cost.prefill.per_unit_s / _prefill_speedup(p)  # as `_remote`'s queue
                for p in state.prefill if p.healthy), default=0.0)


def _local(cost: CostModel, req: RequestFeatures, state: PoolState, d: int) -> _Option:
    load, loan = state.decode[d], state.lent_to(d)  # lent threads speed D's steps and prefills, each its own way
    decode_speedup, prefill_speedup = (loan.decode_speedup, loan.prefill_speedup) if loan else (1.0, 1.0)
    step = cost.step_s(load.running + 1) / decode_speedup
    decoding = load.running - load.awaiting_kv  # the rest wait for their KV from a prefill worker
    n = _uncached(req, load.cached_tokens)  # D's cache serves the rest
    queued = cost.local_prefill_s(load.queued_prefill_tokens) if load.queued_prefill_tokens else 0.0
    cached = req.prompt_tokens - n
    ttft = (queued + cost.local_prefill_wall_s(n, decoding, cached)) / prefill_speedup + step / 2
    if load.arriving:  # it computes nothing until the prefix on its way to D lands
        ttft += _landing_s(cost, state, load.arriving_tokens)
    # what the chunks cost the sequences they hold up (D's decoding batch + this request, standing for its
    # co-arrivals), spread over this request's output
    stall = cost.local_stall_s(n, decoding, cached) / prefill_speedup
    slowdown = 1.0 + (decoding + 1) * stall / (req.expected_output_tokens * step)
    delay = 0.0
    if (p := state.lending(d)) is not None and not load.arriving:  # D takes its threads back: P's queue computes
        # 1 / speedup as fast
        delay = (state.prefill[p].queued_tokens * cost.prefill.per_unit_s
                 * (1 - 1 / state.prefill[p].loan.prefill_speedup))
    return _Option("local", None, d, ttft, step * slowdown, slowdown, n, _crowding(cost, load.running), delay)


def _candidates(request: RequestFeatures, state: PoolState) -> tuple[list[int], list[int]]:
    """Healthy prefill indices, healthy decode indices with room; NoCapacity when none of the latter."""
    prefill = [i for i, p in enumerate(state.prefill) if p.healthy]
    healthy = [i for i, d in enumerate(state.decode) if d.healthy]
    decode = [i for i in healthy if state.decode[i].has_room(request)]
    if not decode:
        blocks = {state.decode[i].block_size for i in healthy}
        raise NoCapacity(f"no healthy decode worker has KV room for prompt {request.prompt_tokens} + max_tokens "
                         f"{request.max_tokens} tokens ({len(healthy)} healthy of {len(state.decode)}, "
                         f"block sizes {sorted(blocks)}, free blocks "
                         f"{[state.decode[i].free_blocks for i in healthy]})")
    return prefill, decode


def _receivers(state: PoolState, decode: list[int]) -> list[int]:
    """The decode indices that can take a remote prefill's KV (flex slots cannot)."""
    return [d for d in decode if not state.decode[d].local_only]


def _least_prefill(state: PoolState, prefill: list[int]) -> int:
    return min(prefill, key=lambda i: (state.prefill[i].queued_tokens, i))


def _least_decode(state: PoolState, decode: list[int]) -> int:
    return min(decode, key=lambda i: (state.decode[i].running, state.decode[i].queued_prefill_tokens,
                                      -state.decode[i].free_blocks, i))


def _corrected(opt: _Option, correction: Correction | None) -> _Option:
    if correction is None:
        return opt
    return replace(opt, ttft_s=opt.ttft_s * correction.factor("ttft", opt.path),
                   tpot_s=opt.tpot_s * correction.factor("tpot", opt.path))


class Policy(ABC):
    """Chooses where a request's prefill and decode run. `correction`: online factors its estimates
    are multiplied by (None: the cost model as calibrated)."""

    name: str
    correction: Correction | None = None

    @abstractmethod
    def place(self, request: RequestFeatures, state: PoolState) -> Placement:
        """Args: request: the request's features. state: the pools' current load.
        Returns: the placement. Raises: NoCapacity when no healthy decode worker has room."""


class _FixedPolicy(Policy):
    """Shared by the non-ratio policies: estimates from the cost model, no weighing."""

    def __init__(self, cost: CostModel) -> None:
        self.cost = cost

    def _placement(self, request: RequestFeatures, state: PoolState, path: str, p: int | None, d: int,
                   reason: str) -> Placement:
        opt = _remote(self.cost, request, state, p, d) if p is not None else _local(self.cost, request, state, d)
        opt = _corrected(opt, self.correction)
        assert opt.path == path
        return Placement(path, p, d, reason, opt.ttft_s, opt.tpot_s, opt.describe(), computed_tokens=opt.computed)


class AlwaysRemotePolicy(_FixedPolicy):
    """Always disaggregated, least-loaded workers; local ("no_prefill_worker") when no prefill worker is healthy."""

    name = "always_remote"

    def place(self, request: RequestFeatures, state: PoolState) -> Placement:
        prefill, decode = _candidates(request, state)
        receivers = _receivers(state, decode)
        if not prefill or not receivers:
            return self._placement(request, state, "local", None, _least_decode(state, decode), "no_prefill_worker")
        return self._placement(request, state, "remote", _least_prefill(state, prefill),
                               _least_decode(state, receivers), "always_remote")


class AlwaysLocalPolicy(_FixedPolicy):
    """Never disaggregated: the least-loaded decode worker prefills locally."""

    name = "always_local"

    def place(self, request: RequestFeatures, state: PoolState) -> Placement:
        _, decode = _candidates(request, state)
        return self._placement(request, state, "local", None, _least_decode(state, decode), "always_local")


class RoundRobinPolicy(_FixedPolicy):
    """Alternates remote / local and rotates through the eligible workers of each pool (a baseline)."""

    name = "round_robin"

    def __init__(self, cost: CostModel) -> None:
        super().__init__(cost)
        self._turn = self._next_p = self._next_d = 0

    def place(self, request: RequestFeatures, state: PoolState) -> Placement:
        prefill, decode = _candidates(request, state)
        d = decode[self._next_d % len(decode)]
        self._next_d += 1
        remote, self._turn = self._turn % 2 == 0, self._turn + 1
        if not prefill or state.decode[d].local_only:
            return self._placement(request, state, "local", None, d, "no_prefill_worker")
        if not remote:
            return self._placement(request, state, "local", None, d, "round_robin")
        p = prefill[self._next_p % len(prefill)]
        self._next_p += 1
        return self._placement(request, state, "remote", p, d, "round_robin")


class RatioPolicy(Policy):
    """Cost-model placement (see the module docstring).

    Args:
        cost: the measured cost model.
        ttft_target_s: time-to-first-token SLO, seconds (> 0).
        tpot_target_s: time-per-output-token SLO, seconds (> 0).
    Their defaults are `RouterConfig`'s.
    """

    name = "ratio"

    def __init__(self, cost: CostModel, ttft_target_s: float, tpot_target_s: float) -> None:
        for field, value in (("ttft_target_s", ttft_target_s), ("tpot_target_s", tpot_target_s)):
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{field} must be a finite number > 0, got {value!r}")
        self.cost = cost
        self.ttft_target_s = ttft_target_s
        self.tpot_target_s = tpot_target_s

    def _priced(self, opt: _Option) -> _Option:
        cost = ((opt.ttft_s + opt.delay_s) / self.ttft_target_s + (opt.slowdown - 1.0) + opt.crowding
                + (opt.ttft_s > self.ttft_target_s) + (opt.tpot_s > self.tpot_target_s))
        return replace(opt, cost=float(cost))

    def place(self, request: RequestFeatures, state: PoolState) -> Placement:
        prefill, decode = _candidates(request, state)
        options = [_local(self.cost, request, state, d) for d in decode]
        if prefill:
            # remote cost only grows with P's queue, so the least-queued P is best for every D
            p = _least_prefill(state, prefill)
            options += [_remote(self.cost, request, state, p, d) for d in _receivers(state, decode)]
        options = [self._priced(_corrected(o, self.correction)) for o in options]

        def key(o: _Option) -> tuple:  # cheapest; ties: remote, then more free KV blocks, then lower index
            return o.cost, o.path != "remote", -state.decode[o.decode].free_blocks, o.decode

        best = min(options, key=key)
        others = [o for o in options if o.path != best.path]
        detail = best.describe() + (f" | best {min(others, key=key).describe()}" if others else "")
        reason = f"cheapest_{best.path}" if prefill else "no_prefill_worker"
        return Placement(best.path, best.prefill, best.decode, reason, best.ttft_s, best.tpot_s, detail, best.cost,
                         best.computed)


def make_policy(name: str, cost: CostModel, ttft_target_s: float | None = None,
                tpot_target_s: float | None = None, correction: Correction | None = None) -> Policy:
    """Args: name: one of POLICIES. cost: the measured cost model. ttft_target_s / tpot_target_s: SLOs
    (the ratio policy needs them; `RouterConfig` holds their defaults). correction: online factors
    (see `Policy`).
    Returns: the policy. Raises: ValueError for an unknown name (listing the allowed ones), or ratio without targets."""
    fixed = {"always_remote": AlwaysRemotePolicy, "always_local": AlwaysLocalPolicy, "round_robin": RoundRobinPolicy}
    if name == "ratio":
        if ttft_target_s is None or tpot_target_s is None:
            raise ValueError("the ratio policy needs its TTFT and TPOT targets")
        policy: Policy = RatioPolicy(cost, ttft_target_s, tpot_target_s)
    elif name in fixed:
        policy = fixed[name](cost)
    else:
        raise ValueError(f"unknown placement policy {name!r}; allowed: {', '.join(POLICIES)}")
    policy.correction = correction
    return policy
