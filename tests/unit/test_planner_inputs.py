"""The planner's inputs and outputs: traces (load generator workloads and results, JSONL and Mooncake
lines, malformed lines named by number), profiles (a roofline computed by hand, measured JSON), SLOs no
layout can meet, the sweep, and `pdserve plan` on the command line. Pure: no Ray, no torch."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from loadtest.records import RequestRecord
from loadtest.report import results_document, write_results
from loadtest.runner import RunResult, poisson_arrivals
from planner.plan import ImpossibleSlo, PlanSpec, Slo, check_slo, layouts_within, parse_layouts, sweep
from planner.profiles import (
    DEFAULT_EFFICIENCY,
    DEVICES,
    DeviceSpec,
    Efficiency,
    ModelShape,
    device,
    kv_memory_gib,
    roofline_cost_model,
)
from planner.sim import Layout, WorkerSpec
from planner.traces import Trace, TraceRequest, from_jsonl, from_results, from_workload, load_trace
from router.cost_model import CostModel, LinearFit, load_cost_model

ROOT = Path(__file__).resolve().parents[2]
COST = CostModel(prefill=LinearFit(0.01, 0.001), local_prefill=LinearFit(0.02, 0.002),
                 decode_step=((1, 0.01), (2, 0.012), (4, 0.016)), transfer=LinearFit(0.0, 1e-6),
                 kv_bytes_per_token=100, num_layers=2, hop_s=0.005, prefill_chunk_tokens=256, decode_ride=0.5)


# -- traces -----------------------------------------------------------------------------------------
def test_a_mooncake_trace_reads_milliseconds_lengths_and_hashes(tmp_path: Path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp": 1000, "input_length": 700, "output_length": 5, "hash_ids": [0, 1]}\n\n'
                    '{"timestamp": 1500, "input_length": 600, "output_length": 3, "hash_ids": [0, 2]}\n')
    tr = from_jsonl(path)
    assert [r.arrival_s for r in tr.requests] == [0.0, 0.5]
    assert tr.requests[0] == TraceRequest(0.0, 700, 5, hash_ids=(0, 1))
    assert tr.shares_prefixes and tr.hash_block_tokens == 512


def test_a_jsonl_trace_in_seconds_with_max_tokens(tmp_path: Path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"arrival_s": 2.5, "prompt_tokens": 10, "output_tokens": 4, "max_tokens": 8}\n'
                    '{"arrival_s": 0.5, "prompt_tokens": 20, "output_tokens": 2}\n')
    tr = from_jsonl(path)
    assert [(r.arrival_s, r.prompt_tokens, r.max_tokens) for r in tr.requests] == [(0.0, 20, 2), (2.0, 10, 8)]
    assert not tr.shares_prefixes


@pytest.mark.parametrize("line, why", [
    ('{"timestamp": 5, "input_length": 10}', "output_length"),
    ('{"timestamp": 5, "input_length": 0, "output_length": 3}', "integer >= 1"),
    ('{"timestamp": -1, "input_length": 3, "output_length": 3}', "number >= 0"),
    ('{"timestamp": 5, "input_length": 3, "output_length": 3', "not valid JSON"),
    ('[1, 2]', "expected an object"),
    ('{"timestamp": 5, "arrival_s": 1, "input_length": 3, "output_length": 3}', "not timestamp and arrival_s"),
    ('{"timestamp": 5, "input_length": 3, "output_length": 3, "hash_ids": ["a"]}', "hash_ids"),
])
def test_a_malformed_line_names_its_line_number(tmp_path: Path, line: str, why: str):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 3, "output_length": 3}\n\n' + line + "\n")
    with pytest.raises(ValueError, match=rf"bad\.jsonl:3: .*{why}"):
        from_jsonl(path)


def test_an_empty_or_missing_trace_says_so(tmp_path: Path):
    (tmp_path / "e.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="no requests"):
        from_jsonl(tmp_path / "e.jsonl")
    with pytest.raises(ValueError, match="cannot read"):
        from_jsonl(tmp_path / "missing.jsonl")


def test_a_workload_trace_has_the_load_generators_arrivals_and_lengths():
    tr = from_workload("fixed:100:10", 5, 2.0, seed=3)
    assert [r.arrival_s for r in tr.requests] == poisson_arrivals(2.0, 5, 3)
    assert {(r.prompt_tokens, r.output_tokens) for r in tr.requests} == {(100, 10)}
    shared = from_workload("prefix:2:64:16:4", 4, 1.0, vocab_size=512)
    assert shared.shares_prefixes and shared.requests[0].prompt_ids[:64] == shared.requests[2].prompt_ids[:64]
    with pytest.raises(ValueError, match="conversations"):
        from_workload("multi-turn", 10, 1.0)
    with pytest.raises(ValueError, match="rate"):
        load_trace("chat")


def test_a_results_file_replays_what_was_measured(tmp_path: Path):
    recs = [RequestRecord(0, 100, 20, start_s=0.0, scheduled_s=0.0, ttft_s=0.2, e2e_s=1.0, output_tokens=20),
            RequestRecord(1, 100, 20, start_s=0.6, scheduled_s=0.5, ttft_s=0.3, e2e_s=0.9, output_tokens=7,
                          server_prompt_tokens=104),
            RequestRecord(2, 50, 20, start_s=0.9, scheduled_s=0.9).fail("timeout", "slow")]
    doc = results_document("x", {}, [RunResult({"mode": "open", "rate": 2.0}, recs, 2.0)], 2.0, 0.15)
    path = write_results(tmp_path / "r.json", doc)
    tr = from_results(path)
    assert [(r.arrival_s, r.prompt_tokens, r.output_tokens, r.max_tokens) for r in tr.requests] == [
        (0.0, 100, 20, 20), (0.5, 104, 7, 20), (0.9, 50, 20, 20)]
    assert load_trace(str(path)).requests == tr.requests
    with pytest.raises(ValueError, match="run 3"):
        from_results(path, run=3)


# -- profiles ---------------------------------------------------------------------------------------
def test_the_roofline_profile_gives_the_hand_computed_numbers():
    shape = ModelShape.from_config({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
                                    "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
                                    "vocab_size": 100, "torch_dtype": "bfloat16"})
    # per layer: attention 64 x (2 x 64 + 2 x 32) = 12288, MLP 3 x 64 x 128 = 24576; 2 layers + a 100 x 64 head
    assert shape.matmul_params == 2 * (12288 + 24576) + 6400 == 80128
    assert shape.kv_bytes_per_token == 2 * 2 * 2 * 16 * 2 == 256
    dev = DeviceSpec("test", "gpu", flops=1e9, memory_bandwidth=1e8, link_bandwidth=1e7, memory_gib=1, note="")
    eff = Efficiency(compute=0.5, memory=0.5, link=0.5, step_overhead_s=0.001, link_latency_s=0.0001, hop_s=0.002)
    cost = roofline_cost_model(shape, dev, eff, context_tokens=10, max_batch=4, prefill_chunk_tokens=256)
    flops, weights = 2 * 80128, 2 * 80128  # FLOPs per token; bytes of bf16 weights
    assert cost.prefill.fixed_s == pytest.approx(0.001 + weights / 5e7)
    assert cost.prefill.per_unit_s == pytest.approx(flops / 5e8)
    assert [b for b, _ in cost.decode_step] == [1, 2, 4]
    assert cost.step_s(1) == pytest.approx(0.001 + max((weights + 10 * 256) / 5e7, flops / 5e8))
    assert cost.step_s(4) == pytest.approx(0.001 + (weights + 4 * 10 * 256) / 5e7)
    step2 = 0.001 + (weights + 2 * 10 * 256) / 5e7
    assert cost.decode_ride == pytest.approx(2 * (flops / 5e8 + 10 * 256 / 5e7) / step2)
    assert cost.transfer == LinearFit(0.0001, 1 / 5e6)
    assert (cost.hop_s, cost.num_layers, cost.kv_bytes_per_token, cost.prefill_chunk_tokens) == (0.002, 2, 256, 256)
    assert CostModel.from_dict(json.loads(json.dumps(cost.to_dict()))) == cost


def test_a_7b_model_on_an_h100_is_in_the_published_range():
    shape = ModelShape.from_config({"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
                                    "num_attention_heads": 32, "num_key_value_heads": 8,
                                    "intermediate_size": 14336, "vocab_size": 128256})
    assert 7.4e9 < shape.matmul_params < 7.6e9  # Llama 3 8B without its input embeddings
    cost = roofline_cost_model(shape, device("H100"))
    assert 0.005 < cost.step_s(1) < 0.01  # a decode step of one sequence reads ~15 GB
    assert 0.05 < cost.prefill_s(2048) < 0.2
    assert 50 < kv_memory_gib(shape, device("h100")) < 60


def test_the_device_table_is_complete_and_lookups_name_the_known_ones():
    assert {"a100", "h100", "h200", "l4"} <= {d.name for d in DEVICES}
    assert {d.kind for d in DEVICES} == set(DEFAULT_EFFICIENCY)
    with pytest.raises(ValueError, match="a100"):
        device("tpu")
    with pytest.raises(ValueError, match="efficiency compute"):
        DEFAULT_EFFICIENCY["gpu"].with_overrides("compute=1.5")
    with pytest.raises(ValueError, match="NAME=VALUE"):
        DEFAULT_EFFICIENCY["gpu"].with_overrides("speed=2")
    assert DEFAULT_EFFICIENCY["gpu"].with_overrides("memory=0.9").memory == 0.9
    with pytest.raises(ValueError, match="mixture-of-experts"):
        ModelShape.from_config({"hidden_size": 8, "num_local_experts": 8})


def test_a_measured_cost_model_loads_from_its_json(tmp_path: Path):
    (tmp_path / "cm.json").write_text(json.dumps(COST.to_dict()))
    assert load_cost_model(str(tmp_path / "cm.json")) == COST
    with pytest.raises(ValueError, match="cost_model: cannot read .*none.json"):
        load_cost_model(str(tmp_path / "none.json"))
    (tmp_path / "bad.json").write_text(json.dumps({**COST.to_dict(), "hop_s": -1}))
    with pytest.raises(ValueError, match="cost_model: .*bad.json holds no valid cost model: hop_s"):
        load_cost_model(str(tmp_path / "bad.json"))
    (tmp_path / "other.json").write_text(json.dumps({"policy": "ratio"}))
    with pytest.raises(ValueError, match="no valid cost model: .*missing the field 'decode_step'"):
        load_cost_model(str(tmp_path / "other.json"))
    (tmp_path / "huge.json").write_text(json.dumps(COST.to_dict()).replace('"num_layers": 2', '"num_layers": 1e999'))
    with pytest.raises(ValueError, match="huge.json holds no valid cost model"):
        load_cost_model(str(tmp_path / "huge.json"))
    (tmp_path / "bytes.json").write_bytes(b"\xff\xfe\x00binary")
    with pytest.raises(ValueError, match="cost_model: cannot read .*bytes.json"):
        load_cost_model(str(tmp_path / "bytes.json"))
    with pytest.raises(ValueError, match="cost_model: cannot read http://127.0.0.1:abc"):
        load_cost_model("http://127.0.0.1:abc")


# -- SLOs and the sweep -----------------------------------------------------------------------------
def small_trace() -> Trace:
    return Trace(tuple(TraceRequest(i * 0.2, 100 + 10 * i, 5) for i in range(20)), "small")


def test_an_impossible_ttft_target_says_so():
    # the shortest prompt (100 tokens) needs min(local 0.22 s, remote 0.11 + 0.005 + 0.005 s) at best
    with pytest.raises(ImpossibleSlo, match=r"TTFT target 0.1 s is impossible.*shortest prompt \(100 tokens\).*0\.12"):
        check_slo(small_trace(), COST, Slo(0.1, 1.0))
    with pytest.raises(ImpossibleSlo, match="TPOT target 0.005 s is impossible.*0.01"):
        check_slo(small_trace(), COST, Slo(1.0, 0.005))
    notes = check_slo(small_trace(), COST, Slo(0.125, 1.0))
    assert notes and "cannot meet the TTFT target even alone" in notes[0]


def test_the_sweep_covers_every_candidate_and_recommends_the_best():
    spec = PlanSpec(small_trace(), COST, Slo(0.5, 0.05), layouts_within(2), ("ratio", "always_remote"), (8, 16),
                    WorkerSpec(num_blocks=500))
    plan = sweep(spec)
    # 1P:1D with two policies and two batch limits; 0P:2D once per batch limit (everything local)
    assert len(plan.evaluations) == 2 * 2 + 2
    goodputs = [e.summary.goodput_rps for e in plan.evaluations]
    assert goodputs == sorted(goodputs, reverse=True) and plan.recommended is plan.evaluations[0]
    doc = plan.to_json()
    assert doc["format"] == "pdserve-plan/1" and doc["recommended"]["layout"]["label"] in ("1P:1D", "0P:2D")
    assert "recommendation:" in plan.table()
    assert parse_layouts("1:3, 2:2") == (Layout(1, 3), Layout(2, 2))
    with pytest.raises(ValueError, match="PREFILL:DECODE"):
        parse_layouts("1-3")


# -- the command line --------------------------------------------------------------------------------
def _pdserve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdserve", "plan", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=180, check=False)


def test_pdserve_plan_prints_a_table_and_writes_json(tmp_path: Path):
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": 100 * i, "input_length": 200 + 30 * i, "output_length": 8})
                             + "\n" for i in range(30)))
    (tmp_path / "cm.json").write_text(json.dumps(COST.to_dict()))
    res = _pdserve("--trace", str(trace), "--cost-model", str(tmp_path / "cm.json"), "--budget", "2",
                   "--policies", "ratio,always_local", "--ttft-target", "1", "--tpot-target", "0.05",
                   "--out", str(tmp_path / "plan.json"))
    assert res.returncode == 0, res.stderr
    assert "layout" in res.stdout and "1P:1D" in res.stdout and "recommendation:" in res.stdout
    doc = json.loads((tmp_path / "plan.json").read_text())
    assert doc["format"] == "pdserve-plan/1" and len(doc["evaluations"]) == 3
    assert doc["slo"] == {"ttft_s": 1.0, "tpot_s": 0.05} and not math.isnan(doc["evaluations"][0]["sim_s"])


def test_pdserve_plan_names_a_bad_line_and_an_impossible_slo(tmp_path: Path):
    (tmp_path / "cm.json").write_text(json.dumps(COST.to_dict()))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 5, "output_length": 2}\n{"timestamp": 1}\n')
    res = _pdserve("--trace", str(bad), "--cost-model", str(tmp_path / "cm.json"))
    assert res.returncode == 2 and "bad.jsonl:2:" in res.stderr and "Traceback" not in res.stderr
    good = tmp_path / "good.jsonl"
    good.write_text('{"timestamp": 0, "input_length": 5, "output_length": 2}\n')
    res = _pdserve("--trace", str(good), "--cost-model", str(tmp_path / "cm.json"), "--ttft-target", "0.001")
    assert res.returncode == 2 and "impossible" in res.stderr


# -- a live server's metrics (--validate, --watch) ---------------------------------------------------
METRICS = """# TYPE pdserve_kv_blocks_total gauge
pdserve_kv_blocks_total{pool="prefill",worker="p0"} 800.0
pdserve_kv_blocks_total{pool="decode",worker="d0"} 1000.0
pdserve_kv_blocks_total{pool="decode",worker="d1"} 1000.0
# TYPE pdserve_placement_decisions counter
pdserve_placement_decisions_total{path="remote",policy="ratio",reason="cheapest_remote"} 7.0
pdserve_placement_decisions_total{path="local",policy="always_local",reason="recovery"} 9.0
# TYPE pdserve_requests counter
pdserve_requests_total{outcome="length",path="remote"} %d
pdserve_requests_total{outcome="length",path="local"} 2.0
# TYPE pdserve_prompt_tokens counter
pdserve_prompt_tokens_total %d
# TYPE pdserve_generation_tokens counter
pdserve_generation_tokens_total %d
"""


def test_a_servers_layout_and_traffic_come_from_its_metrics():
    from planner.validate import server_layout
    from planner.watch import Reading, traffic

    layout = server_layout(METRICS % (8, 1000, 500))
    assert (layout.layout, layout.decode_blocks, layout.prefill_blocks, layout.policy) == (Layout(1, 2), 1000, 800,
                                                                                           "ratio")
    first = Reading(10.0, 10, 1000, 500, layout)
    second = Reading(20.0, 30, 5000, 2500, layout)
    t = traffic(first, second)
    assert (t.rate, t.prompt_tokens, t.output_tokens) == (2.0, 200, 100)
    assert traffic(second, second) is None
    with pytest.raises(ValueError, match="no decode worker"):
        server_layout("# nothing\n")


def test_a_validation_gives_the_serving_factors_that_would_have_matched_it():
    from planner.profiles import ServingFactors
    from planner.sim import Summary
    from planner.validate import Comparison

    def summary(ttft: float | None, tpot: float | None, ok: int = 10) -> Summary:
        return Summary(10, ok, 20.0, ttft, ttft, tpot, tpot, 0.5, 1.0, 0.5)
    cmp = Comparison(summary(0.5, 0.02), summary(0.6, 0.03), Layout(1, 1), "ratio", ServingFactors(1.0, 2.0))
    fitted = cmp.measured_factors()  # latency: measured - simulated TTFT; decode: measured / simulated TPOT
    assert (fitted.prefill, fitted.decode, fitted.latency_s) == pytest.approx((1.0, 3.0, 0.1))
    assert "matching this run: prefill=1,decode=3,decode_step_s=0,latency_s=0.1" in cmp.table()
    both = Comparison(summary(0.5, 0.02), summary(0.6, 0.03), Layout(1, 1), "ratio", ServingFactors(1.0, 2.0),
                      plain=summary(0.25, 0.01))
    assert "factors 1" in both.table() and "0.42" in both.table()  # the plain simulation's TTFT: 0.25 / 0.6
    one_token = Comparison(summary(0.5, None), summary(0.6, None), Layout(1, 1), "ratio")
    f = one_token.measured_factors()
    assert (f.prefill, f.decode, f.latency_s) == pytest.approx((1.0, 1.0, 0.1))  # no TPOT: decode stays
    faster = Comparison(summary(0.5, 0.02), summary(0.4, 0.02), Layout(1, 1), "ratio", ServingFactors(latency_s=0.05))
    assert faster.measured_factors().latency_s == 0.0  # never below 0
    assert Comparison(summary(0.5, 0.02), summary(None, None, ok=0), Layout(1, 1), "ratio").measured_factors() is None


def test_a_validation_compares_each_request_shape_of_a_mix_apart():
    """A median over two shapes can sit between them: each shape's TTFT and TPOT p50 are compared apart,
    for a trace of a few shapes only."""
    from loadtest.records import RequestRecord
    from planner.sim import Summary
    from planner.validate import Comparison, by_class

    def rec(i: int, prompt: int, out: int, ttft: float, tpot: float) -> RequestRecord:
        return RequestRecord(i, prompt, out, start_s=i, scheduled_s=i, ttft_s=ttft, e2e_s=ttft + tpot * (out - 1),
                             output_tokens=out, output_tokens_source="usage")
    sim = [rec(i, 1024, 16, 0.8, 0.02) for i in range(3)] + [rec(3 + i, 128, 128, 0.1, 0.017) for i in range(4)]
    meas = [rec(i, 1024, 16, 0.9, 0.03) for i in range(3)] + [rec(3 + i, 128, 128, 0.1, 0.017) for i in range(4)]
    classes = by_class(sim, 10.0, meas, 10.0, 2.0, 0.05)
    assert [(c.prompt_tokens, c.output_tokens) for c in classes] == [(128, 128), (1024, 16)]  # most requests first
    assert classes[1].simulated.tpot_p50_s == pytest.approx(0.02) and classes[1].measured.tpot_p50_s == pytest.approx(0.03)
    assert classes[1].measured.ttft_p50_s == pytest.approx(0.9) and classes[0].measured.ok == 4
    whole = Summary.of(sim, 10.0, 2.0, 0.05)
    table = Comparison(whole, Summary.of(meas, 10.0, 2.0, 0.05), Layout(1, 1), "ratio", classes=classes).table()
    assert "by request shape" in table
    assert [line.split()[-1] for line in table.splitlines() if line.startswith("  1024/16")] == ["0.89", "0.67"]
    assert by_class(sim[:3], 10.0, meas[:3], 10.0, 2.0, 0.05) == ()  # one shape: the whole is the shape
    many = [rec(i, 10 + i, 4, 0.1, 0.01) for i in range(5)]
    assert by_class(many, 10.0, many, 10.0, 2.0, 0.05) == ()  # more shapes than a table of them would help


ENGINE = """# TYPE pdserve_engine_step_seconds counter
pdserve_engine_step_seconds_total{kind="decode",pool="decode",worker="d0"} %s
pdserve_engine_step_seconds_total{kind="decode",pool="decode",worker="d1"} %s
pdserve_engine_step_seconds_total{kind="prefill",pool="decode",worker="d0"} 1.0
pdserve_engine_step_seconds_total{kind="prefill",pool="prefill",worker="p0"} %s
# TYPE pdserve_engine_steps counter
pdserve_engine_steps_total{kind="decode",pool="decode",worker="d0"} %s
pdserve_engine_steps_total{kind="prefill",pool="decode",worker="d0"} 2.0
pdserve_engine_steps_total{kind="prefill",pool="prefill",worker="p0"} %s
# TYPE pdserve_engine_step_tokens counter
pdserve_engine_step_tokens_total{kind="decode",pool="decode",worker="d0"} %s
pdserve_engine_step_tokens_total{kind="prompt",pool="prefill",worker="p0"} %s
# TYPE pdserve_engine_busy_seconds counter
pdserve_engine_busy_seconds_total{pool="decode",worker="d0"} %s
"""


def test_a_validation_sets_the_workers_served_steps_beside_the_cost_model():
    from planner.profiles import ServingFactors
    from planner.validate import ServedSteps, engine_totals

    before = engine_totals(ENGINE % (1.0, 1.0, 2.0, 10, 4, 40, 400, 3.5))
    assert before["decode"] == {"step_seconds:decode": 2.0, "step_seconds:prefill": 1.0, "steps:decode": 10.0,
                                "steps:prefill": 2.0, "step_tokens:decode": 40.0, "busy_seconds": 3.5}
    assert before["prefill"] == {"step_seconds:prefill": 2.0, "steps:prefill": 4.0, "step_tokens:prompt": 400.0}
    # 50 decode steps of 8 rows: 3 s in the engine, 4 s busy; 10 prompt steps of 200 tokens on p0 in 6 s
    after = engine_totals(ENGINE % (3.0, 2.0, 8.0, 60, 14, 440, 2400, 7.5))
    served = ServedSteps.of(before, after, COST)
    assert (served.decode_steps, served.mean_batch, served.prefill_steps) == (50, 8.0, 10)
    assert served.step_s == pytest.approx(0.06) and served.model_step_s == pytest.approx(COST.step_s(8))
    assert served.between_steps_s == pytest.approx(1.0 / 50)  # busy 4 s, of which 3 s in steps
    assert served.factor == pytest.approx((0.06 + 0.02) / COST.step_s(8))  # the loop's time between steps too
    assert served.prefill_s == 6.0 and served.model_prefill_s == pytest.approx(10 * COST.prefill_s(200))
    fitted = served.factors(ServingFactors(decode=1.3, latency_s=0.2))  # a time per step, not a factor
    extra = 0.06 + 0.02 - COST.step_s(8)
    assert served.extra_step_s == pytest.approx(extra) and extra > 0
    assert (fitted.decode, fitted.decode_step_s, fitted.prefill, fitted.latency_s) == pytest.approx(
        (1.0, extra, 6.0 / (10 * 0.21), 0.2))
    assert f"{extra * 1e3:+.1f} ms" in served.describe()
    faster = ServedSteps(10, 8.0, 0.5 * COST.step_s(8), COST.step_s(8), 0, 0.0)  # served faster than calibrated
    assert (faster.factors(fitted).decode, faster.factors(fitted).decode_step_s) == pytest.approx((0.5, 0.0))
    assert "50 decode-only at mean batch 8.0" in served.describe()
    assert "10 steps with prompt chunks" in served.describe()
    assert ServedSteps.of(before, before, COST) is None  # no decode-only step ran
    no_prompts = ServedSteps(10, 1.0, 0.05, 0.04, 0, 0.0)
    assert no_prompts.prefill_factor is None and no_prompts.factors(ServingFactors(prefill=1.2)).prefill == 1.2
    # workers that slow each other: the cost model's time for the steps that ran beside the other pool is
    # stretched, here half of p0's prompt steps (x2) and a fifth of the decode-only steps (x1.5)
    crowded = replace(COST, decode_beside_prefill=1.5, prefill_beside_decode=2.0)
    stretched = ServedSteps.of(before, after, crowded, beside=(0.5, 0.2))
    assert stretched.model_step_s == pytest.approx(COST.step_s(8) * 1.1)
    assert stretched.model_prefill_s == pytest.approx(10 * COST.prefill_s(200) * 1.5)
    # half of p0's steps beside: `prefill` stays the base's (no decode worker's prompt steps), and what p0's
    # steps took beyond their time alone is put on that half
    over = 6.0 / (10 * COST.prefill_s(200))
    assert stretched.prefill_factors(ServingFactors()) == pytest.approx((1.0, 1 + (over - 1) / 0.5))
    assert stretched.factors(ServingFactors()).prefill_beside == pytest.approx(1 + (over - 1) / 0.5)
    rare = ServedSteps.of(before, after, crowded, beside=(0.1, 0.0))  # too few beside to tell: one factor for all
    assert rare.prefill_factors(ServingFactors(prefill_beside=1.3)) == pytest.approx((6.0 / rare.model_prefill_s, 1.3))
    # with enough prompt steps on the decode workers, their factor is `prefill`, and p0's beside it
    both = ServedSteps(10, 1.0, 0.05, 0.04, 8, 0.0, local_prefill_steps=4, local_prefill_s=1.2, model_local_prefill_s=1.0,
                       remote_prefill_s=3.0, model_remote_alone_s=2.0, remote_beside_share=0.5)
    assert both.prefill_factors(ServingFactors()) == pytest.approx((1.2, 1 + (3.0 / 2.4 - 1) / 0.5))
    quick = replace(both, remote_prefill_s=2.0)  # p0 faster than the decode workers' factor: nothing beside
    assert quick.prefill_factors(ServingFactors())[1] == 1.0
    # 2 of the decode workers' 4 prompt steps carried decode rows: the simulator adds `decode_step_s` to
    # each (here 50 + 0 - 40 = 10 ms), so `prefill` is what the steps took less that
    mixed = replace(both, step_s=0.05, model_step_s=0.04, local_mixed_steps=2, prefill_s=4.2, model_prefill_s=3.5)
    assert mixed.prefill_factors(ServingFactors())[0] == pytest.approx((1.2 - 2 * 0.01) / 1.0)
    assert replace(mixed, remote_beside_share=0.0).prefill_factor == pytest.approx((4.2 - 0.02) / 3.5)


def test_served_steps_price_the_decode_rows_beside_a_decode_workers_prompt_chunks():
    """The cost model's time for a decode worker's prompt steps includes the ride of the decode rows that
    ran beside their chunks, as the simulator prices such a step."""
    from planner.validate import ServedSteps, engine_totals

    def page(engine: tuple, mixed: int, ride: int, prompt: int) -> dict:
        text = ENGINE % engine + (
            f'pdserve_engine_steps_total{{kind="mixed",pool="decode",worker="d0"}} {mixed}\n'
            f'pdserve_engine_step_tokens_total{{kind="ride",pool="decode",worker="d0"}} {ride}\n'
            f'pdserve_engine_step_tokens_total{{kind="prompt",pool="decode",worker="d0"}} {prompt}\n')
        return engine_totals(text.replace('kind="prefill",pool="decode",worker="d0"} 2.0',
                                          f'kind="prefill",pool="decode",worker="d0"}} {2 + 4 * (mixed > 0)}.0'))
    before = page((1.0, 1.0, 2.0, 10, 4, 40, 400, 3.5), 0, 0, 0)
    after = page((3.0, 2.0, 8.0, 60, 14, 440, 2400, 7.5), 2, 8, 400)  # 4 prompt steps, 2 of them beside 4 rows
    ride = replace(COST, local_prefill=COST.prefill, decode_ride=0.5)
    served = ServedSteps.of(before, after, ride, beside=(0.0, 0.0))
    assert (served.local_prefill_steps, served.local_mixed_steps) == (4, 2)
    assert served.model_local_prefill_s == pytest.approx(4 * ride.local_prefill_s(100) + 2 * ride.step_s(4) * 0.5)


def test_a_validation_with_served_steps_fits_its_factors_from_them_and_simulates_with_them():
    from planner.sim import Summary
    from planner.validate import Comparison, ServedSteps

    def summary(ttft: float, tpot: float) -> Summary:
        return Summary(10, 10, 20.0, ttft, ttft, tpot, tpot, 0.5, 1.0, 0.5)
    served = ServedSteps(decode_steps=100, mean_batch=4.0, step_s=0.05, model_step_s=0.04, prefill_steps=2,
                         between_steps_s=0.002, prefill_s=3.0, model_prefill_s=2.5)
    cmp = Comparison(summary(0.5, 0.02), summary(0.6, 0.03), Layout(1, 1), "ratio", served=served,
                     at_served=summary(0.55, 0.0255))
    fitted = cmp.measured_factors()
    # (50 + 2) - 40 ms per step, not the TPOT ratio 1.5
    assert (fitted.decode, fitted.decode_step_s) == pytest.approx((1.0, 0.012))
    assert fitted.prefill == pytest.approx(1.2)
    assert fitted.latency_s == pytest.approx(0.05)  # measured minus the simulation with the served steps' factors
    table = cmp.table()
    assert "served steps" in table and "0.85" in table  # TPOT simulated with the served steps: 25.5 / 30 ms
    assert "+12.0 ms, x1.30" in table and "x1.20" in table
