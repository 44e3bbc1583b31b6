"""The OpenAI HTTP API over the FakeRouter: a real aiohttp server, the official openai SDK and raw HTTP."""
from __future__ import annotations

import asyncio
import http.client
import json
import logging
import socket
import threading
import time
from collections.abc import Iterator

import openai
import pytest
from aiohttp import web
from fake_router import MAX_MODEL_LEN, MODEL, FakeRouter, FakeStream

from router.http_server import build_app, start_http_server
from router.limits import RequestLimits
from router.types import GenerateRequest


class ServerThread:
    """A real server on 127.0.0.1 (free port), its event loop running in a background thread.
    With max_body_bytes or limits: an app from `build_app` on a plain runner (handlers not cancelled
    on disconnect)."""

    def __init__(self, router: FakeRouter, max_body_bytes: int | None = None,
                 api_keys: frozenset[str] = frozenset(), limits: RequestLimits | None = None,
                 **options: object) -> None:
        self.router = router
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.runner, self.port = self.call(self._start(max_body_bytes, api_keys, limits, options))

    async def _start(self, max_body_bytes: int | None, api_keys: frozenset[str],
                     limits: RequestLimits | None, options: dict) -> tuple[web.AppRunner, int]:
        if max_body_bytes is None and limits is None:
            return await start_http_server(self.router, "127.0.0.1", 0, api_keys=api_keys, **options)
        runner = web.AppRunner(build_app(self.router, max_body_bytes or 4 << 20, api_keys=api_keys,
                                         limits=limits or RequestLimits()))
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        return runner, runner.addresses[0][1]

    def call(self, coro: object, timeout: float = 10.0) -> object:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)  # type: ignore[arg-type]

    def stop(self) -> None:
        self.call(self.runner.cleanup())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()

    def request(self, method: str, path: str, body: object = None, raw: bytes | None = None,
                headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
        """One HTTP request on a fresh connection. Returns: (status, headers, body)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
            conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
            resp = conn.getresponse()
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
        finally:
            conn.close()


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    s = ServerThread(FakeRouter())
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x", max_retries=0)


def words(n: int) -> str:
    return "".join(f"w{i} " for i in range(n))


def sse_events(body: bytes) -> list[str]:
    """The data payloads of a server-sent event stream, checking the framing."""
    text = body.decode()
    assert text.endswith("\n\n")
    blocks = text[:-2].split("\n\n")
    assert all(b.startswith("data: ") for b in blocks), blocks
    return [b[len("data: "):] for b in blocks]


def assert_error(status: int, body: bytes, want_status: int, param: str | None = None,
                 type_: str = "invalid_request_error", code: str | None = None) -> dict:
    assert status == want_status, body
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert (err["type"], err["param"], err["code"]) == (type_, param, code), err
    assert err["message"] and "Traceback" not in err["message"]
    return err


# ---------------------------------------------------------------- the openai SDK


def test_sdk_completion(client: openai.OpenAI) -> None:
    resp = client.completions.create(model=MODEL, prompt="hello world", max_tokens=5)
    assert resp.object == "text_completion" and resp.id.startswith("cmpl-") and resp.model == MODEL
    assert resp.choices[0].text == words(5) and resp.choices[0].finish_reason == "length"
    assert resp.choices[0].index == 0 and resp.choices[0].logprobs is None
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens, resp.usage.total_tokens) == (2, 5, 7)
    assert resp.usage.prompt_tokens_details.cached_tokens == 0
    assert resp.usage.model_extra["pdserve_timings"]["path"] == "remote"


def test_sdk_chat(client: openai.OpenAI, server: ServerThread) -> None:
    resp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi there"}],
                                          max_completion_tokens=4)
    assert resp.object == "chat.completion" and resp.id.startswith("chatcmpl-")
    msg = resp.choices[0].message
    assert (msg.role, msg.content, resp.choices[0].finish_reason) == ("assistant", words(4), "length")
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (3, 4)
    assert resp.usage.model_extra["pdserve_timings"]["decode_worker"] == "decode-0"
    req = server.router.requests[-1]
    assert req.messages == [{"role": "user", "content": "hi there"}] and req.sampling.max_tokens == 4


def test_sdk_chat_content_parts(client: openai.OpenAI, server: ServerThread) -> None:
    parts = [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]
    resp = client.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": "be brief"},
                                                                 {"role": "user", "content": parts}], max_tokens=2)
    assert resp.choices[0].message.content == words(2)
    assert server.router.requests[-1].messages[1] == {"role": "user", "content": "one\ntwo"}


@pytest.mark.parametrize("include_usage", [True, False])
def test_sdk_completion_stream(client: openai.OpenAI, include_usage: bool) -> None:
    chunks = list(client.completions.create(model=MODEL, prompt="a b c", max_tokens=6, stream=True,
                                            stream_options={"include_usage": True} if include_usage else None))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == words(6)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    assert len({c.id for c in chunks}) == 1
    if include_usage:
        assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == 6
        assert chunks[-1].usage.prompt_tokens == 3 and chunks[-1].usage.model_extra["pdserve_timings"]
    else:
        assert all(c.usage is None for c in chunks) and chunks[-1].model_extra["pdserve_timings"]


def test_sdk_chat_stream(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=5, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].object == "chat.completion.chunk" and chunks[0].id.startswith("chatcmpl-")
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == words(5)
    assert chunks[-2].choices[0].finish_reason == "length" and chunks[-2].choices[0].delta.content is None
    usage = chunks[-1].usage
    assert not chunks[-1].choices and (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (2, 5, 7)


X = "x" * 100  # the fake router's text of token 100 (its tokens are 100, 101, ...)


@pytest.mark.parametrize("stream", [False, True])
def test_sdk_completion_logprobs(client: openai.OpenAI, stream: bool) -> None:
    """logprobs=2: per token its text, logprob, the top 2 with the chosen one, and its offset."""
    resp = client.completions.create(model=MODEL, prompt="a b", max_tokens=3, logprobs=2, stream=stream)
    parts = [c.choices[0].logprobs for c in resp if c.choices and c.choices[0].logprobs] if stream else \
        [resp.choices[0].logprobs]
    tokens = [t for p in parts for t in p.tokens]
    assert tokens == [X, X + "x", X + "xx"]
    assert [lp for p in parts for lp in p.token_logprobs] == [0.0, -0.5, -1.0]
    assert [t for p in parts for t in p.top_logprobs] == [{X: 0.0, "x": -5.0}, {X + "x": -0.5, "x": -5.0},
                                                          {X + "xx": -1.0, "x": -5.0}]
    assert [o for p in parts for o in p.text_offset] == [0, 100, 201]


@pytest.mark.parametrize("stream", [False, True])
def test_sdk_chat_logprobs(client: openai.OpenAI, stream: bool) -> None:
    """logprobs=True, top_logprobs=3: each token with its bytes and its top 3; streamed, one per chunk."""
    resp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                          logprobs=True, top_logprobs=3, stream=stream)
    content = [t for c in resp if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content] \
        if stream else resp.choices[0].logprobs.content
    assert [(t.token, t.logprob, t.bytes) for t in content] == [(X, 0.0, [120] * 100), (X + "x", -0.5, [120] * 101)]
    assert [[(a.token, a.logprob) for a in t.top_logprobs] for t in content] == [
        [(X, 0.0), ("x", -5.0), ("xx", -6.0)], [(X + "x", -0.5), ("x", -5.0), ("xx", -6.0)]]
    plain = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                           logprobs=True)
    assert [t.top_logprobs for t in plain.choices[0].logprobs.content] == [[], []]


def test_sdk_models(client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL] and models[0].owned_by == "pdserve"
    assert models[0].model_extra["max_model_len"] == MAX_MODEL_LEN


def test_sdk_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi")
    with pytest.raises(openai.RateLimitError):
        client.completions.create(model=MODEL, prompt="overload")
    with pytest.raises(openai.InternalServerError, match="KV transfer failed"):
        client.completions.create(model=MODEL, prompt="explode", max_tokens=4)
    with pytest.raises(openai.APIError, match="KV transfer failed"):
        list(client.completions.create(model=MODEL, prompt="explode", max_tokens=4, stream=True))


# ---------------------------------------------------------------- several choices


def test_sdk_n_choices(client: openai.OpenAI, server: ServerThread) -> None:
    resp = client.completions.create(model=MODEL, prompt="hello world", max_tokens=3, n=3, seed=5)
    assert [(c.index, c.text, c.finish_reason) for c in resp.choices] == [(i, words(3), "length") for i in range(3)]
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (2, 9)  # the prompt once, every choice
    assert resp.usage.model_extra["pdserve_timings"]["path"] == "remote"
    assert [r.sampling.seed for r in server.router.requests[-3:]] == [5, 6, 7]
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, n=2)
    assert [(c.index, c.message.content) for c in chat.choices] == [(0, words(2)), (1, words(2))]
    assert {r.sampling.seed for r in server.router.requests[-2:]} == {None}


def test_batched_prompts_times_n_in_openais_order(server: ServerThread) -> None:
    status, _, raw = server.request("POST", C, {"prompt": ["a b", "c"], "n": 2, "max_tokens": 2, "echo": True})
    body = json.loads(raw)
    assert status == 200 and [(c["index"], c["text"]) for c in body["choices"]] == [
        (0, "a b" + words(2)), (1, "a b" + words(2)), (2, "c" + words(2)), (3, "c" + words(2))]
    assert (body["usage"]["prompt_tokens"], body["usage"]["completion_tokens"]) == (3, 8)
    assert [r.prompt for r in server.router.requests[-4:]] == ["a b", "a b", "c", "c"]
    status, _, raw = server.request("POST", C, {"prompt": [[3, 1], [2]], "max_tokens": 1})
    assert status == 200 and [r.prompt for r in server.router.requests[-2:]] == [[3, 1], [2]]
    assert json.loads(raw)["usage"]["prompt_tokens"] == 3


def test_echo_puts_the_prompt_first(client: openai.OpenAI) -> None:
    resp = client.completions.create(model=MODEL, prompt="say it", max_tokens=2, echo=True)
    assert resp.choices[0].text == "say it" + words(2) and resp.usage.completion_tokens == 2
    ids = client.completions.create(model=MODEL, prompt=[2, 3], max_tokens=1, echo=True)
    assert ids.choices[0].text == "xx xxx" + words(1)  # token ids: their decoded text
    chunks = list(client.completions.create(model=MODEL, prompt="say it", max_tokens=2, echo=True, n=2, stream=True))
    for i in range(2):
        texts = [c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i]
        assert texts[0] == "say it" + words(1) and "".join(texts) == "say it" + words(2)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("chat", [False, True])
def test_return_token_ids_gives_the_prompt_and_output_ids(server: ServerThread, chat: bool, stream: bool) -> None:
    """return_token_ids: each choice's output ids (streamed: each chunk its own), and the prompt's ids once
    per choice: on the completions choice, top-level for chat."""
    body = {"max_tokens": 3, "n": 2, "stream": stream, "return_token_ids": True,
            **({"messages": [{"role": "user", "content": "hi there"}]} if chat else {"prompt": "a bb"})}
    status, _, raw = server.request("POST", CHAT if chat else C, body)
    assert status == 200, raw
    prompt = [5, 2, 5] if chat else [1, 2]  # the fake's ids: each word's length ("user:", "hi", "there")
    if not stream:
        resp = json.loads(raw)
        assert [c["token_ids"] for c in resp["choices"]] == [[100, 101, 102]] * 2
        if chat:
            assert resp["prompt_token_ids"] == prompt
        else:
            assert [c["prompt_token_ids"] for c in resp["choices"]] == [prompt] * 2
        return
    events = [json.loads(e) for e in sse_events(raw)[:-1]]
    for i in range(2):
        mine = [e for e in events if e["choices"] and e["choices"][0]["index"] == i]
        assert [t for e in mine for t in e["choices"][0].get("token_ids", [])] == [100, 101, 102]
        given = [e.get("prompt_token_ids") if chat else e["choices"][0].get("prompt_token_ids") for e in mine]
        assert [p for p in given if p is not None] == [prompt]
        assert given[0 if not chat else 1] == prompt  # its first chunk with tokens (chat: after the role chunk)


def test_return_token_ids_is_off_by_default_and_refused_with_echo(server: ServerThread) -> None:
    status, _, raw = server.request("POST", C, {"prompt": "a", "max_tokens": 1})
    assert status == 200 and "token_ids" not in raw.decode()
    status, _, raw = server.request("POST", C, {"prompt": "a", "max_tokens": 1, "return_token_ids": True, "echo": True})
    assert_error(status, raw, 400, "return_token_ids")
    status, _, raw = server.request("POST", C, {"prompt": "a", "max_tokens": 1, "return_token_ids": "yes"})
    assert_error(status, raw, 400, "return_token_ids")


@pytest.mark.parametrize("chat", [False, True])
def test_streamed_choices_interleave_with_one_usage_chunk(server: ServerThread, chat: bool) -> None:
    body = {"max_tokens": 3, "n": 2, "stream": True, "stream_options": {"include_usage": True},
            **({"messages": USER} if chat else {"prompt": "a b"})}
    status, _, raw = server.request("POST", CHAT if chat else C, body)
    events = sse_events(raw)
    assert status == 200 and events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = [json.loads(e) for e in events[:-1]]
    usage = [c for c in chunks if not c["choices"]]
    assert len(usage) == 1 and chunks[-1] is usage[0] and usage[0]["usage"]["completion_tokens"] == 6
    assert usage[0]["usage"]["prompt_tokens"] == 2
    for i in range(2):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == i]
        text = "".join(ch["delta"].get("content") or "" for ch in mine) if chat else "".join(ch["text"] for ch in mine)
        assert text == words(3)
        assert [ch["finish_reason"] for ch in mine].count("length") == 1 and mine[-1]["finish_reason"] == "length"
        if chat:
            assert mine[0]["delta"] == {"role": "assistant", "content": ""}
    assert len({c["id"] for c in chunks}) == 1


def test_best_of_returns_the_likeliest(client: openai.OpenAI, server: ServerThread) -> None:
    """Seeds 1..4: the fake's logprobs are -0.25 * (seed % 4) lower per token, so seed 4, then seed 1, win."""
    resp = client.completions.create(model=MODEL, prompt="a b", max_tokens=2, n=2, best_of=4, seed=1, logprobs=0)
    assert [c.index for c in resp.choices] == [0, 1]
    assert [c.logprobs.token_logprobs for c in resp.choices] == [[0.0, -0.5], [-0.25, -0.75]]
    assert [r.sampling.seed for r in server.router.requests[-4:]] == [1, 2, 3, 4]
    assert resp.usage.completion_tokens == 8  # the four sequences ran
    plain = client.completions.create(model=MODEL, prompt="a b", max_tokens=2, best_of=3)
    assert len(plain.choices) == 1 and plain.choices[0].logprobs is None  # asked for ranking, not returned
    assert {r.sampling.logprobs for r in server.router.requests[-3:]} == {0}


def test_a_failing_choice_fails_the_request_and_aborts_the_others(server: ServerThread) -> None:
    server.router.token_delay_ms = 5
    try:
        status, _, raw = server.request("POST", C, {"prompt": ["hi there", "explode"], "max_tokens": 30})
        assert_error(status, raw, 500, type_="server_error")
        healthy = server.router.requests[-2]
        assert wait_aborted(server.router, f"fake-{len(server.router.requests) - 1}")
        assert healthy.prompt == "hi there"
        status, _, raw = server.request("POST", C, {"prompt": ["hi there", "explode"], "max_tokens": 30,
                                                    "stream": True})
        events = sse_events(raw)
        assert status == 200 and events[-1] == "[DONE]" and "KV transfer failed" in json.loads(events[-2])["error"][
            "message"]
        assert wait_aborted(server.router, f"fake-{len(server.router.requests) - 1}")
    finally:
        server.router.token_delay_ms = 0


def test_a_refused_choice_closes_those_submitted(server: ServerThread) -> None:
    status, headers, raw = server.request("POST", C, {"prompt": ["a b", "overload"], "n": 2})
    assert_error(status, raw, 429, None, "server_overloaded", "rate_limit_exceeded")
    assert headers["retry-after"] == "2"
    count = len(server.router.requests)
    assert all(wait_aborted(server.router, f"fake-{count - k}") for k in (1, 2))


# ---------------------------------------------------------------- raw HTTP


def test_models_health_metrics(server: ServerThread) -> None:
    status, _, body = server.request("GET", "/v1/models")
    assert status == 200 and json.loads(body) == {"object": "list", "data": [
        {"id": MODEL, "object": "model", "created": 1700000000, "owned_by": "pdserve", "max_model_len": 64}]}
    assert server.request("GET", "/health")[::2] == (200, b'{"status": "ok"}')
    status, headers, body = server.request("GET", "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain") and b"pdserve_up 1.0" in body


C, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]

BAD_REQUESTS = [  # (path, body or raw bytes, status, param, code)
    (C, b"{not json", 400, "body", None),
    (C, b"", 400, "body", None),
    (C, b'{"prompt": "hi", "temperature": NaN}', 400, "body", None),
    (C, b'{"prompt": "hi", "temperature": 1e999}', 400, "body", None),
    (C, b"[" * 50000 + b"]" * 50000, 400, "body", None),
    (C, b"\xff\xfe{}", 400, "body", None),
    (C, [1, 2], 400, "body", None),
    (CHAT, "a string", 400, "body", None),
    (C, {"prompt": "hi", "max_tokens": "10"}, 400, "max_tokens", None),
    (C, {"prompt": "hi", "temperature": "hot"}, 400, "temperature", None),
    (C, {"prompt": "hi", "temperature": True}, 400, "temperature", None),
    (C, {"prompt": ""}, 400, "prompt", None),
    (C, {"prompt": "   "}, 400, "prompt", None),
    (C, {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens", None),
    (C, {"prompt": "hi", "n": 17}, 400, "n", None),
    (C, {"prompt": "hi", "n": 0}, 400, "n", None),
    (C, {"prompt": "hi", "best_of": 3, "stream": True}, 400, "best_of", None),
    (C, {"prompt": "hi", "n": 3, "best_of": 2}, 400, "best_of", None),
    (C, {"prompt": "hi", "echo": True, "logprobs": 1}, 400, "echo", None),
    (C, {"prompt": ["hi"] * 17}, 400, "prompt", None),
    (C, {"prompt": "hi", "logprobs": 21}, 400, "logprobs", None),
    (C, {"prompt": "hi", "logprobs": True}, 400, "logprobs", None),
    (C, {"prompt": ["a", ""]}, 400, "prompt", None),
    (C, {"prompt": ["a", "hi " * 60], "max_tokens": 10}, 400, "max_tokens", None),
    (C, {"prompt": "hi", "model": "other"}, 404, "model", "model_not_found"),
    (C, {"prompt": "hi " * 60, "max_tokens": 10}, 400, "max_tokens", None),
    (CHAT, {"messages": []}, 400, "messages", None),
    (CHAT, {"messages": USER, "max_tokens": "5"}, 400, "max_tokens", None),
    (CHAT, {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role", None),
    (CHAT, {"messages": USER, "n": 17}, 400, "n", None),
    (CHAT, {"messages": USER, "logprobs": 3}, 400, "logprobs", None),
    (CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", None),
    (CHAT, {"messages": USER, "top_logprobs": 2}, 400, "top_logprobs", None),
    (CHAT, {"messages": USER, "tools": [{"type": "function"}]}, 400, "tools", None),
    (CHAT, {"messages": USER, "model": "gpt-4"}, 404, "model", "model_not_found"),
    # size limits (router.limits defaults)
    (C, {"prompt": "x" * 1_000_001}, 400, "prompt", None),
    (C, {"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", None),
    (C, {"prompt": "hi", "stop_token_ids": list(range(65))}, 400, "stop_token_ids", None),
    (CHAT, {"messages": USER * 1025}, 400, "messages", None),
    (CHAT, {"messages": [{"role": "user", "content": "x" * 600_000}] * 2}, 400, "messages", None),
    (CHAT, {"messages": USER, "stop": ["a"] * 5}, 400, "stop", None),
    # JSON \u escapes can carry unpaired surrogates, which no tokenizer takes
    (C, b'{"prompt": "a\\ud800b"}', 400, "prompt", None),
    (C, b'{"prompt": "hi", "stop": ["\\udfff"]}', 400, "stop", None),
    (CHAT, b'{"messages": [{"role": "user", "content": "\\ud83d"}]}', 400, "messages[0].content", None),
    (CHAT, b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud83d"}]}]}', 400,
     "messages[0].content[0].text", None),
]


@pytest.mark.parametrize(("path", "body", "status", "param", "code"), BAD_REQUESTS)
def test_bad_requests(server: ServerThread, path: str, body: object, status: int, param: str, code: str) -> None:
    raw = body if isinstance(body, bytes) else None
    got, _, resp = server.request("POST", path, body=None if raw is not None else body, raw=raw)
    assert_error(got, resp, status, param, code=code)


def test_overload_is_429_with_retry_after(server: ServerThread) -> None:
    status, headers, body = server.request("POST", C, {"prompt": "overload"})
    assert_error(status, body, 429, None, "server_overloaded", "rate_limit_exceeded")
    assert headers["retry-after"] == "2" and headers["retry-after-ms"] == "2000"


def test_failure_mid_stream_is_an_error_event(server: ServerThread) -> None:
    status, headers, body = server.request("POST", C, {"prompt": "explode", "max_tokens": 5, "stream": True})
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = sse_events(body)
    assert events[-1] == "[DONE]" and json.loads(events[0])["choices"][0]["text"] == "w0 "
    err = json.loads(events[-2])["error"]
    assert err["type"] == "server_error" and "KV transfer failed" in err["message"]
    assert b"Traceback" not in body
    status, _, body = server.request("POST", C, {"prompt": "explode", "max_tokens": 5})
    assert_error(status, body, 500, type_="server_error")


def test_routes_methods_and_size(server: ServerThread) -> None:
    status, _, body = server.request("GET", "/v1/nope")
    message = assert_error(status, body, 404)["message"]
    for route in ("POST /v1/completions", "GET /v1/models", "POST /pdserve/split", "GET /metrics"):
        assert route in message, message  # every route the app serves, from its own table
    assert "HEAD" not in message
    status, headers, body = server.request("GET", C)
    assert_error(status, body, 405) and headers["allow"] == "POST"
    small = ServerThread(FakeRouter(), max_body_bytes=1000)
    try:
        status, _, body = small.request("POST", C, {"prompt": "x" * 2000})
        assert "1000 bytes" in assert_error(status, body, 413)["message"]
        assert small.request("POST", C, {"prompt": "x" * 100, "max_tokens": 1})[0] == 200
    finally:
        small.stop()


def test_client_request_id_is_used(server: ServerThread) -> None:
    status, headers, body = server.request("POST", C, {"prompt": "hi", "max_tokens": 1},
                                           headers={"X-Request-Id": "my-req-7"})
    assert status == 200 and json.loads(body)["id"] == "cmpl-my-req-7" and headers["x-request-id"] == "my-req-7"


class BrokenRouter(FakeRouter):
    async def submit(self, request: GenerateRequest) -> FakeStream:
        raise RuntimeError("secret internals")

    def healthy(self) -> bool:
        return False


def test_unexpected_errors_hide_internals() -> None:
    broken = ServerThread(BrokenRouter())
    try:
        status, _, body = broken.request("POST", C, {"prompt": "hi"}, headers={"X-Request-Id": "abc"})
        err = assert_error(status, body, 500, type_="server_error")
        assert err["message"] == "internal error (request id abc)" and b"secret" not in body
        assert broken.request("GET", "/health")[0] == 503
    finally:
        broken.stop()


def test_still_serving_after_errors(client: openai.OpenAI) -> None:
    assert client.completions.create(model=MODEL, prompt="ok", max_tokens=3).choices[0].text == words(3)


# ---------------------------------------------------------------- client disconnects


def wait_aborted(router: FakeRouter, rid: str, timeout: float = 1.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if rid in router.aborted:
            return True
        time.sleep(0.01)
    return False


def open_raw(server: ServerThread, body: dict, headers: str = "") -> socket.socket:
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    sock.sendall(f"POST {C} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{headers}"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


@pytest.mark.parametrize("cancel_handler", [True, False])
def test_disconnect_mid_stream_aborts(server: ServerThread, cancel_handler: bool) -> None:
    """Noticed by handler cancellation (start_http_server) or by the next write failing (plain runner)."""
    if not cancel_handler:
        server = ServerThread(FakeRouter(), max_body_bytes=1 << 20)
    server.router.token_delay_ms = 20
    try:
        sock = open_raw(server, {"prompt": "hi", "max_tokens": 50, "stream": True})
        received = b""
        while received.count(b"data: ") < 2:
            received += sock.recv(4096)
        rid = json.loads(received.split(b"data: ")[1].split(b"\n\n")[0])["id"].removeprefix("cmpl-")
        sock.close()
        assert wait_aborted(server.router, rid)
    finally:
        server.router.token_delay_ms = 0
        if not cancel_handler:
            server.stop()


def test_disconnect_mid_stream_aborts_every_choice(server: ServerThread) -> None:
    server.router.token_delay_ms = 20
    try:
        sock = open_raw(server, {"prompt": "hi", "max_tokens": 50, "stream": True, "n": 3})
        received = b""
        while received.count(b"data: ") < 2:
            received += sock.recv(4096)
        count = len(server.router.requests)
        sock.close()
        assert all(wait_aborted(server.router, f"fake-{count - k}") for k in range(3))
    finally:
        server.router.token_delay_ms = 0


def test_disconnect_while_waiting_aborts(server: ServerThread) -> None:
    server.router.token_delay_ms = 20
    try:
        sock = open_raw(server, {"prompt": "hi", "max_tokens": 50}, headers="X-Request-Id: gone-1\r\n")
        deadline = time.monotonic() + 1
        while not any(r.request_id == "gone-1" for r in server.router.requests) and time.monotonic() < deadline:
            time.sleep(0.01)
        sock.close()
        assert wait_aborted(server.router, "gone-1")
    finally:
        server.router.token_delay_ms = 0


# ---------------------------------------------------------------- size limits


def test_configured_limits() -> None:
    limited = ServerThread(FakeRouter(), limits=RequestLimits(max_prompt_chars=10, max_messages=2, max_stop=1,
                                                              max_stop_token_ids=1))
    try:
        assert limited.request("POST", C, {"prompt": "x" * 10, "max_tokens": 1, "stop": "s",
                                           "stop_token_ids": [1]})[0] == 200
        for path, body, param in [(C, {"prompt": "x" * 11}, "prompt"), (C, {"prompt": "x", "stop": ["a", "b"]}, "stop"),
                                  (C, {"prompt": "x", "stop_token_ids": [1, 2]}, "stop_token_ids"),
                                  (CHAT, {"messages": USER * 3}, "messages"),
                                  (CHAT, {"messages": [{"role": "user", "content": "x" * 6}] * 2}, "messages")]:
            status, _, resp = limited.request("POST", path, body)
            assert "at most" in assert_error(status, resp, 400, param)["message"]
    finally:
        limited.stop()


# ---------------------------------------------------------------- API keys


KEY, OTHER_KEY = "sk-test-0123456789", "sk-second-key"


@pytest.fixture(scope="module")
def keyed() -> Iterator[ServerThread]:
    s = ServerThread(FakeRouter(), api_keys=frozenset({KEY, OTHER_KEY}))
    yield s
    s.stop()


def assert_401(status: int, headers: dict[str, str], body: bytes, *secrets: str) -> None:
    err = assert_error(status, body, 401, None, code="invalid_api_key")
    assert headers["www-authenticate"].startswith("Bearer")
    for secret in secrets:
        assert secret.encode() not in body, err


@pytest.mark.parametrize(("method", "path", "body"), [
    ("POST", C, {"prompt": "hi", "max_tokens": 1}), ("POST", CHAT, {"messages": USER, "max_tokens": 1}),
    ("GET", "/v1/models", None), ("GET", "/v1/nope", None), ("GET", C, None), ("POST", C, {"prompt": "x" * 5_000_000}),
    ("GET", "/health/../v1/models", None), ("GET", "/v1/models?api_key=" + KEY, None),
])
def test_missing_key_is_401(keyed: ServerThread, method: str, path: str, body: object) -> None:
    status, headers, resp = keyed.request(method, path, body)
    assert_401(status, headers, resp)
    assert "missing API key" in json.loads(resp)["error"]["message"]


@pytest.mark.parametrize("header", ["Bearer sk-wrong-secret-guess", "Bearer " + KEY[:-1], "Bearer " + KEY + "x",
                                    "Basic " + KEY, KEY, "Bearer", "Bearer " + KEY.upper(), "Bearer caf\u00e9"])
def test_wrong_key_is_401_and_not_echoed(keyed: ServerThread, header: str) -> None:
    status, headers, resp = keyed.request("POST", C, {"prompt": "hi", "max_tokens": 1},
                                          headers={"Authorization": header})
    sent = header.removeprefix("Bearer ").removeprefix("Basic ")
    assert_401(status, headers, resp, *([sent] if sent != "Bearer" else []))


@pytest.mark.parametrize("key", [KEY, OTHER_KEY])
def test_right_key_works(keyed: ServerThread, key: str) -> None:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{keyed.port}/v1", api_key=key, max_retries=0)
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices[0].text == words(2)
    chunks = list(client.chat.completions.create(model=MODEL, messages=USER, max_tokens=3, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == words(3)
    assert [m.id for m in client.models.list().data] == [MODEL]
    status, _, body = keyed.request("POST", C, {"prompt": "hi", "stop": ["a"] * 5},
                                    headers={"Authorization": f"bearer {key}"})
    assert_error(status, body, 400, "stop")  # past the key check, the usual validation


def test_sdk_with_wrong_key(keyed: ServerThread) -> None:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{keyed.port}/v1", api_key="sk-nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=1)
    assert info.value.code == "invalid_api_key" and "sk-nope" not in str(info.value)


def test_health_and_metrics_stay_open(keyed: ServerThread) -> None:
    assert keyed.request("GET", "/health")[::2] == (200, b'{"status": "ok"}')
    assert keyed.request("HEAD", "/health")[0] == 200
    status, _, body = keyed.request("GET", "/metrics")
    assert status == 200 and b"pdserve_up 1.0" in body


def test_keys_are_never_logged(keyed: ServerThread, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG):
        for header in ("Bearer " + KEY, "Bearer sk-guess-1234"):
            keyed.request("POST", C, {"prompt": "hi", "max_tokens": 1}, headers={"Authorization": header})
        deadline = time.monotonic() + 2
        while not any(r.name == "aiohttp.access" for r in caplog.records) and time.monotonic() < deadline:
            time.sleep(0.01)
    assert any(r.name == "aiohttp.access" for r in caplog.records)
    assert any("401" in r.getMessage() for r in caplog.records if r.name == "router.http_server")
    assert KEY not in caplog.text and "sk-guess-1234" not in caplog.text


def test_no_keys_means_no_auth(server: ServerThread) -> None:
    status, _, body = server.request("POST", C, {"prompt": "hi", "max_tokens": 1},
                                     headers={"Authorization": "Bearer anything"})
    assert status == 200 and json.loads(body)["choices"][0]["text"] == words(1)
    assert server.request("GET", "/v1/models")[0] == 200


def test_api_keys_must_be_a_collection() -> None:
    with pytest.raises(TypeError, match="not a single string"):
        build_app(FakeRouter(), api_keys="secret")  # type: ignore[arg-type]


def test_protect_metrics_puts_metrics_behind_the_key_and_leaves_health_open() -> None:
    s = ServerThread(FakeRouter(), api_keys=frozenset({KEY}), protect_metrics=True)
    try:
        status, headers, body = s.request("GET", "/metrics")
        assert_401(status, headers, body)
        status, _, body = s.request("GET", "/metrics", headers={"Authorization": f"Bearer {KEY}"})
        assert status == 200 and b"pdserve_" in body
        assert s.request("GET", "/health")[0] == 200
    finally:
        s.stop()


def test_https_serves_the_openai_sdk_that_trusts_the_certificate(tmp_path) -> None:
    import ssl

    from router.tls import TlsFiles
    from tests.conftest import self_signed_cert

    cert, key = self_signed_cert(tmp_path)
    s = ServerThread(FakeRouter(), tls=TlsFiles(str(cert), str(key)))
    try:
        trusting = openai.OpenAI(base_url=f"https://127.0.0.1:{s.port}/v1", api_key="x", max_retries=0,
                                 http_client=openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=str(cert))))
        resp = trusting.completions.create(model=MODEL, prompt="hello world", max_tokens=3)
        assert resp.choices[0].text == words(3)
        doubting = openai.OpenAI(base_url=f"https://127.0.0.1:{s.port}/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.APIConnectionError):  # an unknown issuer is not trusted
            doubting.models.list()
        conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=10)  # plaintext to a TLS port: no answer
        with pytest.raises((http.client.HTTPException, ConnectionError)):
            conn.request("GET", "/health")
            conn.getresponse()
        conn.close()
    finally:
        s.stop()


def test_tokenize_detokenize_version_and_ping(server: ServerThread) -> None:
    status, _, body = server.request("POST", "/tokenize", {"prompt": "hello big world"})
    assert status == 200 and json.loads(body) == {"count": 3, "max_model_len": MAX_MODEL_LEN, "tokens": [5, 3, 5]}
    status, _, body = server.request("POST", "/tokenize", {"messages": USER})
    assert status == 200 and json.loads(body)["count"] >= 2
    status, _, body = server.request("POST", "/detokenize", {"tokens": [2, 1]})
    assert status == 200 and json.loads(body) == {"prompt": "xx x"}
    status, _, body = server.request("GET", "/version")
    assert status == 200 and json.loads(body)["version"]
    assert server.request("GET", "/ping")[0] == 200 and server.request("POST", "/ping")[0] == 200


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/tokenize", {}, "prompt"), ("/tokenize", {"prompt": "a", "messages": USER}, "prompt"),
    ("/tokenize", {"prompt": [1, 2]}, "prompt"), ("/tokenize", {"prompt": "a", "model": "other"}, "model"),
    ("/detokenize", {"tokens": "abc"}, "tokens"), ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {}, "tokens"),
])
def test_tokenize_and_detokenize_errors_name_the_field(server: ServerThread, path: str, body: dict,
                                                       param: str) -> None:
    status, _, resp = server.request("POST", path, body)
    err = json.loads(resp)["error"]
    assert status in (400, 404) and err["param"] == param, resp


def test_ping_is_open_and_tokenize_needs_the_key(keyed: ServerThread) -> None:
    assert keyed.request("GET", "/ping")[0] == 200
    status, headers, body = keyed.request("POST", "/tokenize", {"prompt": "hi"})
    assert_401(status, headers, body)
