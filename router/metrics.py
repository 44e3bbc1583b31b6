"""The router's Prometheus metrics, in a registry of their own (`pdserve_` prefix).

Latencies are histograms in seconds; requests are counted by path and outcome, errors by kind,
placement decisions by policy, path and reason; per-worker gauges are refreshed from the workers'
load reports. The router process's own CPU time and memory are `pdserve_router_process_*`.
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

from worker_core.protocol import LoadReport

disable_created_metrics()  # no `_created` series: scrapers derive resets themselves

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0,
            20.0, 40.0, 80.0)
_RATIO = (0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0)
_COUNT = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
_TOKEN = (0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)


class Metrics:
    """Every metric the router exports. Args: registry (a fresh one by default)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        self.ttft = Histogram("pdserve_time_to_first_token_seconds", "Arrival to first token, at the router",
                              ["path"], buckets=_LATENCY, registry=r)
        self.itl = Histogram("pdserve_inter_token_latency_seconds", "Gap between consecutive tokens of a request",
                             ["path"], buckets=_TOKEN, registry=r)
        self.tpot = Histogram("pdserve_time_per_output_token_seconds",
                              "(last token - first token) / (output tokens - 1), per request", ["path"],
                              buckets=_TOKEN, registry=r)
        self.e2e = Histogram("pdserve_e2e_request_latency_seconds", "Arrival to last token", ["path"],
                             buckets=_LATENCY, registry=r)
        self.queue = Histogram("pdserve_request_queue_seconds", "Arrival until a worker took the request",
                               ["path"], buckets=_LATENCY, registry=r)
        self.prefill = Histogram("pdserve_request_prefill_seconds", "Prompt pass until the first token",
                                 ["path"], buckets=_LATENCY, registry=r)
        self.transfer = Histogram("pdserve_request_transfer_seconds",
                                  "KV still in flight after the prefill worker returned (remote path)",
                                  buckets=_TOKEN, registry=r)
        self.decode = Histogram("pdserve_request_decode_seconds", "First token to last", ["path"],
                                buckets=_LATENCY, registry=r)
        self.requests = Counter("pdserve_requests", "Requests that ended, by path and outcome "
                                "(stop, length, cancelled, error)", ["path", "outcome"], registry=r)
        self.errors = Counter("pdserve_request_errors", "Requests refused or failed, by kind", ["kind"],
                              registry=r)
        self.recoveries = Counter("pdserve_request_recoveries", "Requests placed again after a worker failure, by "
                                  "action (retry: another prefill worker, local: prefill on the decode worker, "
                                  "migrate: continued on another decode worker)", ["action"], registry=r)
        self.worker_failures = Counter("pdserve_worker_failures", "Workers found dead or failing, by pool", ["pool"],
                                       registry=r)
        self.worker_replacements = Counter("pdserve_worker_replacements", "Dead workers replaced, by pool",
                                           ["pool"], registry=r)
        self.worker_hangs = Counter("pdserve_worker_hangs", "Workers silent for --hang-timeout, killed, by pool",
                                    ["pool"], registry=r)
        self.decisions = Counter("pdserve_placement_decisions", "Placement decisions by policy, path and reason",
                                 ["policy", "path", "reason"], registry=r)
        self.prompt_tokens = Counter("pdserve_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.output_tokens = Counter("pdserve_generation_tokens", "Tokens generated", registry=r)
        self.in_flight = Gauge("pdserve_requests_in_flight", "Requests admitted and not finished", registry=r)
        self.queued = Gauge("pdserve_requests_queued", "Requests waiting for a decode worker with room", registry=r)
        self.kv_used = Gauge("pdserve_kv_blocks_used", "KV blocks in use, per worker", ["pool", "worker"], registry=r)
        self.kv_total = Gauge("pdserve_kv_blocks_total", "KV blocks in the pool, per worker", ["pool", "worker"],
                              registry=r)
        self.running = Gauge("pdserve_running_sequences", "Sequences running or being received, per worker (a "
                             "prefill worker's: those it runs whole, flipped)", ["worker"], registry=r)
        self.prefill_queued = Gauge("pdserve_prefill_queued_tokens", "Prompt tokens waiting, per prefill worker",
                                    ["worker"], registry=r)
        self.cost_error = Histogram("pdserve_cost_model_error_ratio", "Actual / predicted per served request, "
                                    "by quantity (ttft: from placement to first token; tpot) and path",
                                    ["quantity", "path"], buckets=_RATIO, registry=r)
        self.cost_correction = Gauge("pdserve_cost_model_correction", "The factor the policy multiplies the cost "
                                     "model's estimates by, learnt online, by quantity and path", ["quantity", "path"],
                                     registry=r)
        self.feed_items = Histogram("pdserve_decode_feed_items", "Items (tokens) one decode-worker feed message "
                                    "carried: an engine step's, for all of its requests", buckets=_COUNT, registry=r)
        self.elastic = Gauge("pdserve_elastic_prefill_workers", "Prefill workers whose compute serves decode now "
                             "(threads lent or role flipped)", registry=r)
        self.elastic_decode = Gauge("pdserve_elastic_decode_workers", "Decode workers whose threads serve prefill "
                                    "now (lent to the prefill worker on their node)", registry=r)
        self.prefix_index = Gauge("pdserve_prefix_index_keys", "Cached block keys the router knows of, all workers",
                                  registry=r)
        self.cached_tokens = Counter("pdserve_prefix_cache_hit_tokens", "Prompt tokens served from a worker's "
                                     "prefix cache (not prefilled), by path and decode worker", ["path", "worker"],
                                     registry=r)
        self.kv_transfer_bytes = Histogram("pdserve_kv_transfer_bytes", "KV bytes a remote prefill moved, per "
                                           "request (the blocks its decode worker lacked)",
                                           buckets=[2 ** k for k in range(12, 32, 2)], registry=r)
        ProcessCollector(namespace="pdserve_router", registry=r)  # the router's own CPU seconds, memory

    def observe_worker(self, pool: str, worker: str, load: LoadReport) -> None:
        """Refresh one worker's gauges from its `load()` report."""
        self.kv_total.labels(pool, worker).set(load.num_blocks)
        self.kv_used.labels(pool, worker).set(load.num_blocks - load.free_blocks)
        if pool == "decode":
            self.running.labels(worker).set(load.running + load.receiving)
        else:
            self.prefill_queued.labels(worker).set(load.queued_tokens)
            self.running.labels(worker).set(load.running)  # the requests it runs whole (flipped to decode)

    def exposition(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
