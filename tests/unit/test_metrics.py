"""The router's metrics: the served model's name on every request-level series (bound once), KV
usage as a fraction, preemptions counted from the workers' load reports across engine restarts,
prompt and output lengths per request, and failed attempts by error kind."""
from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from router.metrics import Bound, Metrics
from worker_core.protocol import ErrorKind, LoadReport, StepTotals

MODEL = "SmolLM2-135M-Instruct"
# per worker, or the router process's own: the only families without a model_name label
PER_WORKER = {"pdserve_worker_failures", "pdserve_worker_replacements", "pdserve_worker_hangs",
              "pdserve_kv_blocks_used", "pdserve_kv_blocks_total", "pdserve_kv_cache_usage_ratio",
              "pdserve_preemptions", "pdserve_running_sequences", "pdserve_prefill_queued_tokens",
              "pdserve_cost_model_correction", "pdserve_decode_feed_items", "pdserve_elastic_prefill_workers",
              "pdserve_elastic_decode_workers", "pdserve_prefix_index_keys", "pdserve_role_split_prefill_workers",
              "pdserve_role_split_pinned", "pdserve_engine_step_seconds", "pdserve_engine_steps",
              "pdserve_engine_step_tokens", "pdserve_engine_busy_seconds"}


def scrape(m: Metrics) -> dict:
    return {f.name: f for f in text_string_to_metric_families(m.exposition()[0].decode())}


def samples(m: Metrics, family: str, suffix: str = "") -> list:
    return [s for s in scrape(m)[family].samples if s.name == family + suffix]


def test_every_request_level_series_carries_the_model_name():
    m = Metrics(model_name=MODEL)
    for h in (m.ttft, m.itl, m.tpot, m.e2e, m.queue, m.prefill, m.decode):
        h.labels("remote").observe(0.1)
    m.transfer.observe(0.01)
    m.requests.labels("remote", "stop").inc()
    m.errors.labels("overloaded").inc()
    m.recoveries.labels("retry").inc()
    m.attempt_failures.labels(ErrorKind.TRANSFER_FAILED.value, "prefill").inc()
    m.decisions.labels("ratio", "remote", "cheapest").inc()
    m.prompt_tokens.inc(12)
    m.output_tokens.inc(3)
    m.prompt_length.observe(12)
    m.generation_length.observe(3)
    m.in_flight.inc()
    m.queued.set(2)
    m.cost_error.labels("ttft", "remote").observe(1.1)
    m.cached_tokens.labels("remote", "d0").inc(16)
    m.kv_transfer_bytes.observe(4096)
    m.observe_worker("decode", "d0", LoadReport(free_blocks=4, num_blocks=4))
    families = scrape(m)
    request_level = {name for name in families if name.startswith("pdserve_") and name not in PER_WORKER
                     and not name.startswith("pdserve_router_process")}
    assert {"pdserve_time_to_first_token_seconds", "pdserve_request_errors", "pdserve_request_prompt_tokens",
            "pdserve_request_generation_tokens", "pdserve_request_attempt_failures"} <= request_level
    for name in request_level:
        assert families[name].samples, name
        assert all(s.labels.get("model_name") == MODEL for s in families[name].samples), name
    for name in PER_WORKER:
        assert all("model_name" not in s.labels for s in families[name].samples), name
    ttft = samples(m, "pdserve_time_to_first_token_seconds", "_count")
    assert [(s.labels, s.value) for s in ttft] == [({"model_name": MODEL, "path": "remote"}, 1.0)]


def test_a_bound_metric_takes_only_its_other_labels_and_unlabelled_ones_exist_from_the_start():
    m = Metrics(model_name="m1")
    assert isinstance(m.requests, Bound) and isinstance(m.output_tokens, Bound)
    assert [(s.labels, s.value) for s in samples(m, "pdserve_generation_tokens", "_total")] == \
        [({"model_name": "m1"}, 0.0)]  # before any request, as an unlabelled counter would be
    m.output_tokens.inc(5)
    m.requests.labels("local", "length").inc()
    m.in_flight.inc()
    m.in_flight.inc()
    m.in_flight.dec()
    assert samples(m, "pdserve_generation_tokens", "_total")[0].value == 5
    assert samples(m, "pdserve_requests", "_total")[0].labels == {"model_name": "m1", "path": "local",
                                                                  "outcome": "length"}
    assert samples(m, "pdserve_requests_in_flight")[0].value == 1
    with pytest.raises(ValueError, match="model_name"):
        Metrics(model_name="")


def test_kv_usage_is_the_fraction_of_blocks_in_use():
    m = Metrics(model_name=MODEL)
    m.observe_worker("decode", "d0", LoadReport(free_blocks=25, num_blocks=100))
    m.observe_worker("prefill", "p0", LoadReport(free_blocks=100, num_blocks=100))
    usage = {s.labels["worker"]: s.value for s in samples(m, "pdserve_kv_cache_usage_ratio")}
    assert usage == {"d0": 0.75, "p0": 0.0}
    assert {s.labels["pool"] for s in samples(m, "pdserve_kv_cache_usage_ratio")} == {"decode", "prefill"}


def test_preemptions_count_what_each_poll_adds_and_survive_an_engine_restart():
    m = Metrics(model_name=MODEL)

    def total(worker: str) -> float:
        return next(s.value for s in samples(m, "pdserve_preemptions", "_total") if s.labels["worker"] == worker)

    m.observe_worker("decode", "d0", LoadReport(free_blocks=1, num_blocks=4))
    assert total("d0") == 0  # the series exists before the first preemption
    for seen in (2, 2, 5):
        m.observe_worker("decode", "d0", LoadReport(free_blocks=1, num_blocks=4, preemptions=seen))
    assert total("d0") == 5
    m.observe_worker("decode", "d0", LoadReport(free_blocks=1, num_blocks=4, preemptions=1))  # a new engine, same id
    assert total("d0") == 6
    m.observe_worker("decode", "d1", LoadReport(free_blocks=1, num_blocks=4, preemptions=3))  # a replacement worker
    assert total("d1") == 3 and total("d0") == 6


def test_engine_step_totals_count_what_each_poll_adds_by_kind_and_survive_an_engine_restart():
    m = Metrics(model_name=MODEL)

    def value(family: str, kind: str | None = None) -> float:
        return sum(s.value for s in samples(m, family, "_total")
                   if s.labels["worker"] == "d0" and s.labels["pool"] == "decode" and s.labels.get("kind") == kind)

    def report(**totals: float) -> LoadReport:
        return LoadReport(free_blocks=1, num_blocks=4, steps=StepTotals(**totals))

    m.observe_worker("decode", "d0", report(decode_seconds=2.0, decode_steps=40, decode_rows=320, prefill_seconds=1.5,
                                            prefill_steps=3, mixed_steps=2, ride_rows=16, prefill_tokens=700,
                                            busy_seconds=4.0))
    m.observe_worker("decode", "d0", report(decode_seconds=3.0, decode_steps=60, decode_rows=500, prefill_seconds=1.5,
                                            prefill_steps=3, mixed_steps=2, ride_rows=16, prefill_tokens=700,
                                            busy_seconds=5.5))
    assert value("pdserve_engine_step_seconds", "decode") == 3.0
    assert value("pdserve_engine_step_seconds", "prefill") == 1.5
    assert (value("pdserve_engine_steps", "decode"), value("pdserve_engine_steps", "prefill"),
            value("pdserve_engine_steps", "mixed")) == (60, 3, 2)
    assert (value("pdserve_engine_step_tokens", "decode"), value("pdserve_engine_step_tokens", "ride"),
            value("pdserve_engine_step_tokens", "prompt")) == (500, 16, 700)
    assert value("pdserve_engine_busy_seconds") == 5.5
    m.observe_worker("decode", "d0", report(decode_seconds=0.5, decode_steps=10, decode_rows=10, busy_seconds=0.6))
    assert value("pdserve_engine_steps", "decode") == 70 and value("pdserve_engine_busy_seconds") == 6.1
    assert value("pdserve_engine_steps", "prefill") == 3  # a new engine that has not prefilled yet adds nothing


def test_a_load_report_without_preemptions_reads_as_none():
    assert LoadReport(free_blocks=1, num_blocks=2).preemptions == 0


def test_length_histograms_count_each_request_once():
    m = Metrics(model_name=MODEL)
    for prompt, output in ((7, 1), (300, 64), (2000, 0)):
        m.prompt_length.observe(prompt)
        m.generation_length.observe(output)
    assert samples(m, "pdserve_request_prompt_tokens", "_count")[0].value == 3
    assert samples(m, "pdserve_request_prompt_tokens", "_sum")[0].value == 2307
    buckets = {s.labels["le"]: s.value for s in samples(m, "pdserve_request_generation_tokens", "_bucket")}
    assert buckets["1.0"] == 2 and buckets["100.0"] == 3
