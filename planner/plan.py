"""`pdserve plan`: sweep layouts, policies and batch limits over a trace; recommend the best goodput.

Each candidate (P prefill workers : D decode workers within the budget, a placement policy, a decode
batch limit) runs the whole trace in `planner.sim`: every simulated request arrives, is placed and
booked by the router's own policy and book, prefilled and decoded by the engine's own scheduler, timed
by the cost model. Goodput is the requests served within both the TTFT and the TPOT target per
second of the run (`loadtest.metrics`, as the load generator counts it). The recommendation is the
candidate with the highest goodput (ties: more requests within the targets, then the lower TTFT
p99, then fewer prefill workers). Before any simulation, targets no layout can meet (below what the
cost model gives the trace's shortest prompt, or one decode step, with nothing else running) are
refused with a message saying so.

Boundary rule: never imports Ray, no torch.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from planner.profiles import AS_CALIBRATED, ServingFactors
from planner.sim import Layout, SimResult, Summary, WorkerSpec, simulate
from planner.traces import Trace
from router.config import RouterConfig
from router.cost_model import CostModel
from router.policy import POLICIES

FORMAT = "pdserve-plan/1"
_ROUTER = RouterConfig()


class ImpossibleSlo(ValueError):
    """A target no layout can meet on this cost model (the message says why)."""


@dataclass(frozen=True)
class Slo:
    """Args: ttft_s, tpot_s: the targets, seconds (> 0). Defaults: `RouterConfig`'s."""

    ttft_s: float = _ROUTER.ttft_target_s
    tpot_s: float = _ROUTER.tpot_target_s

    def __post_init__(self) -> None:
        for name in ("ttft_s", "tpot_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0 seconds, got {value!r}")


def unloaded_ttft_s(cost: CostModel, prompt_tokens: int) -> float:
    """The least TTFT the cost model gives a prompt: alone on an idle pool, the cheaper path."""
    local = cost.local_prefill_s(prompt_tokens)
    remote = cost.prefill_s(prompt_tokens) + cost.exposed_transfer_s(prompt_tokens, whole=True) + cost.hop_s
    return min(local, remote)


def check_slo(trace: Trace, cost: CostModel, slo: Slo) -> list[str]:
    """Raises ImpossibleSlo when no request of the trace can meet a target on any layout. Returns notes:
    the share of requests that cannot meet the TTFT target even alone."""
    shortest = min(r.prompt_tokens for r in trace.requests)
    best = unloaded_ttft_s(cost, shortest)
    if slo.ttft_s < best:
        raise ImpossibleSlo(
            f"TTFT target {slo.ttft_s:g} s is impossible: the cost model's fastest first token for the trace's "
            f"shortest prompt ({shortest} tokens), alone on an idle pool, takes {best:.4g} s "
            f"(local prefill {cost.local_prefill_s(shortest):.4g} s, remote prefill + exposed transfer + hops "
            f"{cost.prefill_s(shortest) + cost.exposed_transfer_s(shortest, whole=True) + cost.hop_s:.4g} s)")
    if any(r.output_tokens > 1 for r in trace.requests) and slo.tpot_s < cost.step_s(1):
        raise ImpossibleSlo(f"TPOT target {slo.tpot_s:g} s is impossible: one decode step of a single sequence "
                            f"takes {cost.step_s(1):.4g} s on this cost model")
    slow = sum(unloaded_ttft_s(cost, r.prompt_tokens) > slo.ttft_s for r in trace.requests)
    if slow:
        return [(f"{slow} of {len(trace.requests)} requests cannot meet the TTFT target even alone (their prompts "
                 f"take longer than {slo.ttft_s:g} s to prefill): goodput counts them as missed on every layout")]
    return []


@dataclass(frozen=True)
class Candidate:
    """Args: layout; policy: one of POLICIES; max_num_seqs: each worker's batch limit."""

    layout: Layout
    policy: str
    max_num_seqs: int

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")


@dataclass(frozen=True)
class Evaluation:
    """One candidate's simulation. Args: candidate; summary (against the plan's SLO); remote_share of the
    placed requests; mean_decode_batch; preemptions; refused: requests the router refused (400 / 429);
    sim_s: the simulation's CPU seconds."""

    candidate: Candidate
    summary: Summary
    remote_share: float
    mean_decode_batch: float
    preemptions: int
    refused: int
    sim_s: float

    @property
    def per_worker_goodput(self) -> float:
        return self.summary.goodput_rps / self.candidate.layout.workers

    def key(self) -> tuple:
        """Sort key, best first (see the module docstring)."""
        s = self.summary
        return (-s.goodput_rps, -s.good_fraction, s.ttft_p99_s if s.ttft_p99_s is not None else math.inf,
                self.candidate.layout.prefill)


@dataclass(frozen=True)
class PlanSpec:
    """What to sweep.

    Args:
        trace; cost: the profile; slo.
        layouts: the P:D splits to try (`layouts_within` a budget).
        policies: placement policies (a layout without prefill workers runs one: every policy prefills locally).
        max_num_seqs: batch limits to try.
        worker: the decode workers' engine limits (its max_num_seqs is replaced by each candidate's).
        prefill_worker: the prefill workers' (None: `worker`'s).
        router: admission settings (its policy and targets are replaced by the candidate's and the SLO).
        factors: how much longer than the cost model's times served steps take (`ServingFactors`).
    """

    trace: Trace
    cost: CostModel
    slo: Slo
    layouts: tuple[Layout, ...]
    policies: tuple[str, ...] = POLICIES
    max_num_seqs: tuple[int, ...] = (WorkerSpec.max_num_seqs,)
    worker: WorkerSpec | None = None
    prefill_worker: WorkerSpec | None = None
    router: RouterConfig = _ROUTER
    factors: ServingFactors = AS_CALIBRATED

    def __post_init__(self) -> None:
        for name in ("layouts", "policies", "max_num_seqs"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
            if not getattr(self, name):
                raise ValueError(f"{name} must not be empty")
        bad = [p for p in self.policies if p not in POLICIES]
        if bad:
            raise ValueError(f"unknown policies {bad}; allowed: {', '.join(POLICIES)}")
        if self.worker is None:
            object.__setattr__(self, "worker", WorkerSpec.from_memory(self.cost))

    def candidates(self) -> list[Candidate]:
        out = []
        for layout in self.layouts:
            policies = self.policies if layout.prefill else ("always_local" if "always_local" in self.policies
                                                             else self.policies[0],)
            out += [Candidate(layout, p, m) for p in policies for m in self.max_num_seqs]
        return out


def layouts_within(budget: int) -> tuple[Layout, ...]:
    """Every split of `budget` workers (>= 1) into P prefill and D >= 1 decode workers."""
    if budget < 1:
        raise ValueError(f"budget must be >= 1 worker, got {budget}")
    return tuple(Layout(p, budget - p) for p in range(budget))


def parse_layouts(text: str) -> tuple[Layout, ...]:
    """Args: "P:D,P:D,..." (e.g. "1:3,2:2"). Raises: ValueError naming the bad part."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            p, d = (int(x) for x in part.split(":"))
        except ValueError:
            raise ValueError(f"layout {part!r}: use PREFILL:DECODE, e.g. 1:3") from None
        out.append(Layout(p, d))
    if not out:
        raise ValueError(f"no layouts in {text!r}")
    return tuple(out)


def evaluate(spec: PlanSpec, candidate: Candidate) -> Evaluation:
    """Simulate one candidate over the trace."""
    t0 = time.process_time()
    worker = replace(spec.worker, max_num_seqs=candidate.max_num_seqs)
    prefill = replace(spec.prefill_worker, max_num_seqs=candidate.max_num_seqs) if spec.prefill_worker else None
    router = replace(spec.router, policy=candidate.policy, ttft_target_s=spec.slo.ttft_s,
                     tpot_target_s=spec.slo.tpot_s, flip_roles=False)
    result: SimResult = simulate(spec.trace, spec.cost, candidate.layout, worker, router, prefill_worker=prefill,
                                 factors=spec.factors)
    placed = sum(o.path is not None for o in result.outcomes)
    return Evaluation(candidate, result.summary(spec.slo.ttft_s, spec.slo.tpot_s),
                      result.remote / placed if placed else 0.0, result.mean_decode_batch, result.preemptions,
                      sum(o.error in ("invalid", "overloaded") for o in result.outcomes), time.process_time() - t0)


@dataclass(frozen=True)
class Plan:
    """Args: spec; evaluations: best first; notes: what the reader should know (impossible requests, ...)."""

    spec: PlanSpec
    evaluations: tuple[Evaluation, ...]
    notes: tuple[str, ...] = ()

    @property
    def recommended(self) -> Evaluation | None:
        """The best candidate, None when none served a request within the targets."""
        best = self.evaluations[0] if self.evaluations else None
        return best if best is not None and best.summary.goodput_rps > 0 else None

    def to_json(self) -> dict:
        """The plan as a JSON-ready document (format `FORMAT`)."""
        def ev(e: Evaluation) -> dict:
            c = e.candidate
            return {"layout": {"prefill": c.layout.prefill, "decode": c.layout.decode, "label": c.layout.label},
                    "policy": c.policy, "max_num_seqs": c.max_num_seqs, "summary": asdict(e.summary),
                    "per_worker_goodput_rps": e.per_worker_goodput, "remote_share": e.remote_share,
                    "mean_decode_batch": e.mean_decode_batch, "preemptions": e.preemptions, "refused": e.refused,
                    "sim_s": e.sim_s}
        spec, rec = self.spec, self.recommended
        return {"format": FORMAT, "trace": spec.trace.describe(), "slo": asdict(spec.slo),
                "cost_model": spec.cost.to_dict(), "worker": asdict(spec.worker),
                "prefill_worker": asdict(spec.prefill_worker) if spec.prefill_worker else None,
                "evaluations": [ev(e) for e in self.evaluations],
                "recommended": ev(rec) if rec else None, "notes": list(self.notes)}

    def table(self) -> str:
        """A text table, best first, and the recommendation."""
        def ms(v: float | None) -> str:
            return "-" if v is None else f"{v * 1e3:.0f}"
        head = (f"{'layout':<8}{'policy':<15}{'seqs':>5}{'goodput/s':>11}{'per wkr':>9}{'in SLO':>8}"
                f"{'TTFT p50':>10}{'TTFT p99':>10}{'TPOT p50':>10}{'remote':>8}{'batch':>7}{'refused':>8}")
        lines = [self.spec.trace.describe(),
                 f"SLO: TTFT <= {self.spec.slo.ttft_s:g} s, TPOT <= {self.spec.slo.tpot_s:g} s (times in ms)", head]
        for e in self.evaluations:
            c, s = e.candidate, e.summary
            lines.append(f"{c.layout.label:<8}{c.policy:<15}{c.max_num_seqs:>5}{s.goodput_rps:>11.3f}"
                         f"{e.per_worker_goodput:>9.3f}{s.good_fraction:>8.0%}{ms(s.ttft_p50_s):>10}"
                         f"{ms(s.ttft_p99_s):>10}{ms(s.tpot_p50_s):>10}{e.remote_share:>8.0%}"
                         f"{e.mean_decode_batch:>7.1f}{e.refused:>8}")
        lines += [f"note: {n}" for n in self.notes]
        rec = self.recommended
        if rec is None:
            lines.append("recommendation: none: no candidate served a request within both targets; relax the "
                         "targets, raise the budget or lower the load")
        else:
            c = rec.candidate
            lines.append(f"recommendation: {c.layout.prefill} prefill + {c.layout.decode} decode workers, policy "
                         f"{c.policy}, max_num_seqs {c.max_num_seqs}: goodput {rec.summary.goodput_rps:.3f} req/s "
                         f"({rec.summary.good_fraction:.0%} of requests within both targets)")
            lines.append(f"  pdserve serve --prefill {c.layout.prefill} --decode {c.layout.decode} --policy {c.policy} "
                         f"--max-num-seqs {c.max_num_seqs} --ttft-target {self.spec.slo.ttft_s:g} "
                         f"--tpot-target {self.spec.slo.tpot_s:g} --no-lend-threads")
        return "\n".join(lines)


def sweep(spec: PlanSpec, jobs: int = 1, progress: Callable[[Evaluation], None] | None = None) -> Plan:
    """Simulate every candidate (`jobs` processes at once). Raises ImpossibleSlo first when the SLO is."""
    notes = check_slo(spec.trace, spec.cost, spec.slo)
    candidates = spec.candidates()
    evaluations: list[Evaluation] = []
    if jobs > 1 and len(candidates) > 1:
        with ProcessPoolExecutor(min(jobs, len(candidates))) as pool:
            for e in pool.map(evaluate, [spec] * len(candidates), candidates):
                evaluations.append(e)
                if progress:
                    progress(e)
    else:
        for c in candidates:
            evaluations.append(evaluate(spec, c))
            if progress:
                progress(evaluations[-1])
    return Plan(spec, tuple(sorted(evaluations, key=Evaluation.key)), tuple(notes))


def plot(plan: Plan, path: str | Path) -> Path | None:
    """Goodput by layout, one bar per policy (its best batch limit). Returns the PNG, or None when
    matplotlib is not installed (the `bench` extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    layouts = list(dict.fromkeys(e.candidate.layout for e in sorted(plan.evaluations,
                                                                   key=lambda e: e.candidate.layout.prefill)))
    policies = list(dict.fromkeys(e.candidate.policy for e in plan.evaluations))
    best: dict[tuple[Layout, str], float] = {}
    for e in plan.evaluations:
        k = (e.candidate.layout, e.candidate.policy)
        best[k] = max(best.get(k, 0.0), e.summary.goodput_rps)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(layouts) * max(1, len(policies)) / 2), 4))
    width = 0.8 / max(1, len(policies))
    for j, policy in enumerate(policies):
        xs = [i + j * width for i in range(len(layouts))]
        ax.bar(xs, [best.get((lay, policy), 0.0) for lay in layouts], width, label=policy)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(layouts))], [lay.label for lay in layouts])
    ax.set_xlabel("layout (prefill : decode workers)")
    ax.set_ylabel("goodput (requests/s within SLO)")
    ax.set_title(f"simulated goodput, TTFT <= {plan.spec.slo.ttft_s:g} s, TPOT <= {plan.spec.slo.tpot_s:g} s")
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
