"""loadtest against a real OpenAI-compatible streaming server (aiohttp, SSE) with known delays and faults.

The server runs in a background thread on 127.0.0.1: first token after TTFT_S, then one token every ITL_S,
exactly max_tokens of them, then a usage event with pdserve_timings and [DONE]. It refuses (400) any body
that is not what the harness must send. Fault variants break chosen requests in the ways real servers do.
It serves /v1/chat/completions too, in chat's shapes (a role chunk first, content deltas, an empty delta
with the finish reason), counting prompt tokens as a chat template would: the messages' words plus
TEMPLATE_TOKENS per message.
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
from loadtest.runner import run_closed_loop, run_conversations, run_open_loop
from loadtest.workload import build_workload

TTFT_S, ITL_S = 0.05, 0.01
TEMPLATE_TOKENS = 5  # the fake chat template's tokens per message
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
        app.router.add_post("/v1/chat/completions", self._chat)
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
        return await self._serve_request(request, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve_request(request, chat=True)

    async def _serve_request(self, request: web.Request, chat: bool) -> web.StreamResponse:
        body = await request.json()
        n = len(self.bodies)
        self.bodies.append(body)
        problem = _check_chat_body(body) if chat else _check_body(body)
        if problem:
            return web.json_response({"error": {"message": problem}}, status=400)
        fault = self.fault(n)
        if fault == "http_500":
            return web.json_response({"error": {"message": "internal"}}, status=500)
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            return await self._stream(request, body, fault, n, chat)
        finally:
            self.active -= 1

    async def _stream(self, request: web.Request, body: dict, fault: str, n: int,
                      chat: bool = False) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)

        async def send(obj: dict | str) -> None:
            await resp.write(b"data: " + (obj if isinstance(obj, str) else json.dumps(obj)).encode() + b"\n\n")

        def chunk(text: str, finish: str | None) -> dict:
            if not chat:
                return {"id": "cmpl-1", "object": "text_completion", "model": "m", "usage": None,
                        "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish}]}
            return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "m", "usage": None,
                    "choices": [{"delta": {"content": text} if text else {}, "index": 0, "logprobs": None,
                                 "finish_reason": finish}]}

        if chat:
            max_tokens = body["max_completion_tokens"]
            prompt_tokens = sum(len(m["content"].split()) + TEMPLATE_TOKENS for m in body["messages"])
            await send({"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "m", "usage": None,
                        "choices": [{"delta": {"role": "assistant", "content": ""}, "index": 0,
                                     "logprobs": None, "finish_reason": None}]})
        else:
            max_tokens, prompt_tokens = body["max_tokens"], len(body["prompt"])
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
            if chat:  # chat ends with an empty delta carrying the finish reason
                await send(chunk(f" t{i}", None))
                if finish:
                    await send(chunk("", finish))
            else:
                await send(chunk(f" t{i}", finish))
        if self.usage:
            remote = n % 2 == 1
            timings = {"path": "remote" if remote else "local", "prefill_worker": "p0" if remote else None,
                       "decode_worker": "d0", "queue_s": 0.001, "prefill_s": self.ttft_s,
                       "transfer_s": 0.002 if remote else 0.0, "decode_s": self.itl_s * (max_tokens - 1),
                       "ttft_s": self.ttft_s, "e2e_s": self.ttft_s + self.itl_s * (max_tokens - 1)}
            await send({"id": "cmpl-1", "object": "text_completion", "choices": [],
                        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": max_tokens,
                                  "total_tokens": prompt_tokens + max_tokens, "pdserve_timings": timings}})
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


def _check_chat_body(body: dict) -> str | None:
    """What the harness must send to chat: streamed, greedy, fixed-length, text messages, no prompt."""
    want = {"stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True, "temperature": 0}
    for key, value in want.items():
        if body.get(key) != value:
            return f"{key} must be {value!r}, got {body.get(key)!r}"
    if "prompt" in body or "max_tokens" in body:
        return "chat takes messages and max_completion_tokens"
    if not isinstance(body.get("max_completion_tokens"), int) or body["max_completion_tokens"] < 1:
        return "max_completion_tokens"
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and set(m) == {"role", "content"} and m["role"] in ("system", "user", "assistant")
            and isinstance(m["content"], str) and m["content"] for m in messages):
        return "messages must be a non-empty list of {role, content} with text content"
    if messages[-1]["role"] != "user":
        return "the last message must be the user's"
    return None


@pytest.fixture(scope="module")
def server() -> Iterator[SSEServer]:
    with SSEServer() as s:
        yield s


def _run(coro_fn: Callable[..., object], url: str, *args: object, timeout_s: float = 10.0,
         endpoint: str = "completions", **kw: object):
    async def main():
        client = make_client("openai", url, timeout_s=timeout_s, endpoint=endpoint)
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


# ---------------------------------------------------------------- the chat endpoint


def test_chat_endpoint_streams_messages_and_records_the_servers_prompt_count(server: SSEServer) -> None:
    before = len(server.bodies)
    specs = build_workload("fixed:12:10", 6, seed=4)  # text prompts: chat sends text
    result = _run(run_closed_loop, server.url, specs, 3, endpoint="chat")
    bodies = server.bodies[before:]
    assert len(bodies) == 6 and all(b["max_completion_tokens"] == 10 and "prompt" not in b for b in bodies)
    assert sorted(b["messages"][0]["content"] for b in bodies) == sorted(s.prompt_text for s in specs)
    assert all(b["messages"] == [{"role": "user", "content": b["messages"][0]["content"]}] for b in bodies)

    recs = result.records
    assert all(r.ok for r in recs), [r.error for r in recs]
    # the role chunk and the finishing empty delta carry no output: one chunk per token, timed as for completions
    assert all(r.output_tokens == 10 and r.output_tokens_source == "usage" and len(r.chunk_times_s) == 10
               and r.finish_reason == "length" for r in recs)
    assert all(r.prompt_tokens == 12 and r.server_prompt_tokens == 12 + TEMPLATE_TOKENS for r in recs)
    s = summarize(recs, result.wall_time_s)
    assert TTFT_S <= s["ttft_s"]["min"] and s["ttft_s"]["p50"] < TTFT_S + SLACK_S
    assert ITL_S * 0.8 <= s["itl_s"]["mean"] < ITL_S + SLACK_S / 5 and s["itl_s"]["count"] == 6 * 9
    assert s["prompt_tokens"] == {"workload": 6 * 12, "server": 6 * (12 + TEMPLATE_TOKENS)}


def test_chat_endpoint_sends_a_multi_turn_history_as_messages(server: SSEServer) -> None:
    before = len(server.bodies)
    specs = build_workload("multi-turn:3:8:4:2", 6, seed=2)
    result = _run(run_conversations, server.url, specs, 50.0, 0.0, seed=1, endpoint="chat")
    assert all(r.ok for r in result.records), [r.error for r in result.records]
    by_prompt = {" ".join(m["content"] for m in b["messages"]): b for b in server.bodies[before:]}
    for spec in specs:
        msgs = by_prompt[spec.prompt_text]["messages"]
        assert [m["role"] for m in msgs] == ["system"] + ["user", "assistant"] * spec.turn + ["user"]
        assert [m["content"] for m in msgs] == [m.content for m in spec.messages]
    assert len({b["messages"][0]["content"] for b in server.bodies[before:]}) == 1  # one shared system prompt
    counted = {r.index: r.server_prompt_tokens for r in result.records}
    assert all(counted[s.index] == s.prompt_tokens + TEMPLATE_TOKENS * (2 + 2 * s.turn) for s in specs)


def test_cli_chat_warmup_burstiness_and_percentiles(server: SSEServer, tmp_path, capsys) -> None:
    out = tmp_path / "chat.json"
    before = len(server.bodies)
    rc = cli.main(["--target", server.url, "--endpoint", "/v1/chat/completions", "--workload", "fixed:6:5",
                   "--request-rate", "50", "--burstiness", "0.5", "--num-prompts", "8", "--num-warmups", "3",
                   "--metric-percentiles", "99.9,50,99", "--percentile-metrics", "ttft,e2el",
                   "--no-progress", "--out", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "warm-up: 3 requests before the measured runs, 3 ok" in printed
    assert "burstiness 0.5 (gamma arrivals)" in printed
    header = next(line for line in printed.splitlines() if line.strip().startswith("ms"))
    assert header.split() == ["ms", "mean", "p50", "p99", "p99.9"]
    assert "TTFT" in printed and "E2E" in printed and "   ITL " not in printed and "   TPOT " not in printed
    assert "prompt tokens: 88 counted by the server, 48 by the workload" in printed

    doc = json.loads(out.read_text())
    assert doc["meta"]["endpoint"] == "chat"
    assert doc["meta"]["warmup"] == {"requests": 3, "ok": 3, "errors_by_kind": {},
                                     "wall_time_s": pytest.approx(doc["meta"]["warmup"]["wall_time_s"])}
    run = doc["runs"][0]
    assert run["config"]["burstiness"] == 0.5 and run["config"]["rate"] == 50.0
    assert len(server.bodies) - before == 3 + 8 and len(run["records"]) == 8  # the warm-up is in no record
    warm = {b["messages"][0]["content"] for b in server.bodies[before:before + 3]}
    measured = {b["messages"][0]["content"] for b in server.bodies[before + 3:]}
    assert not warm & measured  # the warm-up draws its own prompts
    s = run["summary"]
    assert s["requests"]["total"] == 8 and s["ttft_s"]["count"] == 8
    assert s["percentiles"] == {"percentiles": [50.0, 99.0, 99.9], "metrics": ["ttft", "e2el"]}
    assert {"p50", "p90", "p99", "p99.9"} <= set(s["ttft_s"]) and "p99.9" in s["e2e_s"]
    assert "p99.9" not in s["itl_s"] and "p50" in s["itl_s"]  # every metric keeps p50 / p90 / p99


def test_cli_chat_refuses_token_id_prompts_and_grpc(server: SSEServer, capsys) -> None:
    base = ["--target", server.url, "--workload", "fixed:4:2", "--rate", "10", "--num-requests", "2",
            "--no-progress"]
    assert cli.main([*base, "--endpoint", "chat", "--vocab-size", "512"]) == 2
    assert "--endpoint chat sends text messages" in capsys.readouterr().err
    assert cli.main([*base, "--endpoint", "chat", "--api", "grpc"]) == 2
    assert "use it with --api openai" in capsys.readouterr().err
