"""loadtest: gamma (bursty) arrivals, any list of percentiles, the warm-up, the chat request body, and the
flags that select them (`--burstiness`, `--metric-percentiles`, `--percentile-metrics`, `--num-warmups`,
`--endpoint`)."""
from __future__ import annotations

import asyncio
import json
import math
import random
import re

import numpy as np
import pytest

from loadtest import cli
from loadtest import records as R
from loadtest.clients import make_client
from loadtest.metrics import PercentileSelection, percentile_key, stats, summarize
from loadtest.openai_client import OpenAIClient, chat_messages
from loadtest.records import RequestRecord
from loadtest.report import format_summary
from loadtest.runner import gamma_arrivals, poisson_arrivals, warm_up
from loadtest.workload import ChatMessage, RequestSpec, build_workload, run_seed, warmup_seed, with_replies

# ---------------------------------------------------------------- gamma arrivals


@pytest.mark.parametrize("burstiness", [0.25, 0.5, 1.0, 2.0, 4.0])
def test_gamma_gaps_have_mean_one_over_rate_and_cv_one_over_sqrt_shape(burstiness: float) -> None:
    rate, n = 4.0, 40000
    ts = gamma_arrivals(rate, n, seed=7, burstiness=burstiness)
    assert len(ts) == n and ts[0] == 0.0 and ts == sorted(ts)
    gaps = np.diff(ts)
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)  # gamma: CV 1/sqrt(k)


def test_gamma_arrivals_are_seeded() -> None:
    a = gamma_arrivals(3.0, 500, seed=run_seed(1, 2), burstiness=0.3)
    assert a == gamma_arrivals(3.0, 500, seed=run_seed(1, 2), burstiness=0.3)
    assert a != gamma_arrivals(3.0, 500, seed=run_seed(1, 3), burstiness=0.3)
    assert a != gamma_arrivals(3.0, 500, seed=run_seed(1, 2), burstiness=0.6)


def test_shape_one_is_the_exponential_draw() -> None:
    rate, seed = 2.5, 9
    ts = gamma_arrivals(rate, 1000, seed=seed, burstiness=1.0)
    assert ts == poisson_arrivals(rate, 1000, seed=seed)  # the schedules of earlier runs are unchanged
    rng, gamma_rng = random.Random(seed), random.Random(seed)
    expo = np.cumsum([0.0] + [rng.expovariate(rate) for _ in range(999)])
    gamma = np.cumsum([0.0] + [gamma_rng.gammavariate(1.0, 1 / rate) for _ in range(999)])
    assert ts == pytest.approx(list(expo), rel=1e-12)
    assert ts == pytest.approx(list(gamma), rel=1e-9)  # a gamma of shape 1 is the exponential


def test_gamma_edge_cases() -> None:
    assert gamma_arrivals(math.inf, 3, burstiness=0.5) == [0.0, 0.0, 0.0]
    assert gamma_arrivals(4.0, 4, burstiness=math.inf) == [0.0, 0.25, 0.5, 0.75]  # constant gaps
    for bad in (0.0, -1.0, math.nan):
        with pytest.raises(ValueError, match="burstiness must be > 0"):
            gamma_arrivals(1.0, 3, burstiness=bad)
    with pytest.raises(ValueError, match="rate must be > 0"):
        gamma_arrivals(0.0, 3, burstiness=0.5)


# ---------------------------------------------------------------- percentiles


def test_percentile_selection_parsing() -> None:
    default = PercentileSelection()
    assert default.percentiles == (50, 90, 99) and default.metrics == ("ttft", "tpot", "itl", "e2el")
    assert PercentileSelection.parse() == default
    sel = PercentileSelection.parse(" 99.9,50, 90,50,99 ", "ttft,e2el,ttft")
    assert sel.percentiles == (50.0, 90.0, 99.0, 99.9) and sel.metrics == ("ttft", "e2el")
    assert PercentileSelection.parse("0,100").percentiles == (0.0, 100.0)
    assert [percentile_key(p) for p in (50, 50.0, 99.9, 99.99, 0, 100)] == ["p50", "p50", "p99.9", "p99.99", "p0",
                                                                            "p100"]


@pytest.mark.parametrize("percentiles,metrics,msg", [
    ("101", None, r"in \[0, 100\], got 101"), ("-1", None, r"in \[0, 100\]"), ("fifty", None, "comma-separated"),
    ("", None, "at least one"), ("nan", None, r"numbers in \[0, 100\]"), (None, "ttft,latency", "latency"),
    (None, ",", "none"),
])
def test_percentile_selection_errors(percentiles: str | None, metrics: str | None, msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        PercentileSelection.parse(percentiles, metrics)


def test_selection_is_validated_when_built_directly() -> None:
    with pytest.raises(ValueError, match="ascending"):
        PercentileSelection((99, 50))
    with pytest.raises(ValueError, match="e2e"):
        PercentileSelection(metrics=("e2e",))  # vLLM's name is e2el


def test_stats_with_extra_percentiles_against_hand_computed_values() -> None:
    xs = [float(v) for v in (7, 1, 10, 4, 2, 9, 3, 6, 8, 5)]  # 1..10, shuffled
    s = stats(xs, [25, 99.9, 50])
    # linear interpolation at p/100 * (n - 1) = p/100 * 9
    assert list(s) == ["count", "mean", "min", "max", "p25", "p50", "p90", "p99", "p99.9"]
    assert s["p25"] == pytest.approx(3.25) and s["p50"] == pytest.approx(5.5) and s["p90"] == pytest.approx(9.1)
    assert s["p99"] == pytest.approx(9.91) and s["p99.9"] == pytest.approx(9.991)
    assert stats([], [99.9])["p99.9"] is None
    assert stats(xs) == stats(xs, ())  # no extra: exactly the default fields


def rec(i: int, ttft: float, itl: float, n: int) -> RequestRecord:
    r = RequestRecord(i, 10, n)
    r.ttft_s, r.chunk_times_s = ttft, [ttft + k * itl for k in range(n)]
    r.e2e_s, r.output_tokens = ttft + (n - 1) * itl, n
    return r


def test_summary_carries_the_selected_percentiles_of_the_selected_metrics() -> None:
    recs = [rec(i, ttft, 0.01, 3) for i, ttft in enumerate([0.1, 0.2, 0.3, 0.4, 0.5])]
    sel = PercentileSelection((25.0, 99.9), ("ttft", "e2el"))
    s = summarize(recs, 2.0, percentiles=sel)
    assert s["percentiles"] == {"percentiles": [25.0, 99.9], "metrics": ["ttft", "e2el"]}
    assert s["ttft_s"]["p25"] == pytest.approx(0.2) and s["ttft_s"]["p99.9"] == pytest.approx(0.4996)
    assert s["e2e_s"]["p99.9"] == pytest.approx(0.5196)
    assert "p99.9" not in s["itl_s"] and "p25" not in s["tpot_s"]
    for key in ("ttft_s", "itl_s", "tpot_s", "e2e_s"):  # readers of p50 / p90 / p99 keep them
        assert {"p50", "p90", "p99"} <= set(s[key])
    text = format_summary({"mode": "closed", "concurrency": 2}, s)
    rows = [line.split() for line in text.splitlines()]
    assert ["ms", "mean", "p25", "p99.9"] in rows
    assert [r[0] for r in rows if r and r[0] in ("TTFT", "ITL", "TPOT", "E2E")] == ["TTFT", "E2E"]
    assert ["TTFT", "300.0", "200.0", "499.6"] in rows


def test_default_table_is_unchanged_and_old_summaries_still_format() -> None:
    recs = [rec(i, 0.1 * (i + 1), 0.01, 3) for i in range(4)]
    s = summarize(recs, 2.0)
    text = format_summary({"mode": "closed", "concurrency": 2}, s)
    old = {k: v for k, v in s.items() if k not in ("percentiles", "prompt_tokens")}  # a file from before
    assert format_summary({"mode": "closed", "concurrency": 2}, old) == text
    rows = [line.split() for line in text.splitlines()]
    assert ["ms", "mean", "p50", "p90", "p99"] in rows
    assert [r[0] for r in rows if r and r[0] in ("TTFT", "ITL", "TPOT", "E2E")] == ["TTFT", "ITL", "TPOT", "E2E"]


# ---------------------------------------------------------------- warm-up


class CountingClient:
    """An in-process client: every request succeeds after `delay_s` with a TTFT of `ttft_s[i]` (the i-th
    request sent; the last value for the rest), so a test can tell warm-up requests from measured ones."""

    def __init__(self, ttft_s: list[float], delay_s: float = 0.0, fail: int = 0) -> None:
        self.ttft_s, self.delay_s, self.fail = ttft_s, delay_s, fail
        self.sent: list[RequestSpec] = []
        self.active = self.max_active = 0

    async def send(self, spec: RequestSpec) -> RequestRecord:
        i = len(self.sent)
        self.sent.append(spec)
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            await asyncio.sleep(self.delay_s)
        finally:
            self.active -= 1
        r = RequestRecord(spec.index, spec.prompt_tokens, spec.output_tokens)
        if i < self.fail:
            return r.fail(R.CONNECTION, "refused")
        ttft = self.ttft_s[min(i, len(self.ttft_s) - 1)]
        r.ttft_s, r.chunk_times_s, r.e2e_s = ttft, [ttft, ttft + 0.01], ttft + 0.01
        r.output_tokens, r.finish_reason = 2, "length"
        return r

    async def aclose(self) -> None:
        pass


def test_warm_up_runs_every_request_and_reports_counts() -> None:
    client = CountingClient([1.0], delay_s=0.01, fail=1)
    specs = build_workload("multi-turn:2:4:2:2", 5, seed=1)
    result = asyncio.run(warm_up(client, specs, concurrency=2))
    assert len(client.sent) == 5 and client.max_active == 2
    assert all(s.conversation is None for s in client.sent)  # sent as independent requests
    assert (result.requests, result.ok, result.errors_by_kind) == (5, 4, {"connection": 1})
    assert asyncio.run(warm_up(client, [])).requests == 0
    everything = CountingClient([1.0], delay_s=0.01)
    asyncio.run(warm_up(everything, specs))
    assert everything.max_active == 5  # no concurrency given: all at once


@pytest.mark.parametrize("load", [["--rate", "inf"], ["--concurrency", "2"]])
def test_warm_up_requests_are_in_no_metric(monkeypatch, tmp_path, capsys, load: list[str]) -> None:
    client = CountingClient([9.0, 9.0, 9.0, 0.01], delay_s=0.005)  # the 3 warm-up requests are very slow
    monkeypatch.setattr(cli, "make_client", lambda *a, **k: client)
    out = tmp_path / "r.json"
    rc = cli.main(["--target", "http://x", "--workload", "fixed:8:4", *load, "--num-requests", "5",
                   "--warmup", "3", "--vocab-size", "1000", "--no-progress", "--out", str(out)])
    assert rc == 0
    assert "warm-up: 3 requests before the measured runs, 3 ok" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["meta"]["warmup"]["requests"] == 3 and doc["meta"]["warmup"]["ok"] == 3
    run = doc["runs"][0]
    assert len(client.sent) == 8 and len(run["records"]) == 5 and run["config"]["sent"] == 5
    s = run["summary"]
    assert s["requests"]["total"] == 5 and s["ttft_s"]["count"] == 5 and s["ttft_s"]["max"] == 0.01
    assert s["throughput"]["output_tokens_per_s"] == pytest.approx(10 / s["wall_time_s"])
    measured = build_workload("fixed:8:4", 5, seed=0, vocab_size=1000)
    warm = build_workload("fixed:8:4", 3, seed=warmup_seed(0), vocab_size=1000)
    assert client.sent == warm + measured  # the warm-up first, with prompts of its own
    assert not {s.prompt_token_ids for s in warm} & {s.prompt_token_ids for s in measured}


def test_no_warm_up_by_default(monkeypatch, tmp_path) -> None:
    client = CountingClient([0.01])
    monkeypatch.setattr(cli, "make_client", lambda *a, **k: client)
    out = tmp_path / "r.json"
    assert cli.main(["--target", "http://x", "--workload", "fixed:4:2", "--rate", "inf", "--num-requests", "2",
                     "--vocab-size", "1000", "--no-progress", "--out", str(out)]) == 0
    assert len(client.sent) == 2
    assert json.loads(out.read_text())["meta"]["warmup"] == {"requests": 0, "ok": 0, "errors_by_kind": {},
                                                             "wall_time_s": 0.0}


# ---------------------------------------------------------------- chat body and messages


def test_chat_body_holds_messages_and_max_completion_tokens() -> None:
    spec = build_workload("fixed:6:3", 1, seed=0)[0]
    body = OpenAIClient("127.0.0.1:1", model="m", endpoint="chat").body(spec)
    assert body == {"messages": [{"role": "user", "content": spec.prompt_text}], "max_completion_tokens": 3,
                    "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
                    "ignore_eos": True, "model": "m"}
    client = OpenAIClient("127.0.0.1:1", endpoint="chat")
    assert client.url == "http://127.0.0.1:1/v1/chat/completions"
    assert OpenAIClient("127.0.0.1:1").url == "http://127.0.0.1:1/v1/completions"
    assert "prompt" in OpenAIClient("127.0.0.1:1").body(spec)
    with pytest.raises(ValueError, match="token-id prompt"):
        chat_messages(build_workload("fixed:6:3", 1, vocab_size=1000)[0])


def test_multi_turn_text_specs_carry_their_history_as_messages() -> None:
    specs = build_workload("multi-turn:3:5:2:2", 3, seed=0)
    assert [[m.role for m in s.messages] for s in specs] == [
        ["system", "user"], ["system", "user", "assistant", "user"],
        ["system", "user", "assistant", "user", "assistant", "user"]]
    assert all(" ".join(m.content for m in s.messages) == s.prompt_text for s in specs)
    assert all(s.messages is None for s in build_workload("multi-turn:3:5:2:2", 3, vocab_size=1000))
    assert all(s.messages is None for s in build_workload("prefix:2:4:2:2", 3))
    with pytest.raises(ValueError, match="role must be one of"):
        ChatMessage("tool", "x")
    with pytest.raises(AssertionError):
        RequestSpec(0, 1, 1, prompt_token_ids=(5,), messages=(ChatMessage("user", "x"),))


def answer(ok: bool = True, ids: list[int] | None = None, text: str | None = None, n: int = 2) -> RequestRecord:
    rec = RequestRecord(0, 1, n, output_tokens=n, output_token_ids=ids, output_text=text)
    return rec if ok else rec.fail(R.SERVER_ERROR, "boom")


def test_with_replies_puts_each_answer_where_its_stand_in_was() -> None:
    """Token ids: each span takes the answer's ids (of any length, later spans moved along); text: the
    assistant messages take its text. A failed turn, or one whose ids the server did not send, keeps its
    stand-in and is counted."""
    spec = build_workload("multi-turn:3:5:2:2", 3, seed=0, vocab_size=1000)[2]
    ids = spec.prompt_token_ids
    assert spec.reply_spans == ((7, 9), (11, 13)) and len(ids) == 15  # system 5, user 2, reply 2, user 2, ...
    got, kept = with_replies(spec, [answer(ids=[1, 2, 3]), answer(ids=[4])])
    assert got.prompt_token_ids == ids[:7] + (1, 2, 3) + ids[9:11] + (4,) + ids[13:] and kept == 0
    assert got.prompt_tokens == 15 and got.turn == 2 and got.reply_spans == spec.reply_spans
    got, kept = with_replies(spec, [answer(ok=False, ids=[1]), answer(ids=None, text="t")])
    assert got.prompt_token_ids == ids and kept == 2
    text = build_workload("multi-turn:3:5:2:2", 3, seed=0)[2]
    got, kept = with_replies(text, [answer(text="one two three", n=3), answer(ok=False, text="x")])
    assert [m.content for m in got.messages] == [m.content for m in text.messages[:2]] + ["one two three"] + \
        [m.content for m in text.messages[3:]] and kept == 1
    assert got.prompt_text == " ".join(m.content for m in got.messages) and got.prompt_tokens == text.prompt_tokens + 1
    one = build_workload("fixed:4:2", 1, seed=0)[0]
    assert with_replies(one, []) == (one, 0)


def test_a_spec_keeping_its_output_asks_for_token_ids_only_for_a_token_id_prompt() -> None:
    ids = RequestSpec(0, 2, 2, prompt_token_ids=(5, 6), keep_output=True)
    assert OpenAIClient("127.0.0.1:1").body(ids)["return_token_ids"] is True
    text = RequestSpec(0, 2, 2, prompt_text="a b", keep_output=True)  # any OpenAI server: its text is enough
    assert "return_token_ids" not in OpenAIClient("127.0.0.1:1").body(text)
    assert "return_token_ids" not in OpenAIClient("127.0.0.1:1").body(RequestSpec(0, 2, 2, prompt_token_ids=(5, 6)))


def test_make_client_endpoints() -> None:
    with pytest.raises(ValueError, match="unknown endpoint"):
        make_client("openai", "http://x", endpoint="embeddings")
    with pytest.raises(ValueError, match="grpc api has none"):
        make_client("grpc", "127.0.0.1:1", endpoint="chat")


# ---------------------------------------------------------------- flags


BASE = ["--target", "http://127.0.0.1:9", "--workload", "fixed:4:2", "--num-requests", "2", "--no-progress"]


@pytest.mark.parametrize("flags,msg", [
    (["--rate", "1", "--burstiness", "0"], "argument --burstiness: expected a number > 0, got '0'"),
    (["--rate", "1", "--burstiness", "-2"], "argument --burstiness"),
    (["--rate", "1", "--metric-percentiles", "50,101"], "argument --metric-percentiles/--percentiles:"),
    (["--rate", "1", "--percentiles", "x"], "argument --metric-percentiles/--percentiles:"),
    (["--rate", "1", "--percentile-metrics", "ttft,latency"], "argument --percentile-metrics: .*latency"),
    (["--rate", "1", "--num-warmups", "-1"], "argument --num-warmups/--warmup: expected an integer >= 0"),
    (["--rate", "1", "--endpoint", "embeddings"], "argument --endpoint: expected one of completions"),
])
def test_bad_flags_name_the_flag(capsys, flags: list[str], msg: str) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(BASE + flags)
    assert e.value.code == 2
    assert re.search(msg, capsys.readouterr().err)


@pytest.mark.parametrize("flags,msg", [
    (["--concurrency", "2", "--burstiness", "0.5"], "--burstiness shapes open-loop arrivals"),
    (["--rate", "1", "--endpoint", "chat", "--vocab-size", "1000"], "--endpoint chat sends text messages"),
    (["--rate", "1", "--endpoint", "chat", "--token-range", "300:400"], "--endpoint chat sends text messages"),
    (["--rate", "1", "--endpoint", "chat", "--api", "grpc"], "use it with --api openai"),
])
def test_bad_flag_combinations_are_refused_before_sending(monkeypatch, capsys, flags: list[str], msg: str) -> None:
    monkeypatch.setattr(cli, "make_client", lambda *a, **k: pytest.fail("nothing may be sent"))
    assert cli.main(BASE + flags) == 2
    assert msg in capsys.readouterr().err


def test_a_directory_as_out_is_refused_before_sending(monkeypatch, capsys, tmp_path) -> None:
    """The results file's path is checked before the run, not when the measured results are written."""
    monkeypatch.setattr(cli, "make_client", lambda *a, **k: pytest.fail("nothing may be sent"))
    assert cli.main(BASE + ["--rate", "1", "--out", str(tmp_path)]) == 2
    assert f"--out {tmp_path} is a directory" in capsys.readouterr().err


def test_vllm_spellings_parse_to_the_same_flags() -> None:
    import argparse

    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    a = p.parse_args(["--target", "t", "--request-rate", "4", "--num-prompts", "7", "--num-warmups", "2",
                      "--endpoint", "/v1/chat/completions", "--metric-percentiles", "99", "--percentile-metrics",
                      "ttft,tpot,itl", "--burstiness", "inf"])
    b = p.parse_args(["--target", "t", "--rate", "4", "--num-requests", "7", "--warmup", "2", "--endpoint", "chat",
                      "--percentiles", "99", "--percentile-metrics", "ttft,tpot,itl", "--burstiness", "inf"])
    assert a == b and a.endpoint == "chat" and a.metric_percentiles == (99.0,) and a.burstiness == math.inf
    d = p.parse_args(["--target", "t", "--rate", "1"])
    assert (d.endpoint, d.burstiness, d.num_warmups, d.metric_percentiles, d.percentile_metrics) == (
        "completions", 1.0, 0, None, None)
