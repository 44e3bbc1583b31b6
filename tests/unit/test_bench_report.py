"""The benchmark reports: one engine section per machine class in BENCHMARKS.md; the serving report's SLOs."""
from __future__ import annotations

import argparse

import pytest

from loadtest.records import RequestRecord
from loadtest.report import results_document, write_results
from loadtest.runner import RunResult
from pdserve.bench.report import class_slug, markers, write_report
from pdserve.bench.serving import PEER, Workload, _fixed_slos, add_arguments, scaled_slo
from pdserve.bench.turns import parse_metrics


def test_each_machine_class_has_its_own_section(tmp_path):
    path = tmp_path / "BENCHMARKS.md"
    path.write_text("# pdserve benchmarks\n\nintro\n")
    write_report(path, "avx512 run 1\n", "AVX-512 BF16")
    write_report(path, "avx2 run 1\n", "AVX2 + FMA")
    write_report(path, "avx512 run 2\n", "AVX-512 BF16")
    text = path.read_text()
    assert "intro" in text and "avx2 run 1" in text and "avx512 run 2" in text and "avx512 run 1" not in text
    for cls in ("AVX-512 BF16", "AVX2 + FMA"):
        start, end = markers(cls)
        assert text.count(start) == 1 and text.count(end) == 1 and text.index(start) < text.index(end)


def _record(prompt: int, ttft: float | None, e2e: float | None, out: int = 11) -> RequestRecord:
    return RequestRecord(index=0, prompt_tokens=prompt, requested_output_tokens=out, ttft_s=ttft, e2e_s=e2e,
                         output_tokens=out)


def test_slos_scale_the_peer_s_unloaded_ttft_of_the_longest_prompts_and_its_tpot():
    records = [_record(1024, 5.0, 6.0), _record(1024, 7.0, 8.0), _record(128, 0.5, 1.5),  # TPOT 0.1 s each
               _record(128, 0.4, 3.4, out=31)]
    slo = scaled_slo(records, 2.0, 1.5)
    assert slo.ttft_s == 2.0 * 6.0  # the p50 of the 1024-token prompts only
    assert abs(slo.tpot_s - 1.5 * 0.1) < 1e-12
    assert "6.00 s (1024-token prompts)" in slo.basis and "100 ms" in slo.basis
    failed = _record(1024, None, None)
    failed.error = "boom"
    with pytest.raises(ValueError, match="no unloaded request succeeded"):
        scaled_slo([failed], 2.0, 1.5)
    with pytest.raises(ValueError, match="TPOT"):
        scaled_slo([_record(1024, 5.0, 5.0, out=1)], 2.0, 1.5)


def test_report_slos_are_given_together_or_scaled_to_the_peer(tmp_path):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    workloads = [Workload("prompt-heavy", ((1024, 16),), (0.1,))]
    assert _fixed_slos(parser.parse_args([]), workloads, tmp_path) == {}  # measured on the peer, which runs first
    given = _fixed_slos(parser.parse_args(["--ttft-target", "3", "--tpot-target", "0.2"]), workloads, tmp_path)
    assert (given["prompt-heavy"].ttft_s, given["prompt-heavy"].tpot_s) == (3.0, 0.2)
    with pytest.raises(ValueError, match="go together"):
        _fixed_slos(parser.parse_args(["--ttft-target", "3"]), workloads, tmp_path)
    alone = parser.parse_args(["--servers", "ratio"])
    with pytest.raises(ValueError, match=PEER):
        _fixed_slos(alone, workloads, tmp_path)
    # the peer's unloaded run from an earlier report in the same results folder scales them
    probe = RunResult({"mode": "closed"}, [_record(1024, 5.0, 6.0), _record(1024, 7.0, 8.0)], 9.0)
    write_results(tmp_path / "unloaded" / f"{PEER}--prompt-heavy.json",
                  results_document("peer unloaded", {}, [probe], None, None))
    reused = _fixed_slos(alone, workloads, tmp_path)["prompt-heavy"]
    assert reused.ttft_s == 2.0 * 6.0 and abs(reused.tpot_s - 1.5 * 0.1) < 1e-12
    with pytest.raises(SystemExit):
        parser.parse_args(["--slo-scale", "2"])


def test_engine_and_serving_sections_of_one_class_are_apart(tmp_path):
    path = tmp_path / "BENCHMARKS.md"
    write_report(path, "engine avx2\n", "AVX2 + FMA")
    write_report(path, "serving avx2 1\n", "AVX2 + FMA", "serving")
    write_report(path, "serving avx2 2\n", "AVX2 + FMA", "serving")
    text = path.read_text()
    assert "engine avx2" in text and "serving avx2 2" in text and "serving avx2 1" not in text
    assert text.count(markers("AVX2 + FMA", "serving")[0]) == 1 and class_slug("AVX2 + FMA") == "avx2-fma"


def test_the_turns_benchmark_reads_pdserve_s_transfer_and_cache_counters():
    lines = ["# HELP pdserve_kv_transfer_bytes KV bytes", "pdserve_kv_transfer_bytes_sum 4096.0",
             "pdserve_kv_transfer_bytes_count 2.0", 'pdserve_prefix_cache_hit_tokens_total{path="local"} 64.0',
             'pdserve_prefix_cache_hit_tokens_total{path="remote"} 32.0', "pdserve_requests_total 3.0"]
    text = "\n".join(lines)
    assert parse_metrics(text) == {"pdserve_kv_transfer_bytes_sum": 4096.0, "pdserve_kv_transfer_bytes_count": 2.0,
                                   "pdserve_prefix_cache_hit_tokens_total": 96.0}


def test_the_turns_benchmark_starts_conversations_at_a_rate_or_all_at_once(capsys):
    from pdserve.bench.turns import started
    from pdserve.cli import build_parser

    p = build_parser()
    assert p.parse_args(["bench", "turns"]).rate == float("inf")
    assert p.parse_args(["bench", "turns", "--rate", "0.5"]).rate == 0.5
    assert started(float("inf")) == "all started at once"
    assert started(0.5) == "started at 0.5 a second (Poisson arrivals)"
    for bad in ("0", "-1", "nan", "fast"):
        with pytest.raises(SystemExit):
            p.parse_args(["bench", "turns", "--rate", bad])
        assert f"--rate: expected a number > 0, got {bad!r}" in capsys.readouterr().err


def test_the_turns_table_counts_the_later_turns_placed_remote():
    from loadtest.records import RequestRecord
    from pdserve.bench.turns import later_remote

    def rec(turn: int, path: str | None) -> RequestRecord:
        return RequestRecord(index=turn, prompt_tokens=8, requested_output_tokens=4, start_s=0.0, turn=turn,
                             timings=None if path is None else {"path": path})
    assert later_remote([rec(0, "remote"), rec(1, "remote"), rec(2, "local"), rec(3, "remote")]) == "2 of 3"
    assert later_remote([rec(0, "remote"), rec(1, None), rec(2, "local")]) == "0 of 1"  # one reported no timings
    assert later_remote([rec(0, None), rec(1, None)]) == "–"  # a server that reports no placement


def test_the_linear_table_compares_each_batch_and_names_what_auto_packed():
    from pdserve.bench.linear import render

    run = {"decode_step_s": {"plain": {1: 0.080, 10: 0.250}, "auto": {1: 0.080, 10: 0.200}},
           "prefill_s": {"plain": 10.0, "auto": 8.0}, "choice": "packed lm_head 49152x576", "reason": "measured"}
    res = {"machine": {"machine_class": "AVX2 + FMA", "cpu": "test cpu", "command": "pdserve bench linear"},
           "dtype": "float32", "compile": True, "context": 128, "reps": 3, "steps": 6, "batches": [1, 10],
           "prompt_len": 1024, "runs": {1: run}}
    text = render(res)
    assert "| 1 | 10 | 250 ms (40.0) | 200 ms (50.0) | 1.25x |" in text
    assert "| 1 | prefill 1024 | 10.00 s (102) | 8.00 s (128) | 1.25x |" in text
    assert "auto chose linear packed lm_head 49152x576" in text and text.startswith("AVX2 + FMA (test cpu)")


def test_a_saturated_run_warms_up_with_one_wave_and_measures_three():
    from pdserve.bench.serving import saturated_counts

    assert saturated_counts(12, 12) == (12, 36)  # the report's defaults: not one burst of 12
    assert saturated_counts(100, 12) == (12, 100)  # asked for more: all measured
    assert saturated_counts(1, 4) == (4, 12)


def test_the_peer_starts_with_the_preloads_its_cpu_build_asks_for(tmp_path, monkeypatch):
    from pdserve.bench import serving

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--vllm-venv", str(tmp_path)])
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    monkeypatch.setattr(serving.ctypes.util, "find_library", lambda name: None)  # no tcmalloc here
    assert "LD_PRELOAD" not in serving._server_cmd(PEER, "/models/m", 8000, args)[1]  # nothing found: none
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libiomp5.so").write_bytes(b"")
    monkeypatch.setattr(serving.ctypes.util, "find_library",
                        lambda name: "libtcmalloc_minimal.so.4" if name == "tcmalloc_minimal" else None)
    env = serving._server_cmd(PEER, "/models/m", 8000, args)[1]
    assert env["LD_PRELOAD"] == f"libtcmalloc_minimal.so.4:{tmp_path}/lib/libiomp5.so"
    assert "LD_PRELOAD" not in serving._server_cmd("ratio", "/models/m", 8000, args)[1]  # pdserve: as started
    monkeypatch.setenv("LD_PRELOAD", "/opt/mine.so")  # the caller's wins
    assert serving._server_cmd(PEER, "/models/m", 8000, args)[1]["LD_PRELOAD"] == "/opt/mine.so"


def test_pdserve_is_told_the_workload_s_slo_and_the_peer_is_not():
    from pdserve.bench.serving import Slo, _server_cmd

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args([])
    assert args.tell_slo
    args.model_dir = "/models/m"
    slo = Slo(0.23, 0.034, "scaled")
    cmd, _ = _server_cmd("ratio", args.model_dir, 8000, args, slo)
    i, j = cmd.index("--ttft-target"), cmd.index("--tpot-target")
    assert (float(cmd[i + 1]), float(cmd[j + 1])) == (0.23, 0.034)
    assert "--ttft-target" not in _server_cmd("ratio", args.model_dir, 8000, args)[0]  # no SLO: its own targets
    assert "--ttft-target" not in _server_cmd(PEER, args.model_dir, 8000, args, slo)[0]
    assert not p.parse_args(["--no-tell-slo"]).tell_slo


def test_the_report_runs_the_workloads_asked_for_and_names_an_unknown_one():
    p = argparse.ArgumentParser()
    add_arguments(p)
    assert p.parse_args([]).workloads == ["decode-heavy", "prompt-heavy", "mixed"]
    assert p.parse_args(["--workloads", "mixed"]).workloads == ["mixed"]
    with pytest.raises(SystemExit):
        p.parse_args(["--workloads", "mixed,chat"])


def _open_doc(server: str, fractions: dict[float, float]) -> dict:
    return {"meta": {"server": server, "workload": "mixed"},
            "runs": [{"config": {"mode": "open", "rate": r}, "summary": {"goodput": {"fraction": f}}}
                     for r, f in fractions.items()]}


def test_a_server_sustains_the_highest_rate_up_to_which_every_run_had_enough_requests_within_the_slo():
    from pdserve.bench.serving_report import capacities

    docs = [_open_doc("vllm", {0.8: 1.0, 1.2: 0.85, 1.6: 0.2}), _open_doc("ratio", {0.8: 0.95, 1.2: 0.9, 1.6: 0.7}),
            _open_doc("single", {0.8: 0.5, 1.2: 0.4}), _open_doc("flip", {0.8: 0.6, 1.2: 0.95})]
    assert capacities(docs, "mixed") == {"vllm": 0.8, "ratio": 1.2, "single": None, "flip": None}
    assert capacities(docs, "prompt-heavy") == {}
    assert capacities(docs, "mixed", attainment=0.5)["single"] == 0.8


def test_every_run_of_a_mixed_sweep_serves_the_same_mix_in_its_own_order():
    from pdserve.bench.serving import _specs

    w = Workload("mixed", ((1024, 16), (128, 128)), (0.4, 0.8))
    runs = [_specs(w, 41, seed, 1000) for seed in (0, 100, 200)]
    for specs in runs:
        assert [s.prompt_tokens for s in specs].count(1024) == 21  # 21 + 20, whatever the seed
        assert [s.index for s in specs] == list(range(41))
    assert len({tuple(s.prompt_tokens for s in specs) for specs in runs}) == 3  # each seed its own order
    firsts = {tuple(s.prompt_token_ids) for specs in runs for s in specs[:3]}
    assert len(firsts) == 9  # and its own prompts


def test_decode_ratios_are_taken_round_by_round_so_a_slow_spell_cancels_out():
    from pdserve.bench.engine import paired_ratios
    from pdserve.bench.report import render_decode

    # the machine ran fast in the third round for all three: medians alone put 77% against the best bound
    pd, bound, tf = [71.7, 77.2, 93.5], [80.1, 84.4, 100.2], [17.3, 15.7, 19.0]
    paired = paired_ratios(pd, bound, tf)
    assert paired["of_bound"] == pytest.approx(77.2 / 84.4)
    assert paired["of_bound_runs"] == pytest.approx([a / b for a, b in zip(pd, bound)])
    assert paired["x_transformers"] == pytest.approx(77.2 / 15.7)  # of 4.14, 4.917, 4.921
    assert paired_ratios([1.0, float("nan")], [2.0, 2.0], [0.0, 1.0]) == {
        "of_bound": 0.5, "x_transformers": pytest.approx(float("nan"), nan_ok=True),
        "of_bound_runs": [0.5, pytest.approx(float("nan"), nan_ok=True)],
        "x_transformers_runs": [pytest.approx(float("nan"), nan_ok=True)] * 2}

    def run(paired: dict | None, reps: int = 3) -> str:
        w = {"pdserve": {"decode_tok_s": 77.2, "e2e_tok_s": 67.8, "wall_s": 1.9, "reps": reps},
             "transformers": {"decode_tok_s": 17.3, "e2e_tok_s": 17.0, "wall_s": 7.5, "reps": reps}}
        bd = {"tok_s": 100.2, "linear_s": 0.0098}
        return render_decode({"decode": {1: {**w, **({"paired": paired} if paired else {})}}, "bound": {1: bd},
                              "bandwidth_limit_tok_s": 103.0})
    row = run(paired).splitlines()[2]
    assert "91% (≥ 80% ✅ met) [77%]" in row and "4.92× (≥ 1.50× ✅ met) [4.46×]" in row
    assert "77% (≥ 80% ❌ missed) |" in run(None).splitlines()[2]  # a JSON from before: the median run, best bound
    assert "[" not in run(paired_ratios([77.2], [100.2], [17.3]), reps=1).splitlines()[2]  # one round: one figure


def test_decode_rounds_are_a_whole_number_of_at_least_one(capsys):
    from pdserve.cli import build_parser

    p = build_parser()
    assert p.parse_args(["bench", "engine", "--decode-rounds", "5"]).decode_rounds == 5
    assert p.parse_args(["bench", "engine"]).decode_rounds is None  # the plan's own (3; 1 with --quick)
    for bad in ("0", "-2", "2.5", "many"):
        with pytest.raises(SystemExit):
            p.parse_args(["bench", "engine", "--decode-rounds", bad])
        assert f"--decode-rounds: must be a whole number >= 1, got {bad!r}" in capsys.readouterr().err
