"""`pdserve plan --watch --address URL [--apply]`: read a live server's metrics, recommend a new P:D split,
and with `--apply` pin it through the server's role flips.

Each round: two readings of the server's `/metrics`, `interval_s` apart, give the traffic of that
window (requests that ended per second, their mean prompt and output tokens: the counters
`pdserve_requests_total`, `pdserve_prompt_tokens_total`, `pdserve_generation_tokens_total`) and the
layout now: the workers per pool and their KV blocks, and the role split (`GET /pdserve/split`,
`router.split`): while an operator pinned it, N prefill workers prefill and the others count as
decode workers (a flipped worker's flex slot has half its KV pool; the simulation gives it a decode
worker's). A synthetic trace of that traffic (Poisson arrivals at the measured rate, every request
of the mean lengths: the counters hold no length distribution) is simulated on the server's own cost
model (`/pdserve/cost_model`) for every split of the same number of workers (`planner.plan`), and the
best is printed next to the current one.

With `apply` (`--apply`), `decide` then looks at the recommendation: one that differs from the
layout now is pinned with `POST /pdserve/split {"prefill": P}` (the server's other prefill workers
flip to decode; nothing in flight moves), unless the server cannot hold it (`RoleSplit.check`, the
server's own rule: started without `--flip-roles`, or P over its prefill workers: a decode worker
cannot take the prefill role). Each round prints what was applied or why not. A pin stays until the
next one, or `DELETE /pdserve/split` (automatic flips again). Every request carries `api_key`.

Boundary rule: never imports Ray, no torch.
"""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from engine.errors import InvalidRequestError
from planner.plan import Plan, PlanSpec, Slo, layouts_within, sweep
from planner.sim import Layout, WorkerSpec
from planner.traces import from_workload
from planner.validate import ServerLayout, fetch_text, metric_samples, server_layout
from router.cost_model import CostModel
from router.split import RoleSplit, SplitUnavailable


@dataclass(frozen=True)
class Reading:
    """One /metrics reading. Args: at: time.monotonic(); requests: ended so far; prompt_tokens, output_tokens:
    counted so far; server: its layout."""

    at: float
    requests: float
    prompt_tokens: float
    output_tokens: float
    server: ServerLayout


def read(base: str, api_key: str | None = None) -> Reading:
    text = fetch_text(base.rstrip("/") + "/metrics", api_key=api_key)
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
           max_num_seqs: int, num_requests: int = 300, current: Layout | None = None) -> Advice | None:
    """Plan the window's traffic over every split of the server's workers; `current`: the layout now (default:
    its pools as started). None: no traffic in the window."""
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
    current = current or server.layout
    now = [e.summary.goodput_rps for e in plan.evaluations if e.candidate.layout == current]
    return Advice(current, t, plan, max(now, default=0.0))


def read_split(base: str, api_key: str | None = None) -> RoleSplit:
    """The server's role split (`GET /pdserve/split`). Raises ValueError when it cannot be read."""
    url = base.rstrip("/") + "/pdserve/split"
    try:
        return RoleSplit.from_json(json.loads(fetch_text(url, api_key=api_key)))
    except ValueError as e:
        raise ValueError(f"{url}: {e}") from None


def current_layout(server: ServerLayout, split: RoleSplit) -> Layout:
    """The layout now: the pools as started, or with the pinned split, its prefill role count beside the rest."""
    if split.pinned is None:
        return server.layout
    return Layout(split.pinned, server.layout.workers - split.pinned)


@dataclass(frozen=True)
class Decision:
    """What `--apply` does with a round's advice. Args: prefill: the prefill role count to pin, None: nothing
    to send; reason: why (printed)."""

    prefill: int | None
    reason: str


def decide(advice: Advice, split: RoleSplit) -> Decision:
    """Pin the recommendation when it differs from the layout now and the server can hold it (`RoleSplit.check`)."""
    rec = advice.plan.recommended
    if rec is None:
        return Decision(None, "nothing to apply: no split serves this traffic within the targets")
    layout = rec.candidate.layout
    if layout == advice.current:
        return Decision(None, f"nothing to apply: the server runs {layout.label} already")
    try:
        split.check(layout.prefill)
    except (SplitUnavailable, InvalidRequestError) as e:
        return Decision(None, f"cannot apply {layout.label}: {e}")
    return Decision(layout.prefill, f"pin {layout.label} (prefill role: {layout.prefill})")


class SplitRefused(ValueError):
    """The server answered a split with an error (its message)."""


def send_split(base: str, prefill: int | None, api_key: str | None = None, timeout_s: float = 10.0) -> RoleSplit:
    """`POST /pdserve/split {"prefill": prefill}`; the server's split then. Raises SplitRefused with the
    server's message (400, 401, 409), ValueError when it cannot be reached."""
    url = base.rstrip("/") + "/pdserve/split"
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
    req = urllib.request.Request(url, json.dumps({"prefill": prefill}).encode(), headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return RoleSplit.from_json(json.loads(r.read()))
    except urllib.error.HTTPError as e:
        try:
            message = json.loads(e.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = e.reason
        hint = " (give the server's key: --api-key or $PDSERVE_API_KEY)" if e.code == 401 else ""
        raise SplitRefused(f"HTTP {e.code}: {message}{hint}") from None
    except OSError as e:
        raise ValueError(f"cannot reach {url}: {e}") from None


def apply_decision(base: str, decision: Decision, api_key: str | None = None) -> str:
    """Send the decision (if it pins anything); what was done, or why not."""
    if decision.prefill is None:
        return decision.reason
    try:
        split = send_split(base, decision.prefill, api_key)
    except SplitRefused as e:
        return f"not applied ({decision.reason}): the server refused it: {e}"
    return f"applied: {decision.reason}; the server now: {split.describe()}"


def watch(base: str, slo: Slo, policies: tuple[str, ...], max_num_seqs: int, interval_s: float = 60.0,
          rounds: int | None = None, out=print, *, pin: bool = False, api_key: str | None = None) -> None:
    """Advise every `interval_s` seconds (`rounds` times; None: until interrupted); with `pin`, apply each
    round's recommendation (`decide`, `apply_decision`)."""
    if not interval_s > 0:
        raise ValueError(f"interval must be > 0 s, got {interval_s!r}")
    cost = CostModel.from_dict(json.loads(fetch_text(base.rstrip("/") + "/pdserve/cost_model", api_key=api_key)))
    last = read(base, api_key)
    done = 0
    while rounds is None or done < rounds:
        time.sleep(interval_s)
        now = read(base, api_key)
        split = read_split(base, api_key)
        advice = advise(base, cost, slo, last, now, policies, max_num_seqs, current=current_layout(now.server, split))
        if advice is None:
            out(f"no request ended in the last {interval_s:g} s: nothing to plan")
        else:
            out(advice.text())
            if pin:
                out("  " + apply_decision(base, decide(advice, split), api_key))
        last, done = now, done + 1
