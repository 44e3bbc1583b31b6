"""Streams one request from an OpenAI-compatible server (POST /v1/completions or /v1/chat/completions,
SSE) and times it.

Sent to /v1/completions: {"prompt": text | [token ids], "max_tokens": N, "temperature": 0, "stream": true,
"stream_options": {"include_usage": true}, "ignore_eos": true (unless disabled), "model": M (if given)}.
Sent to /v1/chat/completions (as `vllm bench serve --backend openai-chat` does): the same, with
"messages" instead of "prompt" (the spec's messages, else one user message holding the text prompt;
token-id prompts cannot be sent as chat) and "max_completion_tokens" instead of "max_tokens".
Read: every `data:` event until `data: [DONE]`. A chunk carrying output is a choice with non-empty `text`
(or chat `delta.content`); the usage event gives completion_tokens, prompt_tokens (for chat, the server's
count after its chat template) and pdserve's `usage.pdserve_timings` (also accepted top-level on the
finishing chunk). A spec with `keep_output` keeps the output's text on the record, and for a token-id
prompt also asks for its token ids (`"return_token_ids": true`, as pdserve and vLLM name it) and keeps
them (each chunk's `token_ids`; a server that sends none leaves them None). Anything malformed fails the
request, never the run.
"""
from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp

from loadtest import records as R
from loadtest.clients import ENDPOINTS
from loadtest.records import RequestRecord, parse_timings
from loadtest.workload import RequestSpec


class StreamError(Exception):
    """The response broke the protocol; kind is one of the error kinds in `loadtest.records`."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class OpenAIClient:
    """Args: base_url (e.g. http://127.0.0.1:8000; the endpoint's path is appended), model (None: not sent),
    timeout_s (per request, send to end of stream), ignore_eos (send the `ignore_eos` extension field),
    api_key (sent as `Authorization: Bearer <key>`; None: no header), endpoint ("completions" or "chat",
    see `loadtest.clients.ENDPOINTS`)."""

    def __init__(self, base_url: str, model: str | None = None, timeout_s: float = 300.0,
                 ignore_eos: bool = True, api_key: str | None = None, endpoint: str = "completions") -> None:
        if endpoint not in ENDPOINTS:
            raise ValueError(f"unknown endpoint {endpoint!r}; allowed: {', '.join(ENDPOINTS)}")
        self.endpoint = endpoint
        self.url = base_url.rstrip("/") + ENDPOINTS[endpoint]
        if not self.url.startswith(("http://", "https://")):
            self.url = "http://" + self.url
        self.model, self.timeout_s, self.ignore_eos = model, timeout_s, ignore_eos
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._session: aiohttp.ClientSession | None = None

    def body(self, spec: RequestSpec) -> dict[str, Any]:
        """The JSON body for one spec. Raises: ValueError for a token-id prompt on the chat endpoint."""
        body: dict[str, Any]
        if self.endpoint == "chat":
            body = {"messages": chat_messages(spec), "max_completion_tokens": spec.output_tokens}
        else:
            prompt: Any = spec.prompt_text if spec.prompt_text is not None else list(spec.prompt_token_ids or ())
            body = {"prompt": prompt, "max_tokens": spec.output_tokens}
        body.update({"temperature": 0, "stream": True, "stream_options": {"include_usage": True}})
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.model:
            body["model"] = self.model
        if spec.keep_output and spec.prompt_token_ids is not None:
            body["return_token_ids"] = True
        return body

    async def send(self, spec: RequestSpec) -> RequestRecord:
        """Streams one request. Returns: its record (error set on any failure). Raises: only CancelledError."""
        if self._session is None:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                                  timeout=aiohttp.ClientTimeout(total=None), headers=self._headers)
        rec = RequestRecord(spec.index, spec.prompt_tokens, spec.output_tokens)
        t0 = time.perf_counter()
        state = _StreamState(rec, t0, spec.keep_output)
        try:
            async with asyncio.timeout(self.timeout_s):
                async with self._session.post(self.url, json=self.body(spec)) as resp:
                    if resp.status != 200:
                        text = (await resp.text(errors="replace"))[:300]
                        raise StreamError(f"http_{resp.status}", f"HTTP {resp.status}: {text}")
                    await _read_sse(resp.content, state)
            state.finish()
        except StreamError as e:
            rec.fail(e.kind, str(e))
        except TimeoutError:
            rec.fail(R.TIMEOUT, f"no complete response within {self.timeout_s:g} s")
        except (aiohttp.ClientError, ConnectionError, OSError) as e:
            rec.fail(R.CONNECTION, f"{type(e).__name__}: {e}")
        except Exception as e:  # noqa: BLE001 - a broken response must never end the run
            rec.fail(R.CLIENT_EXCEPTION, f"{type(e).__name__}: {e}")
        rec.e2e_s = time.perf_counter() - t0
        return rec

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def chat_messages(spec: RequestSpec) -> list[dict[str, str]]:
    """The chat messages of a spec: its own (a multi-turn history), else one user message holding its text.
    Raises: ValueError for a token-id prompt (chat messages hold text)."""
    if spec.messages is not None:
        return [{"role": m.role, "content": m.content} for m in spec.messages]
    if spec.prompt_text is None:
        raise ValueError(f"request {spec.index} has a token-id prompt; the chat endpoint sends text messages")
    return [{"role": "user", "content": spec.prompt_text}]


class _StreamState:
    """Folds SSE events into a record."""

    def __init__(self, rec: RequestRecord, t0: float, keep_output: bool = False) -> None:
        self.rec, self.t0, self.keep_output = rec, t0, keep_output
        self.texts: list[str] = []
        self.token_ids: list[int] | None = None
        self.done = False
        self.output_chunks = 0
        self.usage_tokens: int | None = None

    def event(self, data: str) -> None:
        if data.strip() == "[DONE]":
            self.done = True
            return
        now = time.perf_counter() - self.t0
        try:
            ev = json.loads(data)
        except json.JSONDecodeError as e:
            raise StreamError(R.BAD_JSON, f"event is not valid JSON ({e.msg}): {data[:120]!r}") from None
        if not isinstance(ev, dict):
            raise StreamError(R.BAD_RESPONSE, f"event is not an object: {data[:120]!r}")
        if ev.get("error") is not None:
            err = ev["error"]
            msg = err.get("message", err) if isinstance(err, dict) else err
            raise StreamError(R.SERVER_ERROR, f"server error: {msg}")
        choices, usage = ev.get("choices"), ev.get("usage")
        if choices is None and not isinstance(usage, dict):
            raise StreamError(R.BAD_RESPONSE, f"event has neither choices nor usage: {data[:120]!r}")
        if choices is not None:
            self._choices(choices, now)
        if isinstance(usage, dict):
            self._usage(usage)
        if "pdserve_timings" in ev and self.rec.timings is None:
            self.rec.timings = parse_timings(ev["pdserve_timings"])

    def _choices(self, choices: Any, now: float) -> None:
        if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
            raise StreamError(R.BAD_RESPONSE, "choices is not a list of objects")
        for c in choices:
            text = c.get("text")
            if text is None and isinstance(c.get("delta"), dict):
                text = c["delta"].get("content")
            if text is not None and not isinstance(text, str):
                raise StreamError(R.BAD_RESPONSE, f"choice text is not a string: {text!r:.80}")
            if self.keep_output:
                self._keep(text, c.get("token_ids"))
            if text:
                self.output_chunks += 1
                self.rec.chunk_times_s.append(now)
                if self.rec.ttft_s is None:
                    self.rec.ttft_s = now
            if c.get("finish_reason") is not None:
                self.rec.finish_reason = str(c["finish_reason"])

    def _keep(self, text: str | None, token_ids: Any) -> None:
        if text:
            self.texts.append(text)
        if token_ids is not None:
            if not isinstance(token_ids, list) or not all(type(t) is int for t in token_ids):
                raise StreamError(R.BAD_RESPONSE, f"choice token_ids is not a list of ids: {token_ids!r:.80}")
            self.token_ids = self.token_ids or []
            self.token_ids += token_ids

    def _usage(self, usage: dict) -> None:
        tokens = usage.get("completion_tokens")
        if tokens is not None:
            if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0:
                raise StreamError(R.BAD_RESPONSE, f"usage.completion_tokens is not a count: {tokens!r:.80}")
            self.usage_tokens = tokens
        if isinstance(usage.get("prompt_tokens"), int):
            self.rec.server_prompt_tokens = usage["prompt_tokens"]
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            self.rec.cached_tokens = details["cached_tokens"]
        if usage.get("pdserve_timings") is not None:
            self.rec.timings = parse_timings(usage["pdserve_timings"])

    def finish(self) -> None:
        rec = self.rec
        if self.keep_output:
            rec.output_text, rec.output_token_ids = "".join(self.texts), self.token_ids
        if self.usage_tokens is not None:
            rec.output_tokens, rec.output_tokens_source = self.usage_tokens, "usage"
        else:
            rec.output_tokens, rec.output_tokens_source = self.output_chunks, "chunks"
        if rec.finish_reason is None:
            end = "after [DONE]" if self.done else "before [DONE]"
            rec.fail(R.INCOMPLETE, f"stream ended {end} without a finish_reason")
        elif rec.finish_reason == "abort":
            rec.fail(R.ABORTED, "the server aborted the request")
        elif rec.ttft_s is None and rec.output_tokens > 0:
            rec.fail(R.BAD_RESPONSE, f"usage reports {rec.output_tokens} tokens but no chunk carried text")


async def _read_sse(content: aiohttp.StreamReader, state: _StreamState) -> None:
    """Minimal server-sent events: `data:` lines joined per event, events end at a blank line."""
    data: list[str] = []
    async for raw in content:
        line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
        if not line:
            if data:
                state.event("\n".join(data))
                data = []
            if state.done:
                return
        elif line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
        # comments (":...") and other fields (event:, id:, retry:) are ignored
    if data:
        state.event("\n".join(data))
