"""loadtest against a real OpenAI-compatible streaming server (aiohttp, SSE) with known delays and faults.

The server runs in a background thread on 127.0.0.1: first token after TTFT_S, then one token every ITL_S,
exactly max_tokens of them, then a usage event with pdserve_timings and [DONE]. It refuses (400) any body
that is not what the harness must send. Fault variants break chosen requests in the ways real servers do.
"""
from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable, Iterator
from typing import Self

import pytest
from aiohttp import web

from loadtest import cli
from loadtest.clients import make_client
from loadtest.metrics import summarize
from loadtest.runner import run_closed_loop, run_open_loop
from loadtest.workload import build_workload

TTFT_S, ITL_S = 0.05, 0.01
# Upper bounds allow for a busy 2-core machine; lower bounds are exact (the server sleeps at least that long).
SLACK_S = 1.0  # generous: the point is the arithmetic, not this machine's timing
FAULTS = ("ok", "http_500", "bad_json", "drop", "missing_fields", "error_event", "no_finish")


class SSEServer:
    """A real HTTP server speaking OpenAI's streaming completions. fault(n) picks the n-th request's fault."""

    def __init__(self, ttft_s: float = TTFT_S, itl_s: float = ITL_S,
                 fault: Callable[[int], str] = lambda n: "ok", usage: bool = True) -> None:
        self.ttft_s, self.itl_s, self.fault, self.usage = ttft_s, itl_s, fault, usage
        self.bodies: list[dict] = []
        self.active = self.max_active = 0
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        assert self._ready.wait(10), "server did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _serve(self) -> None:
        self.loop = asyncio.new_event_loop()
        app = web.Application()
        app.router.add_post("/v1/completions", self._completions)
        runner = web.AppRunner(app, handler_cancellation=True)
        self.loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.port = runner.addresses[0][1]
        self._ready.set()
        self.loop.run_forever()
        self.loop.run_until_complete(runner.cleanup())
        self.loop.close()

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        n = len(self.bodies)
        self.bodies.append(body)
        problem = _check_body(body)
        if problem:
            return web.json_response({"error": {"message": problem}}, status=400)
        fault = self.fault(n)
        if fault == "http_500":
            return web.json_response({"error": {"message": "internal"}}, status=500)
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            return await self._stream(request, body, fault, n)
        finally:
            self.active -= 1

    async def _stream(self, request: web.Request, body: dict, fault: str, n: int) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)

        async def send(obj: dict | str) -> None:
            await resp.write(b"data: " + (obj if isinstance(obj, str) else json.dumps(obj)).encode() + b"\n\n")

        max_tokens = body["max_tokens"]
        await asyncio.sleep(self.ttft_s)
        for i in range(max_tokens):
            if i:
                await asyncio.sleep(self.itl_s)
            if i == 2 and fault == "bad_json":
                await send('{"choices": [{"text": "x"')
            elif i == 2 and fault == "drop":
                request.transport.abort()
                return resp
            elif i == 2 and fault == "missing_fields":
                await send({"id": "cmpl-1", "object": "text_completion"})
            elif i == 2 and fault == "error_event":
                await send({"error": {"message": "worker failed", "type": "internal_error"}})
                await send("[DONE]")
                return resp
            last = i == max_tokens - 1
            finish = "length" if last and fault != "no_finish" else None
            await send({"id": "cmpl-1", "object": "text_completion", "model": "m", "usage": None,
                        "choices": [{"text": f" t{i}", "index": 0, "logprobs": None, "finish_reason": finish}]})
        if self.usage:
            remote = n % 2 == 1
            timings = {"path": "remote" if remote else "local", "prefill_worker": "p0" if remote else None,
                       "decode_worker": "d0", "queue_s": 0.001, "prefill_s": self.ttft_s,
                       "transfer_s": 0.002 if remote else 0.0, "decode_s": self.itl_s * (max_tokens - 1),
                       "ttft_s": self.ttft_s, "e2e_s": self.ttft_s + self.itl_s * (max_tokens - 1)}
            await send({"id": "cmpl-1", "object": "text_completion", "choices": [],
                        "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": max_tokens,
                                  "total_tokens": len(body["prompt"]) + max_tokens, "pdserve_timings": timings}})
        await send("[DONE]")
        await resp.write_eof()
        return resp


def _check_body(body: dict) -> str | None:
    """What the harness must send: a streamed, greedy, fixed-length completion of token ids."""
    want = {"stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True, "temperature": 0}
    for key, value in want.items():
        if body.get(key) != value:
            return f"{key} must be {value!r}, got {body.get(key)!r}"
    if not isinstance(body.get("max_tokens"), int) or body["max_tokens"] < 1:
        return "max_tokens"
    if not isinstance(body.get("prompt"), list) or not all(isinstance(t, int) for t in body["prompt"]):
        return "prompt must be token ids"
    return None


@pytest.fixture(scope="module")
def server() -> Iterator[SSEServer]:
    with SSEServer() as s:
        yield s


def _run(coro_fn: Callable[..., object], url: str, *args: object, timeout_s: float = 10.0, **kw: object):
    async def main():
        client = make_client("openai", url, timeout_s=timeout_s)
        try:
            return await coro_fn(client, *args, progress=False, **kw)
        finally:
            await client.aclose()

    return asyncio.run(main())


def test_closed_loop_counts_latencies_and_request_shape(server: SSEServer) -> None:
    before = len(server.bodies)
    server.max_active = 0
    specs = build_workload("fixed:8:20", 12, seed=0, vocab_size=512)
    result = _run(run_closed_loop, server.url, specs, 4)
    assert server.max_active == 4  # closed loop: exactly `concurrency` in flight
    bodies = server.bodies[before:]
    assert len(bodies) == 12 and all(len(b["prompt"]) == 8 and b["max_tokens"] == 20 for b in bodies)
    assert sorted(tuple(b["prompt"]) for b in bodies) == sorted(s.prompt_token_ids for s in specs)

    recs = result.records
    assert [r.index for r in recs] == list(range(12)) and all(r.ok for r in recs), [r.error for r in recs]
    assert all(r.output_tokens == 20 and r.output_tokens_source == "usage" and len(r.chunk_times_s) == 20
               for r in recs)
    assert all(r.finish_reason == "length" and r.server_prompt_tokens == 8 for r in recs)
    assert {r.timings["path"] for r in recs} == {"local", "remote"}
    assert all(r.timings["prefill_s"] == TTFT_S for r in recs)

    s = summarize(recs, result.wall_time_s, ttft_target_s=1.0, tpot_target_s=0.1)
    assert s["requests"] == {"total": 12, "ok": 12, "errors": 0, "short_outputs": 0}
    assert TTFT_S <= s["ttft_s"]["min"] and s["ttft_s"]["p50"] < TTFT_S + SLACK_S
    assert ITL_S * 0.8 <= s["itl_s"]["mean"] < ITL_S + SLACK_S / 5
    assert ITL_S * 0.8 <= s["tpot_s"]["p50"] < ITL_S + SLACK_S / 5
    assert s["itl_s"]["count"] == 12 * 19
    # 3 waves of 4 requests, each ~0.05 + 19 * 0.01 s
    assert 3 * (TTFT_S + 19 * ITL_S) <= result.wall_time_s < 3 * (TTFT_S + 19 * ITL_S) + 10 * SLACK_S
    assert s["throughput"]["output_tokens_per_s"] == pytest.approx(240 / result.wall_time_s)
    assert s["goodput"]["good_requests"] == 12
    assert summarize(recs, result.wall_time_s, ttft_target_s=TTFT_S * 0.9)["goodput"]["good_requests"] == 0
    assert summarize(recs, result.wall_time_s, tpot_target_s=ITL_S * 0.5)["goodput"]["good_requests"] == 0


def test_open_loop_sends_on_schedule_without_waiting(server: SSEServer) -> None:
    server.max_active = 0
    specs = build_workload("fixed:4:20", 20, seed=1, vocab_size=512)
    result = _run(run_open_loop, server.url, specs, 40.0, seed=5)
    recs = result.records
    assert len(recs) == 20 and all(r.ok for r in recs), [r.error for r in recs]
    assert server.max_active > 2  # arrivals do not wait for earlier responses
    assert max(r.start_s - r.scheduled_s for r in recs) < SLACK_S
    assert recs[-1].scheduled_s > 0.1  # a spread schedule, not a burst
    assert result.wall_time_s >= recs[-1].scheduled_s + TTFT_S + 19 * ITL_S
    assert result.config["mode"] == "open" and result.config["rate"] == 40.0 and result.config["sent"] == 20
    good = summarize(recs, result.wall_time_s, 1.0, 0.1)["goodput"]
    assert good["good_requests"] == 20 and good["requests_per_s"] == pytest.approx(20 / result.wall_time_s)


def test_malformed_responses_are_counted_as_errors_and_the_run_completes() -> None:
    with SSEServer(fault=lambda n: FAULTS[n % len(FAULTS)]) as bad:
        specs = build_workload("fixed:4:6", 2 * len(FAULTS), seed=0, vocab_size=512)
        result = _run(run_closed_loop, bad.url, specs, 3)
    s = summarize(result.records, result.wall_time_s)
    assert s["requests"]["total"] == 14 and s["requests"]["ok"] == 2
    assert s["errors_by_kind"] == {"bad_json": 2, "bad_response": 2, "connection": 2, "http_500": 2,
                                   "incomplete": 2, "server_error": 2}
    errors = {r.error_kind: r.error for r in result.records if not r.ok}
    assert "HTTP 500" in errors["http_500"] and "worker failed" in errors["server_error"]
    assert all(r.e2e_s is not None for r in result.records)


def test_output_tokens_fall_back_to_chunks_without_usage() -> None:
    with SSEServer(usage=False) as srv:
        result = _run(run_closed_loop, srv.url, build_workload("fixed:4:7", 2, vocab_size=512), 2)
    assert all(r.ok and r.output_tokens == 7 and r.output_tokens_source == "chunks" and r.timings is None
               for r in result.records)


def test_timeout_and_max_duration() -> None:
    with SSEServer(ttft_s=5.0) as slow:
        timed = _run(run_closed_loop, slow.url, build_workload("fixed:4:3", 2, vocab_size=512), 2, timeout_s=0.2)
        assert [r.error_kind for r in timed.records] == ["timeout", "timeout"]
        assert all(0.2 <= r.e2e_s < 0.2 + 5 * SLACK_S for r in timed.records)
        cut = _run(run_closed_loop, slow.url, build_workload("fixed:4:3", 6, vocab_size=512), 2,
                   max_duration_s=0.3)
    assert cut.wall_time_s < 0.3 + 5 * SLACK_S and cut.config["stopped_by_max_duration"]
    assert [r.error_kind for r in cut.records] == ["cancelled", "cancelled"]  # nothing new after the deadline


def test_cli_writes_json_and_plots_and_compare(server: SSEServer, tmp_path, capsys) -> None:
    out, plots = tmp_path / "r.json", tmp_path / "plots"
    sent_before = len(server.bodies)
    rc = cli.main(["--target", server.url, "--workload", "fixed:6:8", "--rates", "30,60", "--num-requests", "8",
                   "--vocab-size", "512", "--ttft-target", "1", "--tpot-target", "0.1", "--label", "fake",
                   "--out", str(out), "--plots", str(plots), "--no-progress"])
    assert rc == 0
    assert "goodput" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["label"] == "fake" and [r["config"]["rate"] for r in doc["runs"]] == [30.0, 60.0]
    assert all(r["summary"]["requests"]["ok"] == 8 and len(r["records"]) == 8 for r in doc["runs"])
    assert all(r["summary"]["goodput"]["good_requests"] == 8 for r in doc["runs"])
    first, second = (server.bodies[sent_before + 8 * i:sent_before + 8 * (i + 1)] for i in range(2))
    assert not {tuple(b["prompt"]) for b in first} & {tuple(b["prompt"]) for b in second}  # no prompt replayed
    for name in ("latency_cdf.png", "phases_0.png", "phases_1.png", "goodput_vs_rate.png"):
        assert (plots / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    other = tmp_path / "r2.json"
    other.write_text(out.read_text().replace('"fake"', '"other"'))
    assert cli.main(["compare", str(out), str(other), "--out", str(tmp_path / "cmp.png")]) == 0
    assert (tmp_path / "cmp.png").read_bytes()[:4] == b"\x89PNG"


def test_cli_unreachable_server_and_bad_workload(tmp_path, capsys) -> None:
    with SSEServer() as srv:
        url = srv.url  # the port is free again once the server stops
    rc = cli.main(["--target", url, "--workload", "fixed:4:2", "--concurrency", "2", "--num-requests", "3",
                   "--vocab-size", "512", "--no-progress", "--out", str(tmp_path / "r.json")])
    assert rc == 1
    assert json.loads((tmp_path / "r.json").read_text())["runs"][0]["summary"]["errors_by_kind"] == {"connection": 3}
    assert cli.main(["--target", url, "--workload", "fixed:x", "--rate", "1", "--no-progress"]) == 2
    assert "fixed:PROMPT_TOKENS:OUTPUT_TOKENS" in capsys.readouterr().err
