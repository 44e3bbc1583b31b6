"""loadtest: metrics from synthetic records, workload generation, arrival schedules, results files."""
from __future__ import annotations

import itertools
import json
import math
import random
import statistics

import numpy as np
import pytest

from loadtest.metrics import is_good, percentile, request_itls, request_tpot, stats, summarize
from loadtest.records import RequestRecord, parse_timings
from loadtest.report import format_summary, load_results, results_document, write_results
from loadtest.runner import RunResult, poisson_arrivals
from loadtest.workload import (
    NAMED,
    RequestSpec,
    WorkloadError,
    build_workload,
    calibrated_text,
    load_jsonl,
    parse_workload_lengths,
    safe_token_range,
)


def rec(i: int, ttft: float | None, itl: float, n: int, requested: int | None = None, error: str | None = None,
        kind: str | None = None) -> RequestRecord:
    """A record with n output tokens, one chunk each, evenly `itl` apart after the first at `ttft`."""
    r = RequestRecord(i, 10, requested if requested is not None else n)
    if error is not None:
        return r.fail(kind or "http_500", error)
    r.ttft_s = ttft
    r.chunk_times_s = [ttft + k * itl for k in range(n)]
    r.e2e_s = ttft + (n - 1) * itl
    r.output_tokens = n
    return r


# ---------------------------------------------------------------- percentiles and stats


@pytest.mark.parametrize("n", [1, 2, 3, 10, 101, 1000])
def test_percentile_matches_numpy_linear(n: int) -> None:
    rng = random.Random(n)
    xs = [rng.expovariate(3.0) for _ in range(n)]
    for p in (0, 1, 25, 50, 90, 99, 99.9, 100):
        assert percentile(xs, p) == pytest.approx(float(np.percentile(xs, p)), rel=1e-12, abs=1e-15)


def test_percentile_rejects_empty_and_out_of_range() -> None:
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_stats_fields() -> None:
    s = stats([4.0, 1.0, 3.0, 2.0])
    assert s == {"count": 4, "mean": 2.5, "min": 1.0, "max": 4.0, "p50": 2.5, "p90": pytest.approx(3.7),
                 "p99": pytest.approx(3.97)}
    assert stats([]) == {"count": 0, "mean": None, "min": None, "max": None, "p50": None, "p90": None, "p99": None}


# ---------------------------------------------------------------- summaries


def synthetic() -> list[RequestRecord]:
    return [
        rec(0, 0.10, 0.010, 50),                     # good
        rec(1, 0.30, 0.020, 40),                     # TTFT 0.30 > 0.25: not good
        rec(2, 0.20, 0.050, 30),                     # TPOT 0.05 > 0.03: not good
        rec(3, 0.05, 0.000, 1),                      # one token: no TPOT, ITL none; good (TTFT ok)
        rec(4, 0.25, 0.03125, 9),                    # exactly on both targets (exact binary floats): good
        rec(5, 0.12, 0.015, 20, requested=64),       # stopped early: short output; good
        rec(6, None, 0, 0, error="HTTP 500: boom", kind="http_500"),
        rec(7, None, 0, 0, error="bad json", kind="bad_json"),
        rec(8, None, 0, 0, error="HTTP 500: again", kind="http_500"),
    ]


def test_summary_counts_latencies_and_throughput() -> None:
    recs = synthetic()
    ok = [r for r in recs if r.ok]
    s = summarize(recs, wall_time_s=4.0, ttft_target_s=0.25, tpot_target_s=0.03125)
    assert s["requests"] == {"total": 9, "ok": 6, "errors": 3, "short_outputs": 1}
    assert s["errors_by_kind"] == {"bad_json": 1, "http_500": 2}
    ttfts = [r.ttft_s for r in ok]
    itls = [b - a for r in ok for a, b in zip(r.chunk_times_s, r.chunk_times_s[1:])]
    assert len(itls) == 49 + 39 + 29 + 0 + 8 + 19
    tpots = [0.010, 0.020, 0.050, 0.03125, 0.015]  # request 3 (one token) has none
    e2es = [r.e2e_s for r in ok]
    for key, values in (("ttft_s", ttfts), ("itl_s", itls), ("tpot_s", tpots), ("e2e_s", e2es)):
        assert s[key]["count"] == len(values), key
        assert s[key]["mean"] == pytest.approx(float(np.mean(values))), key
        for p in (50, 90, 99):
            assert s[key][f"p{p}"] == pytest.approx(float(np.percentile(values, p))), (key, p)
    assert s["throughput"]["requests_per_s"] == pytest.approx(6 / 4.0)
    assert s["throughput"]["output_tokens_per_s"] == pytest.approx((50 + 40 + 30 + 1 + 9 + 20) / 4.0)


def test_goodput_counts_only_requests_meeting_both_targets() -> None:
    recs = synthetic()
    s = summarize(recs, 4.0, ttft_target_s=0.25, tpot_target_s=0.03125)
    assert [is_good(r, 0.25, 0.03125) for r in recs] == [True, False, False, True, True, True, False, False, False]
    assert s["goodput"]["good_requests"] == 4
    assert s["goodput"]["requests_per_s"] == pytest.approx(4 / 4.0)
    assert s["goodput"]["fraction"] == pytest.approx(4 / 9)
    loose = summarize(recs, 4.0, ttft_target_s=10, tpot_target_s=10)["goodput"]
    assert loose["good_requests"] == 6  # every successful request, never the failed ones
    strict_tpot = summarize(recs, 4.0, ttft_target_s=10, tpot_target_s=0.001)["goodput"]
    assert strict_tpot["good_requests"] == 1  # only the one-token request, which has no TPOT
    assert summarize(recs, 4.0)["goodput"]["good_requests"] == 6  # no targets


def test_tpot_and_itl_per_request() -> None:
    r = rec(0, 0.5, 0.02, 11)
    assert request_tpot(r) == pytest.approx(0.02)
    assert request_itls(r) == pytest.approx([0.02] * 10)
    assert request_tpot(rec(1, 0.5, 0.02, 1)) is None
    assert request_tpot(rec(2, None, 0, 0, error="x")) is None and request_itls(rec(2, None, 0, 0, error="x")) == []
    chunky = rec(3, 0.1, 0.05, 3)
    chunky.output_tokens = 9  # 3 chunks carrying 9 tokens: TPOT divides by tokens, ITL is per chunk
    assert request_tpot(chunky) == pytest.approx(0.1 / 8)
    assert request_itls(chunky) == pytest.approx([0.05, 0.05])


def test_summary_of_only_errors_and_bad_wall_time() -> None:
    s = summarize([rec(0, None, 0, 0, error="reset", kind="connection")], 1.0, 1.0, 1.0)
    assert s["requests"]["ok"] == 0 and s["ttft_s"]["p50"] is None and s["goodput"]["requests_per_s"] == 0
    with pytest.raises(ValueError):
        summarize([], 0.0)


# ---------------------------------------------------------------- workloads


def test_fixed_and_named_lengths() -> None:
    assert parse_workload_lengths("fixed:200:1000", 3, 0, 8192) == [(200, 1000)] * 3
    assert parse_workload_lengths("prompt-heavy", 2, 0, 8192) == [(2000, 50)] * 2
    assert parse_workload_lengths("decode-heavy", 2, 0, 8192) == [(200, 1000)] * 2
    for bad in ("fixed:200", "fixed:a:b", "fixed:0:5", "fixed:1:2:3", "nope", "mixed:2"):
        with pytest.raises(WorkloadError):
            parse_workload_lengths(bad, 2, 0, 8192)
    with pytest.raises(WorkloadError, match="max context"):
        parse_workload_lengths("prompt-heavy", 1, 0, 1024)


def test_chat_lengths_are_seeded_lognormal_and_clipped() -> None:
    a = parse_workload_lengths("chat", 2000, 7, 2048)
    assert a == parse_workload_lengths("chat", 2000, 7, 2048)
    assert a != parse_workload_lengths("chat", 2000, 8, 2048)
    prompts, outputs = [p for p, _ in a], [o for _, o in a]
    assert all(16 <= p <= 1024 and 1 <= o <= 1024 and p + o <= 2048 for p, o in a)
    assert 240 < statistics.median(prompts) < 360 and 160 < statistics.median(outputs) < 240
    assert len(set(prompts)) > 300  # a spread, not a constant
    assert max(prompts) == 1024  # the lognormal tail is clipped at max_context / 2


def test_mixed_is_a_seeded_blend() -> None:
    a = parse_workload_lengths("mixed", 1000, 3, 8192)
    assert a == parse_workload_lengths("mixed", 1000, 3, 8192)
    assert set(a) == {NAMED["prompt-heavy"], NAMED["decode-heavy"]}
    assert 400 < a.count(NAMED["prompt-heavy"]) < 600
    assert 50 < parse_workload_lengths("mixed:0.1", 1000, 3, 8192).count(NAMED["prompt-heavy"]) < 150


def test_mix_takes_the_given_shapes_in_turn() -> None:
    assert parse_workload_lengths("mix:128:256,1536:16", 5, 0, 8192) == [(128, 256), (1536, 16)] * 2 + [(128, 256)]
    for bad in ("mix:", "mix:128", "mix:128:256,", "mix:0:5"):
        with pytest.raises(WorkloadError):
            parse_workload_lengths(bad, 2, 0, 8192)
    with pytest.raises(WorkloadError, match="max context"):
        parse_workload_lengths("mix:128:256,2000:100", 2, 0, 2048)


def test_token_id_prompts_have_exact_lengths_in_the_safe_range() -> None:
    specs = build_workload("fixed:300:7", 20, seed=1, vocab_size=49152)
    lo, hi = safe_token_range(49152)
    assert (lo, hi) == (256, 48640)
    assert all(len(s.prompt_token_ids) == s.prompt_tokens == 300 and s.output_tokens == 7 for s in specs)
    assert all(lo <= t < hi for s in specs for t in s.prompt_token_ids)
    assert len({s.prompt_token_ids for s in specs}) == 20  # no two prompts alike (no accidental prefix hits)
    assert specs == build_workload("fixed:300:7", 20, seed=1, vocab_size=49152)
    assert specs != build_workload("fixed:300:7", 20, seed=2, vocab_size=49152)
    explicit = build_workload("fixed:50:5", 3, token_range=(10, 12))
    assert all(set(s.prompt_token_ids) <= {10, 11} for s in explicit)


@pytest.mark.parametrize("vocab,top_special", [(128256, 128000), (151936, 151643), (512, None), (32000, None)])
def test_safe_range_skips_low_and_high_special_ids(vocab: int, top_special: int | None) -> None:
    lo, hi = safe_token_range(vocab)
    assert 0 < lo < hi <= vocab
    assert hi - lo >= vocab // 2
    if top_special is not None:
        assert hi <= top_special


def test_calibrated_text_hits_the_exact_token_count() -> None:
    def count(text: str) -> int:  # long words take 2 tokens, so word count alone misses
        return sum(1 + (len(w) > 4) for w in text.split())

    rng = random.Random(0)
    for n in (1, 7, 64, 500):
        text, actual = calibrated_text(n, count, rng)
        assert actual == count(text) == n
    specs = build_workload("fixed:40:3", 4, count_tokens=count)
    assert all(s.prompt_text and count(s.prompt_text) == s.prompt_tokens == 40 for s in specs)


def test_jsonl_workload(tmp_path) -> None:
    f = tmp_path / "w.jsonl"
    f.write_text('{"prompt": "hello there world", "output_tokens": 5}\n\n'
                 '{"prompt_token_ids": [5, 6, 7, 8], "output_tokens": 2}\n'
                 '{"prompt": "hi", "prompt_tokens": 3, "output_tokens": 1}\n')
    specs = build_workload(str(f), 5)
    assert [(s.index, s.prompt_tokens, s.output_tokens) for s in specs] == [
        (0, 3, 5), (1, 4, 2), (2, 3, 1), (3, 3, 5), (4, 4, 2)]
    assert specs[1].prompt_token_ids == (5, 6, 7, 8) and specs[0].prompt_text == "hello there world"
    assert build_workload(f"jsonl:{f}", 1)[0].prompt_text == "hello there world"


@pytest.mark.parametrize("line,msg", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected an object"),
    ('{"prompt": "x"}', "output_tokens"),
    ('{"prompt": "x", "output_tokens": 0}', "output_tokens"),
    ('{"prompt": "x", "prompt_token_ids": [1], "output_tokens": 2}', "exactly one"),
    ('{"output_tokens": 2}', "exactly one"),
    ('{"prompt": "", "output_tokens": 2}', "non-empty string"),
    ('{"prompt_token_ids": [1, -2], "output_tokens": 2}', "prompt_token_ids"),
    ('{"prompt_token_ids": [], "output_tokens": 2}', "prompt_token_ids"),
])
def test_jsonl_bad_lines_name_the_line(tmp_path, line: str, msg: str) -> None:
    f = tmp_path / "bad.jsonl"
    f.write_text('{"prompt": "fine", "output_tokens": 1}\n' + line + "\n")
    with pytest.raises(WorkloadError, match=msg) as e:
        load_jsonl(f)
    assert f"{f}:2:" in str(e.value)


def test_jsonl_missing_or_empty_file(tmp_path) -> None:
    with pytest.raises(WorkloadError, match="cannot read"):
        load_jsonl(tmp_path / "none.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(WorkloadError, match="no requests"):
        load_jsonl(tmp_path / "empty.jsonl")


# ---------------------------------------------------------------- arrivals


def test_poisson_arrivals_statistics() -> None:
    rate, n = 5.0, 20000
    ts = poisson_arrivals(rate, n, seed=11)
    assert len(ts) == n and ts[0] == 0.0 and ts == sorted(ts)
    assert ts == poisson_arrivals(rate, n, seed=11) and ts != poisson_arrivals(rate, n, seed=12)
    gaps = np.diff(ts)
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.04)  # exponential: CV 1
    counts = np.bincount(np.floor(np.array(ts)).astype(int))[:-1]  # arrivals per 1 s window
    assert counts.mean() == pytest.approx(rate, rel=0.05)
    assert counts.var() == pytest.approx(rate, rel=0.15)  # Poisson: variance equals mean


def test_poisson_arrivals_edge_rates() -> None:
    assert poisson_arrivals(math.inf, 4) == [0.0] * 4
    for bad in (0.0, -1.0, math.nan):
        with pytest.raises(ValueError):
            poisson_arrivals(bad, 3)


# ---------------------------------------------------------------- records and results files


def test_record_round_trip_and_timings_parsing() -> None:
    r = rec(3, 0.1, 0.01, 5)
    r.timings = parse_timings({"path": "remote", "queue_s": 0.01, "prefill_s": 1, "transfer_s": "x",
                               "decode_s": True, "extra": 5})
    assert r.timings == {"path": "remote", "queue_s": 0.01, "prefill_s": 1.0}
    assert RequestRecord.from_dict(json.loads(json.dumps(r.to_dict()))) == r
    assert parse_timings(None) is None and parse_timings([1]) is None


def test_results_file_is_strict_json_and_loads(tmp_path) -> None:
    run = RunResult({"mode": "open", "rate": math.inf, "concurrency": None, "max_duration_s": math.inf,
                     "stopped_by_max_duration": False}, synthetic(), 4.0)
    doc = results_document("lbl", {"target": "x"}, [run], 0.25, 0.03125)
    path = write_results(tmp_path / "sub" / "r.json", doc)
    loaded = json.loads(path.read_text(), parse_constant=lambda c: pytest.fail(f"non-strict JSON {c}"))
    assert loaded["runs"][0]["config"]["rate"] == "inf"
    assert load_results(path)["runs"][0]["summary"]["goodput"]["good_requests"] == 4
    text = format_summary(run.config, doc["runs"][0]["summary"])
    assert "6 ok, 3 errors" in text and "http_500=2" in text and "goodput 1.000 req/s" in text
    (tmp_path / "other.json").write_text("{}")
    with pytest.raises(ValueError, match="not a loadtest results file"):
        load_results(tmp_path / "other.json")


def test_request_spec_needs_exactly_one_prompt() -> None:
    with pytest.raises(AssertionError):
        RequestSpec(0, 1, 1)
    with pytest.raises(AssertionError):
        RequestSpec(0, 1, 1, prompt_text="a", prompt_token_ids=(1,))


def test_send_lag_in_summary() -> None:
    recs = synthetic()
    for i, r in enumerate(recs):
        r.scheduled_s, r.start_s = i * 0.1, i * 0.1 + 0.001 * i
    lag = summarize(recs, 4.0)["send_lag_s"]
    assert lag["count"] == 9 and lag["max"] == pytest.approx(0.008) and lag["min"] == 0.0


def test_tokenizer_file_calibrates_text_prompts(tmp_path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    from loadtest.workload import WORDS, load_token_counter

    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(sorted(set(WORDS) - {"paper"}))}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    count = load_token_counter(str(tmp_path))  # a directory holding tokenizer.json
    assert count("the river paper") == 3
    specs = build_workload("fixed:33:2", 3, seed=4, count_tokens=count)
    assert all(count(s.prompt_text) == s.prompt_tokens == 33 for s in specs)
    with pytest.raises(WorkloadError, match="no tokenizer"):
        load_token_counter(str(tmp_path / "missing"))


def test_loadtest_imports_no_server_code() -> None:
    import pathlib
    import subprocess
    import sys

    code = ("import sys, loadtest.cli, loadtest.plots, loadtest.openai_client, loadtest.grpc_client\n"
            "bad = sorted({m.split('.')[0] for m in sys.modules} & {'router', 'engine', 'ray', 'torch'})\n"
            "assert not bad, bad")
    root = pathlib.Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60,
                          cwd=root)
    assert proc.returncode == 0, proc.stderr


# ---------------------------------------------------------------- multi-turn and shared prefixes


def test_multi_turn_prompts_grow_by_a_user_message_and_a_reply_over_one_system_prompt() -> None:
    specs = build_workload("multi-turn:4:30:6:5", 10, seed=3, vocab_size=1000)
    assert [(s.conversation, s.turn) for s in specs] == [(c, t) for c in range(3) for t in range(4)][:10]
    assert [s.index for s in specs] == list(range(10))
    system = specs[0].prompt_token_ids[:30]
    assert all(s.prompt_token_ids[:30] == system for s in specs)  # one system prompt for every conversation
    assert specs[0].prompt_token_ids[30:36] != specs[4].prompt_token_ids[30:36]  # each its own user messages
    for before, after in itertools.pairwise(specs):
        if after.conversation == before.conversation:  # the whole earlier prompt, its reply, a new message
            assert after.prompt_token_ids[:before.prompt_tokens] == before.prompt_token_ids
            assert after.prompt_tokens == before.prompt_tokens + 5 + 6
    assert [s.prompt_tokens for s in specs[:4]] == [36, 47, 58, 69] and all(s.output_tokens == 5 for s in specs)
    assert build_workload("multi-turn:4:30:6:5", 10, seed=3, vocab_size=1000) == specs  # seeded
    default = build_workload("multi-turn", 6, vocab_size=1000)
    assert [s.turn for s in default] == list(range(6)) and default[0].prompt_tokens == 1000 + 64
    text = build_workload("multi-turn:2:8:3:2", 2)
    assert text[1].prompt_text.startswith(text[0].prompt_text) and text[1].prompt_tokens == 8 + 3 + 2 + 3


def test_prefix_workload_shares_k_prefixes() -> None:
    specs = build_workload("prefix:3:20:5:7", 7, seed=1, vocab_size=1000)
    assert all(s.prompt_tokens == 25 and s.output_tokens == 7 and s.conversation is None for s in specs)
    prefixes = [s.prompt_token_ids[:20] for s in specs]
    assert prefixes[0] == prefixes[3] == prefixes[6] and prefixes[1] == prefixes[4]
    assert len(set(prefixes)) == 3 and len({s.prompt_token_ids[20:] for s in specs}) == 7


@pytest.mark.parametrize("name,msg", [
    ("multi-turn:1:2", "multi-turn:TURNS:SYSTEM:USER:OUTPUT"), ("multi-turn:0:1:1:1", "integers >= 1"),
    ("prefix:1:2:3", "prefix:PREFIXES:PREFIX:SUFFIX:OUTPUT"), ("prefix:a:1:1:1", "integers >= 1"),
    ("multi-turn:10:8000:100:100", "max context"), ("prefix:1:8000:100:200", "max context"),
])
def test_multi_turn_and_prefix_names_are_checked(name: str, msg: str) -> None:
    with pytest.raises(WorkloadError, match=msg):
        build_workload(name, 4, vocab_size=1000)


def test_summary_splits_first_and_later_turns_and_counts_cached_tokens() -> None:
    recs = [rec(i, ttft, 0.01, 4) for i, ttft in enumerate([1.0, 0.2, 0.3, 2.0])]
    assert summarize(recs, 5.0)["turns"] is None and summarize(recs, 5.0)["prefix_cache"] is None
    for r, (conv, turn, cached) in zip(recs, [(0, 0, 0), (0, 1, 8), (0, 2, 10), (1, 0, 0)]):
        r.conversation, r.turn, r.cached_tokens = conv, turn, cached
    s = summarize(recs, 5.0)
    assert s["turns"]["first_ttft_s"]["p50"] == pytest.approx(1.5) and s["turns"]["later_ttft_s"]["max"] == 0.3
    assert s["prefix_cache"] == {"cached_tokens": 18, "prompt_tokens": 40, "fraction": 0.45}
    text = format_summary({"mode": "conversations", "rate": math.inf, "conversations": 2, "think_s": 1.0}, s)
    assert "2 conversations" in text and "TTFT turns 2+" in text and "18 of 40 prompt tokens (45%)" in text
