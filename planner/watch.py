"""`pdserve plan --watch --address URL`: read a live server's metrics and recommend a new P:D split.

Each round: two readings of the server's `/metrics`, `interval_s` apart, give the traffic of that
window (requests that ended per second, their mean prompt and output tokens: the counters
`pdserve_requests_total`, `pdserve_prompt_tokens_total`, `pdserve_generation_tokens_total`) and the
layout now (workers and KV blocks per pool). A synthetic trace of that traffic (Poisson arrivals at
the measured rate, every request of the mean lengths: the counters hold no length distribution) is
simulated on the server's own cost model (`/pdserve/cost_model`) for every split of the same number of
workers (`planner.plan`), and the best is printed next to the current one.

Boundary rule: never imports Ray, no torch.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass

from planner.plan import Plan, PlanSpec, Slo, layouts_within, sweep
from planner.sim import Layout, WorkerSpec
from planner.traces import from_workload
from planner.validate import ServerLayout, fetch_text, metric_samples, server_layout
from router.cost_model import CostModel


@dataclass(frozen=True)
class Reading:
    """One /metrics reading. Args: at: time.monotonic(); requests: ended so far; prompt_tokens, output_tokens:
    counted so far; server: its layout."""

    at: float
    requests: float
    prompt_tokens: float
    output_tokens: float
    server: ServerLayout


def read(base: str) -> Reading:
    text = fetch_text(base.rstrip("/") + "/metrics")
    totals = {"pdserve_requests_total": 0.0, "pdserve_prompt_tokens_total": 0.0, "pdserve_generation_tokens_total": 0.0}
    for name, _, value in metric_samples(text):
        if name in totals:
            totals[name] += value
    return Reading(time.monotonic(), totals["pdserve_requests_total"], totals["pdserve_prompt_tokens_total"],
                   totals["pdserve_generation_tokens_total"], server_layout(text))


@dataclass(frozen=True)
class Traffic:
    """A window's traffic. Args: rate: requests/s; prompt_tokens, output_tokens: means per request."""

    rate: float
    prompt_tokens: int
    output_tokens: int


def traffic(first: Reading, second: Reading) -> Traffic | None:
    """The traffic between two readings; None when no request ended in between."""
    n = second.requests - first.requests
    if n <= 0 or second.at <= first.at:
        return None
    return Traffic(n / (second.at - first.at), max(1, round((second.prompt_tokens - first.prompt_tokens) / n)),
                   max(1, round((second.output_tokens - first.output_tokens) / n)))


@dataclass(frozen=True)
class Advice:
    """Args: current: the server's layout; traffic; plan: every split of its workers; current_goodput: the
    simulated goodput of the current layout (its best policy and batch limit among those swept)."""

    current: Layout
    traffic: Traffic
    plan: Plan
    current_goodput: float

    def text(self) -> str:
        rec = self.plan.recommended
        t = self.traffic
        head = (f"traffic: {t.rate:.3g} req/s, prompt {t.prompt_tokens} / output {t.output_tokens} tokens; "
                f"now {self.current.label}: simulated goodput {self.current_goodput:.3f} req/s")
        if rec is None:
            return head + "\n  no split serves this traffic within the targets: add workers or relax the targets"
        c = rec.candidate
        if c.layout == self.current:
            return head + f"\n  keep {self.current.label} (policy {c.policy})"
        return (head + f"\n  recommend {c.layout.label} (policy {c.policy}): simulated goodput "
                f"{rec.summary.goodput_rps:.3f} req/s")


def advise(base: str, cost: CostModel, slo: Slo, first: Reading, second: Reading, policies: tuple[str, ...],
           max_num_seqs: int, num_requests: int = 300) -> Advice | None:
    """Plan the window's traffic over every split of the server's workers. None: no traffic in the window."""
    t = traffic(first, second)
    if t is None:
        return None
    server = second.server
    trace = from_workload(f"fixed:{t.prompt_tokens}:{t.output_tokens}", num_requests, t.rate,
                          max_context=t.prompt_tokens + t.output_tokens)
    chunk = cost.prefill_chunk_tokens or WorkerSpec.prefill_chunk_tokens
    worker = WorkerSpec(server.decode_blocks, max_num_seqs=max_num_seqs, prefill_chunk_tokens=chunk)
    prefill = WorkerSpec(server.prefill_blocks, max_num_seqs=max_num_seqs, prefill_chunk_tokens=chunk) \
        if server.prefill_blocks else None
    plan = sweep(PlanSpec(trace, cost, slo, layouts_within(server.layout.workers), policies, (max_num_seqs,),
                          worker, prefill))
    now = [e.summary.goodput_rps for e in plan.evaluations if e.candidate.layout == server.layout]
    return Advice(server.layout, t, plan, max(now, default=0.0))


def watch(base: str, slo: Slo, policies: tuple[str, ...], max_num_seqs: int, interval_s: float = 60.0,
          rounds: int | None = None, out=print) -> None:
    """Advise every `interval_s` seconds (`rounds` times; None: until interrupted)."""
    if not interval_s > 0:
        raise ValueError(f"interval must be > 0 s, got {interval_s!r}")
    cost = CostModel.from_dict(json.loads(fetch_text(base.rstrip("/") + "/pdserve/cost_model")))
    last = read(base)
    done = 0
    while rounds is None or done < rounds:
        time.sleep(interval_s)
        now = read(base)
        advice = advise(base, cost, slo, last, now, policies, max_num_seqs)
        out(advice.text() if advice else f"no request ended in the last {interval_s:g} s: nothing to plan")
        last, done = now, done + 1
