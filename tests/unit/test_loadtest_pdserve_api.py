"""loadtest against pdserve's own API servers (OpenAI HTTP and gRPC, over the deterministic FakeRouter):
the harness reads pdserve's real wire format — usage, `pdserve_timings`, in-band errors, 429s, API keys."""
from __future__ import annotations

import asyncio
import itertools
import json
import threading
from collections.abc import Iterator

import pytest

from loadtest.clients import make_client
from loadtest.metrics import summarize
from loadtest.runner import RunResult, run_closed_loop, run_conversations
from loadtest.workload import build_workload
from router.grpc_server import start_grpc_server
from router.http_server import start_http_server
from tests.unit.fake_router import FakeRouter

KEY = "sk-loadtest-0123456789"


class Served:
    """pdserve's HTTP and gRPC servers over one FakeRouter, on a background event loop."""

    def __init__(self, api_keys: frozenset[str] = frozenset()) -> None:
        self.router = FakeRouter(token_delay_ms=2)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.runner, self.http_port = self._call(start_http_server(self.router, "127.0.0.1", 0, api_keys=api_keys))
        self.grpc, self.grpc_port = self._call(start_grpc_server(self.router, "127.0.0.1", 0, api_keys=api_keys))

    def _call(self, coro: object) -> object:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)  # type: ignore[arg-type]

    def target(self, api: str) -> str:
        return f"http://127.0.0.1:{self.http_port}" if api == "openai" else f"127.0.0.1:{self.grpc_port}"

    def close(self) -> None:
        self._call(self.runner.cleanup())
        self._call(self.grpc.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    s = Served()
    yield s
    s.close()


def run(api: str, target: str, specs: list, concurrency: int = 3, api_key: str | None = None) -> RunResult:
    async def main() -> RunResult:
        client = make_client(api, target, timeout_s=10, api_key=api_key)
        try:
            return await run_closed_loop(client, specs, concurrency, progress=False)
        finally:
            await client.aclose()

    return asyncio.run(main())


@pytest.mark.parametrize("api", ["openai", "grpc"])
def test_token_id_prompts_usage_and_timings(served: Served, api: str) -> None:
    specs = build_workload("fixed:5:12", 6, seed=0, vocab_size=64)
    result = run(api, served.target(api), specs)
    recs = result.records
    assert all(r.ok for r in recs), [r.error for r in recs]
    assert all(r.output_tokens == 12 and r.output_tokens_source == "usage" and r.finish_reason == "length"
               for r in recs)
    assert all(r.server_prompt_tokens == 5 and len(r.chunk_times_s) == 12 for r in recs)
    assert all(r.timings["path"] == "remote" and r.timings["transfer_s"] == pytest.approx(0.002) for r in recs)
    sent = served.router.requests[-6:]
    assert all(q.sampling.ignore_eos and q.sampling.max_tokens == 12 and q.sampling.temperature == 0 for q in sent)
    assert sorted(tuple(q.prompt) for q in sent) == sorted(s.prompt_token_ids for s in specs)
    assert summarize(recs, result.wall_time_s, 5.0, 1.0)["goodput"]["good_requests"] == 6


@pytest.mark.parametrize("api,kinds", [
    ("openai", {"http_429": 1, "server_error": 1}),
    ("grpc", {"grpc_resource_exhausted": 1, "grpc_internal": 1}),
])
def test_text_prompts_overload_and_mid_stream_failure(served: Served, tmp_path, api: str, kinds: dict) -> None:
    f = tmp_path / "w.jsonl"
    f.write_text("\n".join(json.dumps({"prompt": p, "output_tokens": 4}) for p in ("one two", "overload", "explode")))
    result = run(api, served.target(api), build_workload(str(f), 3))
    s = summarize(result.records, result.wall_time_s)
    assert s["requests"]["ok"] == 1 and s["errors_by_kind"] == kinds
    assert "KV transfer failed" in next(r.error for r in result.records if r.index == 2)


@pytest.mark.parametrize("api", ["openai", "grpc"])
def test_api_key(api: str) -> None:
    s = Served(api_keys=frozenset({KEY}))
    try:
        specs = build_workload("fixed:3:2", 2, vocab_size=64)
        refused = run(api, s.target(api), specs)
        assert {r.error_kind for r in refused.records} == {"http_401" if api == "openai" else "grpc_unauthenticated"}
        assert all(r.ok for r in run(api, s.target(api), specs, api_key=KEY).records)
    finally:
        s.close()


@pytest.mark.parametrize("api", ["openai", "grpc"])
def test_conversations_send_their_turns_in_order_after_the_think_time(served: Served, api: str) -> None:
    specs = build_workload("multi-turn:3:20:4:5", 7, seed=0, vocab_size=64)  # conversations of 3, 3 and 1 turns

    async def main() -> RunResult:
        client = make_client(api, served.target(api), timeout_s=10)
        try:
            return await run_conversations(client, specs, float("inf"), think_s=0.05, progress=False)
        finally:
            await client.aclose()

    result = asyncio.run(main())
    recs = result.records
    assert all(r.ok for r in recs) and len(recs) == 7, [r.error for r in recs]
    assert result.config["mode"] == "conversations" and result.config["conversations"] == 3
    by_conv: dict[int, list] = {}
    for r in recs:
        by_conv.setdefault(r.conversation, []).append(r)
    assert sorted((c, len(rs)) for c, rs in by_conv.items()) == [(0, 3), (1, 3), (2, 1)]
    for rs in by_conv.values():
        rs.sort(key=lambda r: r.turn)
        assert [r.turn for r in rs] == list(range(len(rs)))
        for before, after in itertools.pairwise(rs):  # a turn starts only after the last one ended, plus the think time
            assert after.start_s >= before.start_s + before.e2e_s + 0.05
    assert [r.server_prompt_tokens for r in by_conv[0]] == [24, 33, 42]  # the history grows by a user turn + a reply
    assert all(r.cached_tokens == 0 for r in recs)  # the server's usage says what its cache served
    s = summarize(recs, result.wall_time_s)
    assert s["turns"]["first_ttft_s"]["count"] == 3 and s["turns"]["later_ttft_s"]["count"] == 4
    assert s["prefix_cache"] == {"cached_tokens": 0, "prompt_tokens": sum(r.server_prompt_tokens for r in recs),
                                 "fraction": 0.0}


@pytest.mark.parametrize(("api", "endpoint"), [("openai", "completions"), ("openai", "chat"), ("grpc", "completions")])
def test_answered_replies_resend_each_turns_answer_in_the_later_turns(served: Served, api: str, endpoint: str) -> None:
    """replies="answered": every later turn's history holds the answers the server gave (token-id prompts:
    their ids, asked with return_token_ids; chat: their text) where the workload's stand-ins were."""
    chat = endpoint == "chat"
    specs = build_workload("multi-turn:3:6:3:4", 6, seed=5) if chat else \
        build_workload("multi-turn:3:20:4:5", 6, seed=3, vocab_size=64)
    before = len(served.router.requests)

    async def main() -> RunResult:
        client = make_client(api, served.target(api), timeout_s=10, endpoint=endpoint)
        try:
            return await run_conversations(client, specs, float("inf"), progress=False, replies="answered")
        finally:
            await client.aclose()

    result = asyncio.run(main())
    assert all(r.ok for r in result.records), [r.error for r in result.records]
    assert result.config["replies"] == "answered" and result.config["stand_in_replies"] == 0
    sent = served.router.requests[before:]
    if chat:  # the fake answers "w0 w1 ... " (one word per token)
        histories = [[m["content"] for m in r.messages if m["role"] == "assistant"] for r in sent]
        assert sorted(map(len, histories)) == [0, 0, 1, 1, 2, 2]
        assert all(h == ["w0 w1 w2 w3 "] * len(h) for h in histories)
        assert all(r.output_text == "w0 w1 w2 w3 " and r.output_token_ids is None for r in result.records)
        return
    answered = []
    for s in specs:  # the fake's output ids are 100, 101, ...
        ids = list(s.prompt_token_ids)
        for start, end in reversed(s.reply_spans):
            ids[start:end] = range(100, 105)
        answered.append(ids)
    assert sorted(r.prompt for r in sent) == sorted(answered)
    assert any(s.reply_spans for s in specs) and all(r.output_token_ids == list(range(100, 105)) for r in result.records)


def test_chat_endpoint_on_pdserve_sends_the_history_as_messages_and_reads_the_servers_count(served: Served) -> None:
    specs = build_workload("multi-turn:2:6:3:4", 4, seed=5)  # text prompts: 2 conversations of 2 turns

    async def main() -> RunResult:
        client = make_client("openai", served.target("openai"), timeout_s=10, endpoint="chat")
        try:
            return await run_conversations(client, specs, float("inf"), progress=False)
        finally:
            await client.aclose()

    result = asyncio.run(main())
    assert all(r.ok for r in result.records), [r.error for r in result.records]
    assert all(r.output_tokens == 4 and r.output_tokens_source == "usage" and len(r.chunk_times_s) == 4
               for r in result.records)  # pdserve's role chunk carries no output
    sent = {q.messages[-1]["content"]: q for q in served.router.requests[-4:]}
    for spec, r in zip(specs, result.records, strict=True):
        q = sent[spec.messages[-1].content]
        assert q.messages == [{"role": m.role, "content": m.content} for m in spec.messages]
        assert q.sampling.max_tokens == 4 and q.sampling.ignore_eos
        # the fake router renders "role: content" per message: one token more per message than the workload counts
        assert r.server_prompt_tokens == spec.prompt_tokens + len(spec.messages)
