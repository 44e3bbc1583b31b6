"""`pdserve plan --validate URL`: a trace on a running pdserve, beside its simulation on that server's profile.

A validated request lives twice: once simulated (`planner.sim`, on the cost model the server calibrated,
`GET /pdserve/cost_model`, and its layout and KV pools, read off `/metrics`), once sent to the server by
the load generator's client: a workload trace through `loadtest.runner.run_open_loop` with the same
seed (the same prompts and arrival times the simulation replays), any other trace each request at its
trace time. Both sides are summarised by `loadtest.metrics` against the same targets, and printed side
by side: TTFT p50 / p99, TPOT p50, goodput. The server runs as its operator started it: start it with
the layout to check and `--no-lend-threads` (the simulator does not lend threads between roles).

Boundary rule: never imports Ray, no torch.
"""
from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace

from loadtest.clients import make_client
from loadtest.records import RequestRecord
from loadtest.workload import RequestSpec, build_workload, safe_token_range
from planner.plan import Slo
from planner.profiles import AS_CALIBRATED, ServingFactors
from planner.sim import Layout, SimResult, Summary, WorkerSpec, prompt_ids, simulate
from planner.traces import Trace
from router.config import RouterConfig
from router.cost_model import CostModel


@dataclass(frozen=True)
class ServerLayout:
    """What a running server's /metrics tells of its pools. Args: layout; decode_blocks / prefill_blocks:
    KV blocks per worker (the first worker's; 0 without prefill workers); policy: the placement policy that
    placed most requests so far (None before any)."""

    layout: Layout
    decode_blocks: int
    prefill_blocks: int
    policy: str | None


def fetch_text(url: str, timeout_s: float = 10.0, api_key: str | None = None) -> str:
    """GET `url` (with `api_key` as a bearer token). Raises: ValueError naming it when it cannot be read."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout_s) as r:
            return r.read().decode()
    except OSError as e:
        raise ValueError(f"cannot read {url}: {e}") from None


def metric_samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Prometheus text → (sample name, labels, value) for every sample."""
    from prometheus_client.parser import text_string_to_metric_families

    return [(s.name, s.labels, s.value) for fam in text_string_to_metric_families(text) for s in fam.samples]


def server_layout(metrics_text: str) -> ServerLayout:
    """Args: a pdserve /metrics page. Raises: ValueError when it shows no decode worker."""
    blocks: dict[str, dict[str, float]] = {"prefill": {}, "decode": {}}
    decisions: Counter[str] = Counter()
    for name, labels, value in metric_samples(metrics_text):
        if name == "pdserve_kv_blocks_total" and labels.get("pool") in blocks:
            blocks[labels["pool"]][labels.get("worker", "")] = value
        elif name == "pdserve_placement_decisions_total" and labels.get("reason") != "recovery":
            decisions[labels.get("policy", "")] += value
    if not blocks["decode"]:
        raise ValueError("the server's /metrics shows no decode worker (pdserve_kv_blocks_total{pool=\"decode\"})")
    first = {pool: int(next(iter(b.values()))) if b else 0 for pool, b in blocks.items()}
    policy = decisions.most_common(1)[0][0] if decisions else None
    return ServerLayout(Layout(len(blocks["prefill"]), len(blocks["decode"])), first["decode"], first["prefill"],
                        policy or None)


def engine_totals(metrics_text: str) -> dict[str, dict[str, float]]:
    """A /metrics page's `pdserve_engine_*` series, by pool, summed over its workers, by series and kind:
    e.g. {"decode": {"step_seconds:decode": ..., "steps:mixed": ..., "busy_seconds": ...}, "prefill": ...}."""
    out: dict[str, dict[str, float]] = {}
    for name, labels, value in metric_samples(metrics_text):
        if name.startswith("pdserve_engine_") and name.endswith("_total") and "pool" in labels:
            key = name[len("pdserve_engine_"):-len("_total")] + (f":{labels['kind']}" if "kind" in labels else "")
            pool = out.setdefault(labels["pool"], {})
            pool[key] = pool.get(key, 0.0) + value
    return out


def _grown(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


MIN_BESIDE_SHARE = 0.2  # of a run's prefill steps beside decode, to measure what that costs (`ServedSteps`)
MIN_LOCAL_STEPS = 4  # decode workers' prompt steps, to measure their own `prefill` factor beside it


@dataclass(frozen=True)
class ServedSteps:
    """The workers' engine steps during a run (what `pdserve_engine_*` grew by), beside the cost model.
    Decode workers' decode-only steps: how many, their mean batch and context, seconds each took in the
    engine and what the cost model gives for that batch and context (`CostModel.decode_s`), and the engine
    loop's seconds per step beyond the steps themselves (scheduling, outputs, the feed, commands). Steps that computed prompt chunks, on
    either pool: how many, their seconds in all and the cost model's for the same steps (`prefill_s` of
    each pool's mean chunk on a prefill worker, `local_prefill_s` on a decode worker, plus the ride of the
    decode rows beside a decode worker's chunks: the simulator's price for such steps); and each pool's
    apart: the decode workers' prompt steps (`local_*`), the prefill workers' with the cost model's time
    for them alone (`remote_*`) and the share of them the simulation ran beside a decode worker's."""

    decode_steps: int
    mean_batch: float
    step_s: float
    model_step_s: float
    prefill_steps: int
    between_steps_s: float
    prefill_s: float = 0.0
    model_prefill_s: float = 0.0
    mean_context: float = 0.0  # tokens of context a decode-only step's rows held in all
    local_prefill_steps: int = 0
    local_prefill_s: float = 0.0
    model_local_prefill_s: float = 0.0  # their prompt tokens and the ride of the decode rows beside them
    local_mixed_steps: int = 0  # of them, the steps that carried decode rows too
    remote_prefill_s: float = 0.0
    model_remote_alone_s: float = 0.0
    remote_beside_share: float = 0.0

    @staticmethod
    def of(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]], cost: CostModel,
           beside: tuple[float, float] = (0.0, 0.0)) -> ServedSteps | None:
        """Args: before / after: `engine_totals` of each pool ("decode", "prefill"). beside: the shares of the
        prefill workers' steps and of the decode workers' decode-only steps that computed while the other
        pool did (`SimResult.beside` of the run simulated): the cost model's time for them is the calibrated
        one stretched that often by `prefill_beside_decode` / `decode_beside_prefill`. None when the decode
        workers ran no decode-only step (or report no step totals)."""
        grew = _grown(before.get("decode", {}), after.get("decode", {}))
        steps, local_steps = int(grew.get("steps:decode", 0)), int(grew.get("steps:prefill", 0))
        if steps <= 0:
            return None
        batch, context = grew.get("step_tokens:decode", 0.0) / steps, grew.get("step_tokens:context", 0.0) / steps
        seconds = grew.get("step_seconds:decode", 0.0)
        between = grew.get("busy_seconds", 0.0) - seconds - grew.get("step_seconds:prefill", 0.0)
        remote = _grown(before.get("prefill", {}), after.get("prefill", {}))

        def prompt_steps(totals: dict[str, float], time_of: Callable[[float], float]) -> tuple[int, float, float]:
            """Steps with prompt tokens, their seconds, the cost model's for them (`time_of` a mean chunk's:
            the fits are linear in tokens, so n steps of the mean chunk cost what the steps cost)."""
            n = int(totals.get("steps:prefill", 0))
            if n <= 0:
                return 0, 0.0, 0.0
            return n, totals.get("step_seconds:prefill", 0.0), n * time_of(totals.get("step_tokens:prompt", 0.0) / n)
        n_local, local_s, model_local_s = prompt_steps(grew, cost.local_prefill_s)
        n_mixed = int(grew.get("steps:mixed", 0))
        if n_mixed > 0:  # what the decode rows beside their prompt chunks add (`decode_ride`; the simulator's)
            model_local_s += n_mixed * cost.step_s(grew.get("step_tokens:ride", 0.0) / n_mixed) * cost.decode_ride
        n_remote, remote_s, remote_alone_s = prompt_steps(remote, cost.prefill_s)
        model_prefill_s = model_local_s + remote_alone_s * cost.beside("prefill", beside[0])
        model_step_s = cost.decode_s(batch, context) * cost.beside("decode", beside[1])
        return ServedSteps(steps, batch, seconds / steps, model_step_s, n_local + n_remote,
                           max(0.0, between) / (steps + local_steps), local_s + remote_s, model_prefill_s, context,
                           local_prefill_steps=n_local, local_prefill_s=local_s, model_local_prefill_s=model_local_s,
                           local_mixed_steps=n_mixed, remote_prefill_s=remote_s, model_remote_alone_s=remote_alone_s,
                           remote_beside_share=beside[0] if n_remote else 0.0)

    @property
    def factor(self) -> float:
        """What a served decode step took, the loop's time between steps included, over the cost model's."""
        return (self.step_s + self.between_steps_s) / self.model_step_s

    @property
    def extra_step_s(self) -> float:
        """What a served decode step took, the loop's time between steps included, beyond the cost model's."""
        return self.step_s + self.between_steps_s - self.model_step_s

    @property
    def _mixed_extra_s(self) -> float:
        """What the simulator adds to the decode workers' steps with prompt chunks and decode rows beyond
        the cost model's: `decode_step_s` each, where that is what `factors` fits."""
        return self.local_mixed_steps * max(0.0, self.extra_step_s)

    @property
    def prefill_factor(self) -> float | None:
        """What the served prompt steps took over the cost model's time for them, net of what the simulator
        adds to the steps that carried decode rows: the serving factor `prefill` of this run (None without
        prompt steps)."""
        return (self.prefill_s - self._mixed_extra_s) / self.model_prefill_s if self.model_prefill_s > 0 else None

    def prefill_factors(self, base: ServingFactors) -> tuple[float, float]:
        """(`prefill`, `prefill_beside`) of this run. Where at least `MIN_BESIDE_SHARE` of the prefill workers'
        steps ran beside a decode worker's: `prefill` from the decode workers' prompt steps (`base`'s with
        fewer than `MIN_LOCAL_STEPS`), and `prefill_beside` what the prefill workers' steps took beyond that,
        all of it put on the share beside (start-up times each engine alone, and beside the other with
        nothing else running: served, with the router streaming the decode worker's tokens on the same
        cores, a 128-token prompt's steps took 1.2-1.5x their time alone, not 1.0-1.1x). Otherwise
        `prefill` from every prompt step, and `base`'s `prefill_beside`."""
        if self.remote_beside_share < MIN_BESIDE_SHARE or self.model_remote_alone_s <= 0:
            return self.prefill_factor or base.prefill, base.prefill_beside
        prefill = ((self.local_prefill_s - self._mixed_extra_s) / self.model_local_prefill_s
                   if self.local_prefill_steps >= MIN_LOCAL_STEPS else base.prefill)
        over = self.remote_prefill_s / (self.model_remote_alone_s * prefill)
        return prefill, max(1.0, 1 + (over - 1) / self.remote_beside_share)

    def factors(self, base: ServingFactors) -> ServingFactors:
        """`base` with this run's decode steps (and `prefill` and `prefill_beside`, where prompts were computed,
        `prefill_factors`). What a served decode step adds is a time per step (`decode_step_s`, with `decode`
        1): on a 2-core AVX2 machine it stayed at 18-23 ms across loads of mean batch 1.0-3.7, where a factor
        on the step spread over 1.30-1.52. Served steps faster than the cost model's take a factor below 1
        instead."""
        prefill, beside = self.prefill_factors(base)
        base = replace(base, prefill=prefill, prefill_beside=beside)
        if self.extra_step_s >= 0:
            return replace(base, decode=1.0, decode_step_s=self.extra_step_s)
        return replace(base, decode=self.factor, decode_step_s=0.0)

    def describe(self) -> str:
        prompt = (f"; {self.prefill_steps} steps with prompt chunks, {self.prefill_s:.1f} s (cost model "
                  f"{self.model_prefill_s:.1f} s: x{self.prefill_factor:.2f})" if self.prefill_factor else "")
        if self.model_remote_alone_s > 0:
            prompt += (f"; the prefill workers' x{self.remote_prefill_s / self.model_remote_alone_s:.2f} their time "
                       f"alone, {self.remote_beside_share:.0%} of them simulated beside a decode worker")
        return (f"served steps: {self.decode_steps} decode-only at mean batch {self.mean_batch:.1f} and context "
                f"{self.mean_context / max(self.mean_batch, 1e-9):.0f} tokens a row, "
                f"{self.step_s * 1e3:.1f} ms each in the engine and {self.between_steps_s * 1e3:.1f} ms between "
                f"steps (cost model {self.model_step_s * 1e3:.1f} ms: {self.extra_step_s * 1e3:+.1f} ms, x{self.factor:.2f})"
                + prompt)


MAX_CLASSES = 4  # a trace of more request shapes (prompt / output lengths) than this is compared as a whole only


@dataclass(frozen=True)
class ClassComparison:
    """One request shape of a trace of few: its prompt and output tokens, and the simulated and measured
    summaries of its requests alone (each over the whole run's wall time)."""

    prompt_tokens: int
    output_tokens: int
    simulated: Summary
    measured: Summary


def by_class(simulated: list[RequestRecord], sim_wall_s: float, measured: list[RequestRecord], meas_wall_s: float,
             ttft_target_s: float | None, tpot_target_s: float | None) -> tuple[ClassComparison, ...]:
    """Both runs' requests grouped by their shape (prompt tokens, requested output tokens), most requests
    first: a median over a mix of shapes can sit between theirs, and one shape's figures can be right
    while the mix's move. Empty for one shape, or more than `MAX_CLASSES`."""
    def groups(records: list[RequestRecord]) -> dict[tuple[int, int], list[RequestRecord]]:
        out: dict[tuple[int, int], list[RequestRecord]] = {}
        for r in records:
            out.setdefault((r.prompt_tokens, r.requested_output_tokens), []).append(r)
        return out
    sim, meas = groups(simulated), groups(measured)
    shapes = sorted(sim, key=lambda k: (-len(sim[k]), k))
    if not 1 < len(shapes) <= MAX_CLASSES:
        return ()
    return tuple(ClassComparison(p, o, Summary.of(sim[(p, o)], sim_wall_s, ttft_target_s, tpot_target_s),
                                 Summary.of(meas.get((p, o), []), meas_wall_s, ttft_target_s, tpot_target_s))
                 for p, o in shapes)


@dataclass(frozen=True)
class Comparison:
    """Args: simulated / measured: the two summaries; layout; policy; factors: the serving factors the
    simulation ran with; plain: the same simulation with none (when `factors` are not 1); served: the
    workers' steps during the run; at_served: the simulation with the decode step time and `prefill`
    factor those steps measured (`ServedSteps.factors`; what is left between it and the measured run is
    the simulator's and the latency's, not the step times'); classes: each request shape's apart (`by_class`);
    simulated_records / measured_records: each request of both runs, in trace order (`--out` writes them)."""

    simulated: Summary
    measured: Summary
    layout: Layout
    policy: str
    factors: ServingFactors = AS_CALIBRATED
    plain: Summary | None = None
    served: ServedSteps | None = None
    at_served: Summary | None = None
    classes: tuple[ClassComparison, ...] = ()
    simulated_records: tuple[RequestRecord, ...] = ()
    measured_records: tuple[RequestRecord, ...] = ()

    def measured_factors(self) -> ServingFactors | None:
        """The serving factors that would have matched this run. With the served steps (`served`, and the
        simulation with their factors, `at_served`): their decode step time and `prefill` (`ServedSteps.factors`),
        and `latency_s` grown by measured minus `at_served` TTFT p50. Without them: the simulation's, with
        `latency_s` grown by measured minus simulated TTFT p50 and `decode` times measured / simulated
        TPOT p50. `latency_s` stays >= 0; a quantity without values keeps its factor. Measure them on one
        run (a light load) and plan or validate others with them. None when the run had no served request."""
        meas, f = self.measured, self.factors
        if self.served is not None and self.at_served is not None:
            sim, fitted = self.at_served, self.served.factors(f)
        else:
            sim, fitted = self.simulated, f
            if sim.tpot_p50_s and meas.tpot_p50_s:
                fitted = replace(f, decode=f.decode * meas.tpot_p50_s / sim.tpot_p50_s)
        if not meas.ok or not sim.ok:
            return None
        latency = f.latency_s
        if sim.ttft_p50_s is not None and meas.ttft_p50_s is not None:
            latency = max(0.0, latency + meas.ttft_p50_s - sim.ttft_p50_s)
        return replace(fitted, latency_s=latency)

    def table(self) -> str:
        rows = [("TTFT p50 (ms)", "ttft_p50_s", 1e3), ("TTFT p99 (ms)", "ttft_p99_s", 1e3),
                ("TPOT p50 (ms)", "tpot_p50_s", 1e3), ("goodput (req/s)", "goodput_rps", 1.0),
                ("within SLO", "good_fraction", 100.0)]
        others = [(name, other) for name, other in (("factors 1", self.plain), ("served steps", self.at_served))
                  if other is not None]
        lines = [f"validation on {self.layout.label}, policy {self.policy}",
                 f"{'':<18}{'simulated':>12}{'measured':>12}{'sim/meas':>10}"
                 + "".join(f"{name:>14}{'sim/meas':>10}" for name, _ in others)]
        for label, field, scale in rows:
            sim, meas = getattr(self.simulated, field), getattr(self.measured, field)
            line = f"{label:<18}{_fmt(sim, scale):>12}{_fmt(meas, scale):>12}{_ratio(sim, meas):>10}"
            for _, other in others:
                value = getattr(other, field)
                line += f"{_fmt(value, scale):>14}{_ratio(value, meas):>10}"
            lines.append(line)
        if self.classes:
            lines.append("by request shape (prompt / output tokens), ms:")
        for c in self.classes:
            for label, field in (("TTFT p50", "ttft_p50_s"), ("TPOT p50", "tpot_p50_s")):
                sim, meas = getattr(c.simulated, field), getattr(c.measured, field)
                lines.append(f"{f'  {c.prompt_tokens}/{c.output_tokens} {label}':<18}"
                             f"{_fmt(sim, 1e3):>12}{_fmt(meas, 1e3):>12}{_ratio(sim, meas):>10}")
        fitted = self.measured_factors()
        lines.append(f"serving factors simulated: {self.factors.describe()}; matching this run: "
                     f"{fitted.describe() if fitted else '-'}")
        if self.served is not None:
            lines.append(self.served.describe())
        return "\n".join(lines)


def _ratio(sim: float | None, meas: float | None) -> str:
    return f"{sim / meas:.2f}" if sim is not None and meas else "-"


def _fmt(v: float | None, scale: float) -> str:
    return "-" if v is None else f"{v * scale:.3f}" if scale == 1.0 else f"{v * scale:.1f}"


def trace_specs(trace: Trace, vocab_size: int) -> list[RequestSpec]:
    """Requests to send for a trace: token-id prompts of its lengths, in the vocabulary's safe range, the
    same ids where the simulation's prompts are the same (shared prefixes stay shared)."""
    lo, hi = safe_token_range(vocab_size)
    out = []
    for i, r in enumerate(trace.requests):
        ids = prompt_ids(r, i, trace.hash_block_tokens)
        salt = (i + 1) * 7919 if not (r.hash_ids or r.prompt_ids) else 0  # a prompt of its own: ids of its own
        out.append(RequestSpec(i, r.prompt_tokens, r.output_tokens,
                               prompt_token_ids=tuple(lo + (abs(t) * 31 + salt) % (hi - lo) for t in ids)))
    return out


async def _replay(base: str, specs: list[RequestSpec], arrivals: list[float], timeout_s: float,
                  ) -> tuple[list[RequestRecord], float]:
    """Send each spec at its arrival time (open loop). Returns the records and the run's wall time."""
    client = make_client("openai", base, timeout_s=timeout_s)
    t0 = time.perf_counter()

    async def one(spec: RequestSpec, at: float) -> RequestRecord:
        start = time.perf_counter() - t0
        rec = await client.send(spec)
        rec.start_s, rec.scheduled_s = start, at
        return rec
    try:
        tasks = []
        for spec, at in zip(specs, arrivals):
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
            tasks.append(asyncio.create_task(one(spec, at)))
        records = list(await asyncio.gather(*tasks))
    finally:
        await client.aclose()
    return records, time.perf_counter() - t0


async def _workload_run(base: str, name: str, n: int, rate: float, seed: int, vocab_size: int,
                        timeout_s: float) -> tuple[list[RequestRecord], float]:
    from loadtest.runner import run_open_loop

    specs = build_workload(name, n, seed, vocab_size=vocab_size)
    client = make_client("openai", base, timeout_s=timeout_s)
    try:
        run = await run_open_loop(client, specs, rate, seed, progress=False)
    finally:
        await client.aclose()
    return run.records, run.wall_time_s


@dataclass(frozen=True)
class WorkloadRef:
    """The load generator workload a trace was built from (`planner.traces.from_workload`'s arguments)."""

    name: str
    num_requests: int
    rate: float
    seed: int


def simulate_server(trace: Trace, cost: CostModel, server: ServerLayout, policy: str, slo: Slo, max_num_seqs: int,
                    factors: ServingFactors = AS_CALIBRATED) -> Summary:
    """`trace` simulated on a server's own pools (`server`, from its /metrics), cost model and placement
    policy, summarised against `slo`. max_num_seqs: the server's `--max-num-seqs`."""
    return simulate_server_run(trace, cost, server, policy, slo, max_num_seqs, factors).summary(slo.ttft_s, slo.tpot_s)


def simulate_server_run(trace: Trace, cost: CostModel, server: ServerLayout, policy: str, slo: Slo,
                        max_num_seqs: int, factors: ServingFactors = AS_CALIBRATED) -> SimResult:
    """As `simulate_server`, the whole simulated run."""
    decode = WorkerSpec(server.decode_blocks, max_num_seqs=max_num_seqs,
                        prefill_chunk_tokens=cost.prefill_chunk_tokens or WorkerSpec.prefill_chunk_tokens)
    prefill = WorkerSpec(server.prefill_blocks, max_num_seqs=max_num_seqs,
                         prefill_chunk_tokens=decode.prefill_chunk_tokens) if server.prefill_blocks else None
    router = RouterConfig(policy=policy, ttft_target_s=slo.ttft_s, tpot_target_s=slo.tpot_s)
    return simulate(trace, cost, server.layout, decode, router, prefill_worker=prefill, factors=factors)


def validate(base: str, trace: Trace, slo: Slo, max_num_seqs: int, vocab_size: int = 49152,
             workload: WorkloadRef | None = None, request_timeout_s: float = 300.0,
             fallback_policy: str = RouterConfig().policy, factors: ServingFactors = AS_CALIBRATED) -> Comparison:
    """Run `trace` on the server at `base` (http://HOST:PORT) and simulate it on the server's own profile.

    Args: slo: the targets both sides are counted against. max_num_seqs: the server's `--max-num-seqs`
    (not in its metrics). vocab_size: the model's (token-id prompts). workload: how the trace was built,
    to send it through the load generator's own open loop. fallback_policy: the policy simulated when the
    server's metrics name none (the server placed nothing yet). factors: the simulation's serving factors
    (`ServingFactors`; the comparison also gives the ones that would have matched the run)."""
    cost = CostModel.from_dict(json.loads(fetch_text(base.rstrip("/") + "/pdserve/cost_model")))
    metrics_before = fetch_text(base.rstrip("/") + "/metrics")
    before = server_layout(metrics_before)
    if workload is not None:
        records, wall = asyncio.run(_workload_run(base, workload.name, workload.num_requests, workload.rate,
                                                  workload.seed, vocab_size, request_timeout_s))
    else:
        records, wall = asyncio.run(_replay(base, trace_specs(trace, vocab_size),
                                            [r.arrival_s for r in trace.requests], request_timeout_s))
    metrics_after = fetch_text(base.rstrip("/") + "/metrics")
    after = server_layout(metrics_after)
    policy = after.policy or before.policy or fallback_policy

    def simulated(with_factors: ServingFactors) -> Summary:
        return simulate_server(trace, cost, before, policy, slo, max_num_seqs, with_factors)

    main = simulate_server_run(trace, cost, before, policy, slo, max_num_seqs, factors)
    # the served steps against the prices the simulation ran with (`prefill_beside` in place of the calibrated one)
    served = ServedSteps.of(engine_totals(metrics_before), engine_totals(metrics_after), factors.applied(cost),
                            main.beside)
    plain = simulated(AS_CALIBRATED) if factors != AS_CALIBRATED else None
    at_served = simulated(served.factors(factors)) if served is not None else None
    sim_records = main.records()
    classes = by_class(sim_records, main.wall_time_s, records, wall, slo.ttft_s, slo.tpot_s)
    return Comparison(main.summary(slo.ttft_s, slo.tpot_s), Summary.of(records, wall, slo.ttft_s, slo.tpot_s),
                      before.layout, policy, factors, plain, served, at_served, classes, tuple(sim_records),
                      tuple(sorted(records, key=lambda r: r.index)))
