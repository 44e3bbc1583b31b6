"""The router's Prometheus metrics, in a registry of their own (`pdserve_` prefix).

Latencies are histograms in seconds; requests are counted by path and outcome, errors by kind,
placement decisions by policy, path and reason; per-worker gauges are refreshed from the workers'
load reports. The router process's own CPU time and memory are `pdserve_router_process_*`.

Every request-level metric (latencies, phases, request and token counts, errors, recoveries, attempt
failures, placement decisions, prompt / generation lengths, cached tokens, KV bytes moved, cost-model
error, requests in flight and queued) carries a `model_name` label, the served model name, as vLLM's
do: `Metrics(model_name=...)` binds it once (`Bound`), so call sites give only their other labels.
Per-worker series (`pool`, `worker`) do not carry it.

Besides the latencies, the series a dashboard reads most (vLLM's counterpart in brackets):
- `pdserve_kv_cache_usage_ratio{pool,worker}`: used / total KV blocks, 0..1 (`vllm:kv_cache_usage_perc`);
- `pdserve_prefix_cache_hit_tokens_total{path,worker}` with `pdserve_prompt_tokens_total`: prompt
  tokens served from a prefix cache (`vllm:prefix_cache_hits`);
- `pdserve_preemptions_total{pool,worker}`: sequences a worker's engine preempted (its KV freed, to
  be recomputed) for lack of KV blocks, from the workers' load reports (`vllm:num_preemptions`);
- `pdserve_request_prompt_tokens` / `pdserve_request_generation_tokens`: histograms of each ended
  request's prompt and output length (`vllm:request_prompt_tokens`, `..._generation_tokens`);
- `pdserve_request_attempt_failures_total{kind,pool}`: a worker's part of a request that failed and
  was recovered or ended the request, by `worker_core.protocol.ErrorKind` (`transfer_failed`: its KV
  never fully landed on the decode worker; `prefill_failed`: the prefill pass failed or its worker
  died; `worker_stopping`; `internal`: a decode worker died or failed) and the pool that failed;
- `pdserve_request_recoveries_total{action}`: what the router did next (retry: another prefill
  worker; local: prefill on the decode worker, by `--on-prefill-failure local` or as the fallback
  when no prefill worker is left; migrate: continued on another decode worker);
- `pdserve_engine_step_seconds_total{pool,worker,kind}`, `pdserve_engine_steps_total`,
  `pdserve_engine_step_tokens_total` and `pdserve_engine_busy_seconds_total{pool,worker}`: each
  worker's engine steps by kind (`worker_core.protocol.StepTotals`), from its load reports; a served
  step's time beside the calibrated cost model's (`pdserve plan --validate` prints both);
- `pdserve_role_split_prefill_workers` and `pdserve_role_split_pinned`: the prefill workers holding
  the prefill role, and whether an operator pinned that split (`router.split`);
- `pdserve_request_errors_total{kind}`: requests refused (`model_not_found`, `invalid_request`,
  `overloaded`, `deadline`) or failed (their `ErrorKind`'s value: `transfer_failed`,
  `prefill_failed`, `worker_stopping`, `internal`, ...).
"""
from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)

from router.split import Mechanism, RoleSplit
from worker_core.protocol import LoadReport

disable_created_metrics()  # no `_created` series: scrapers derive resets themselves

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0,
            20.0, 40.0, 80.0)
_RATIO = (0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0)
_COUNT = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
_LENGTH = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
_TOKEN = (0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)


class Bound:
    """A metric whose first label, `model_name`, is bound: `labels(...)` takes the other labels, and a
    metric with no other label is used as is (`inc`, `dec`, `set`, `observe`)."""

    def __init__(self, metric: Counter | Gauge | Histogram, model_name: str) -> None:
        self._metric, self._model_name = metric, model_name

    def labels(self, *values: str):  # prometheus_client's child types are private: no return annotation
        return self._metric.labels(self._model_name, *values)

    def inc(self, amount: float = 1) -> None:
        self.labels().inc(amount)

    def dec(self, amount: float = 1) -> None:
        self.labels().dec(amount)

    def set(self, value: float) -> None:
        self.labels().set(value)

    def observe(self, value: float) -> None:
        self.labels().observe(value)


class Metrics:
    """Every metric the router exports.

    Args:
        model_name: the served model name, the `model_name` label of every request-level metric.
        registry: where they register (a fresh one by default).
    """

    def __init__(self, *, model_name: str, registry: CollectorRegistry | None = None) -> None:
        if not model_name:
            raise ValueError("model_name must be a non-empty string (the served model name)")
        self.model_name = model_name
        r = self.registry = registry or CollectorRegistry()

        def per_request(cls: type, name: str, doc: str, labels: tuple[str, ...] = (), **kw: object) -> Bound:
            metric = cls(name, doc, ["model_name", *labels], registry=r, **kw)
            if not labels:
                metric.labels(model_name)  # its one series is exported from the start, as an unlabelled one is
            return Bound(metric, model_name)

        H, C, G = Histogram, Counter, Gauge
        self.ttft = per_request(H, "pdserve_time_to_first_token_seconds", "Arrival to first token, at the router",
                                ("path",), buckets=_LATENCY)
        self.itl = per_request(H, "pdserve_inter_token_latency_seconds",
                               "Gap between consecutive tokens of a request", ("path",), buckets=_TOKEN)
        self.tpot = per_request(H, "pdserve_time_per_output_token_seconds",
                                "(last token - first token) / (output tokens - 1), per request", ("path",),
                                buckets=_TOKEN)
        self.e2e = per_request(H, "pdserve_e2e_request_latency_seconds", "Arrival to last token", ("path",),
                               buckets=_LATENCY)
        self.queue = per_request(H, "pdserve_request_queue_seconds", "Arrival until a worker took the request",
                                 ("path",), buckets=_LATENCY)
        self.prefill = per_request(H, "pdserve_request_prefill_seconds", "Prompt pass until the first token",
                                   ("path",), buckets=_LATENCY)
        self.transfer = per_request(H, "pdserve_request_transfer_seconds",
                                    "KV still in flight after the prefill worker returned (remote path)",
                                    buckets=_TOKEN)
        self.decode = per_request(H, "pdserve_request_decode_seconds", "First token to last", ("path",),
                                  buckets=_LATENCY)
        self.prompt_length = per_request(H, "pdserve_request_prompt_tokens", "Prompt tokens of each request that "
                                         "ended, whatever its outcome", buckets=_LENGTH)
        self.generation_length = per_request(H, "pdserve_request_generation_tokens", "Output tokens of each request "
                                             "that ended, whatever its outcome", buckets=_LENGTH)
        self.requests = per_request(C, "pdserve_requests", "Requests that ended, by path and outcome "
                                    "(stop, length, cancelled, deadline, error)", ("path", "outcome"))
        self.errors = per_request(C, "pdserve_request_errors", "Requests refused (model_not_found, invalid_request, "
                                  "overloaded, deadline) or failed (their error kind: transfer_failed, "
                                  "prefill_failed, worker_stopping, internal, ...)", ("kind",))
        self.attempt_failures = per_request(
            C, "pdserve_request_attempt_failures", "A worker's part of a request failed (then recovered, or the "
            "request failed), by error kind (transfer_failed: its KV never fully landed on the decode worker; "
            "prefill_failed; worker_stopping; internal) and the pool that failed", ("kind", "pool"))
        self.recoveries = per_request(C, "pdserve_request_recoveries", "Requests placed again after a worker failure, "
                                      "by action (retry: another prefill worker, local: prefill on the decode worker, "
                                      "configured or as the fallback when no prefill worker is left, migrate: "
                                      "continued on another decode worker)", ("action",))
        self.decisions = per_request(C, "pdserve_placement_decisions", "Placement decisions by policy, path and "
                                     "reason", ("policy", "path", "reason"))
        self.prompt_tokens = per_request(C, "pdserve_prompt_tokens", "Prompt tokens of admitted requests")
        self.output_tokens = per_request(C, "pdserve_generation_tokens", "Tokens generated")
        self.in_flight = per_request(G, "pdserve_requests_in_flight", "Requests admitted and not finished")
        self.queued = per_request(G, "pdserve_requests_queued", "Requests waiting for a decode worker with room")
        self.cost_error = per_request(H, "pdserve_cost_model_error_ratio", "Actual / predicted per served request, "
                                      "by quantity (ttft: from placement to first token; tpot) and path",
                                      ("quantity", "path"), buckets=_RATIO)
        self.cached_tokens = per_request(C, "pdserve_prefix_cache_hit_tokens", "Prompt tokens served from a "
                                         "worker's prefix cache (not prefilled), by path and decode worker",
                                         ("path", "worker"))
        self.kv_transfer_bytes = per_request(H, "pdserve_kv_transfer_bytes", "KV bytes a remote prefill moved, per "
                                             "request (the blocks its decode worker lacked)",
                                             buckets=[2 ** k for k in range(12, 32, 2)])
        # per worker, or the router's own: no model_name
        self.worker_failures = Counter("pdserve_worker_failures", "Workers found dead or failing, by pool", ["pool"],
                                       registry=r)
        self.worker_replacements = Counter("pdserve_worker_replacements", "Dead workers replaced, by pool",
                                           ["pool"], registry=r)
        self.worker_hangs = Counter("pdserve_worker_hangs", "Workers silent for --hang-timeout, killed, by pool",
                                    ["pool"], registry=r)
        self.kv_used = Gauge("pdserve_kv_blocks_used", "KV blocks in use, per worker", ["pool", "worker"], registry=r)
        self.kv_total = Gauge("pdserve_kv_blocks_total", "KV blocks in the pool, per worker", ["pool", "worker"],
                              registry=r)
        self.kv_usage = Gauge("pdserve_kv_cache_usage_ratio", "KV blocks in use / KV blocks in the pool, per worker "
                              "(0..1)", ["pool", "worker"], registry=r)
        self.preemptions = Counter("pdserve_preemptions", "Sequences a worker's engine preempted for lack of KV "
                                   "blocks (their KV freed, to be recomputed), per worker", ["pool", "worker"],
                                   registry=r)
        self.running = Gauge("pdserve_running_sequences", "Sequences running or being received, per worker (a "
                             "prefill worker's: those it runs whole, flipped)", ["worker"], registry=r)
        self.prefill_queued = Gauge("pdserve_prefill_queued_tokens", "Prompt tokens waiting, per prefill worker",
                                    ["worker"], registry=r)
        self.cost_correction = Gauge("pdserve_cost_model_correction", "The factor the policy multiplies the cost "
                                     "model's estimates by, learnt online, by quantity and path", ["quantity", "path"],
                                     registry=r)
        self.feed_items = Histogram("pdserve_decode_feed_items", "Items (tokens) one decode-worker feed message "
                                    "carried: an engine step's, for all of its requests", buckets=_COUNT, registry=r)
        self.elastic = Gauge("pdserve_elastic_prefill_workers", "Prefill workers whose compute serves decode now "
                             "(threads lent or role flipped)", registry=r)
        self.elastic_decode = Gauge("pdserve_elastic_decode_workers", "Decode workers whose threads serve prefill "
                                    "now (lent to the prefill worker on their node)", registry=r)
        self.split_prefill = Gauge("pdserve_role_split_prefill_workers", "Prefill workers holding the prefill role "
                                   "(the others serve decode, flipped), as of the last load poll or split change",
                                   registry=r)
        self.split_pinned = Gauge("pdserve_role_split_pinned", "1 while an operator holds the role split (POST "
                                  "/pdserve/split), 0 while roles flip automatically or never", registry=r)
        self.prefix_index = Gauge("pdserve_prefix_index_keys", "Cached block keys the router knows of, all workers",
                                  registry=r)
        self.step_seconds = Counter("pdserve_engine_step_seconds", "Seconds a worker's engine spent in its steps "
                                    "(the model's pass and sampling), by kind: decode (decode-only steps) or prefill "
                                    "(steps computing prompt chunks, decode rows riding along)",
                                    ["pool", "worker", "kind"], registry=r)
        self.steps = Counter("pdserve_engine_steps", "A worker's engine steps, by kind: decode, prefill, and mixed "
                             "(the prefill steps that also decoded)", ["pool", "worker", "kind"], registry=r)
        self.step_tokens = Counter("pdserve_engine_step_tokens", "Tokens a worker's engine steps computed, by kind: "
                                   "decode (rows of decode-only steps), ride (decode rows of mixed steps), prompt, and "
                                   "context (the tokens of context the rows of decode-only steps held)",
                                   ["pool", "worker", "kind"], registry=r)
        self.busy_seconds = Counter("pdserve_engine_busy_seconds", "Wall seconds a worker's engine loop had work: its "
                                    "steps and what ran between them (scheduling, outputs, the feed, commands)",
                                    ["pool", "worker"], registry=r)
        self._seen: dict[tuple[Counter, str, str], float] = {}  # (series, worker, kind) -> the total last polled
        ProcessCollector(namespace="pdserve_router", registry=r)  # the router's own CPU seconds, memory

    def observe_worker(self, pool: str, worker: str, load: LoadReport) -> None:
        """Refresh one worker's gauges from its `load()` report, and count its new preemptions."""
        used = load.num_blocks - load.free_blocks
        self.kv_total.labels(pool, worker).set(load.num_blocks)
        self.kv_used.labels(pool, worker).set(used)
        self.kv_usage.labels(pool, worker).set(used / load.num_blocks if load.num_blocks else 0.0)
        t = load.steps
        for series, kind, total in ((self.preemptions, "", load.preemptions),
                                    (self.step_seconds, "decode", t.decode_seconds),
                                    (self.step_seconds, "prefill", t.prefill_seconds),
                                    (self.steps, "decode", t.decode_steps), (self.steps, "prefill", t.prefill_steps),
                                    (self.steps, "mixed", t.mixed_steps),
                                    (self.step_tokens, "decode", t.decode_rows),
                                    (self.step_tokens, "ride", t.ride_rows),
                                    (self.step_tokens, "prompt", t.prefill_tokens),
                                    (self.step_tokens, "context", t.decode_context),
                                    (self.busy_seconds, "", t.busy_seconds)):
            self._advance(series, pool, worker, kind, total)
        if pool == "decode":
            self.running.labels(worker).set(load.running + load.receiving)
        else:
            self.prefill_queued.labels(worker).set(load.queued_tokens)
            self.running.labels(worker).set(load.running)  # the requests it runs whole (flipped to decode)

    def _advance(self, series: Counter, pool: str, worker: str, kind: str, total: float) -> None:
        """Count what a worker's running total (its engine's since it started) grew by since the last poll;
        a total lower than the last one is a new engine under the same id, counted from 0. 0 too: the
        series exists from the first poll."""
        key = (series, worker, kind)
        seen = self._seen.get(key, 0)
        self._seen[key] = total
        series.labels(pool, worker, *([kind] if kind else [])).inc(total - seen if total >= seen else total)

    def observe_split(self, split: RoleSplit) -> None:
        """Refresh the role split's gauges (and the count of prefill workers flipped to decode)."""
        self.split_prefill.set(split.prefill_role)
        self.split_pinned.set(split.pinned is not None)
        if split.mechanism is Mechanism.FLIP_ROLES:
            self.elastic.set(split.flipped)

    def exposition(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
