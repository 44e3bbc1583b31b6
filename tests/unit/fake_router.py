"""A deterministic stand-in for the router core, for testing the API servers' wire handling alone.

It tokenizes by whitespace (one token per word, id = word length), and answers with
`max_tokens` tokens "w0 w1 ..." (id 100 + i), finishing with "length"; when the request asks for
logprobs, token i has logprob L = -0.5 * i - 0.25 * (seed % 4) (seed 0 when unseeded) and top k ids
100 + i, 1, 2, ... (L, then -5, -6, ...). A prompt of "overload" raises OverloadedError; "explode"
fails mid-stream with RequestFailed. `aborted` lists the ids of the streams closed (or dropped)
before their last chunk was handed out. Chat messages are rendered as "role: content" lines. The
real router is exercised by the e2e tests.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from engine.errors import InvalidRequestError
from engine.logprobs import TokenLogprob
from router.types import (Chunk, GenerateRequest, ModelCard, ModelNotFoundError, OverloadedError, PhaseTimings,
                          RequestFailed, Usage)

MODEL = "fake-model"
MAX_MODEL_LEN = 64


class FakeStream:
    def __init__(self, request_id: str, prompt_token_ids: list[int], max_tokens: int, explode: bool,
                 owner: "FakeRouter", logprobs: int | None = None, seed: int | None = None):
        self.request_id = request_id
        self._logprobs = logprobs
        self._seed = seed or 0
        self.prompt_token_ids = tuple(prompt_token_ids)
        self.prompt_tokens = len(prompt_token_ids)
        self._max_tokens = max_tokens
        self._explode = explode
        self._owner = owner
        self._done = False

    def __aiter__(self) -> AsyncIterator[Chunk]:
        return self._gen()

    async def _gen(self) -> AsyncIterator[Chunk]:
        try:
            for i in range(self._max_tokens):
                await asyncio.sleep(0.001 * self._owner.token_delay_ms)
                if self._explode and i == 1:
                    raise RequestFailed(f"request {self.request_id}: KV transfer failed")
                last = i == self._max_tokens - 1
                if last:  # the last chunk handed out: finished, closing it aborts nothing
                    self._done = True
                yield Chunk(text=f"w{i} ", token_ids=[100 + i], finish_reason="length" if last else None,
                            usage=Usage(self.prompt_tokens, self._max_tokens) if last else None,
                            timings=PhaseTimings("remote", "prefill-0", "decode-0", 0.001, 0.01, 0.002, 0.05,
                                                 0.013, 0.06) if last else None,
                            logprobs=self._token_logprobs(i))
        finally:
            if not self._done:
                self._owner.aborted.append(self.request_id)

    def _token_logprobs(self, i: int) -> tuple[TokenLogprob, ...]:
        if self._logprobs is None:
            return ()
        k, lp = self._logprobs, -0.5 * i - 0.25 * (self._seed % 4)
        return (TokenLogprob(100 + i, lp, (100 + i, *range(1, k))[:k], (lp, *range(-5, -4 - k, -1))[:k]),)

    async def aclose(self) -> None:
        if not self._done:
            self._done = True
            self._owner.aborted.append(self.request_id)


class FakeRouter:
    model_name = MODEL
    max_model_len = MAX_MODEL_LEN

    def __init__(self, token_delay_ms: float = 0.0) -> None:
        self.token_delay_ms = token_delay_ms
        self.requests: list[GenerateRequest] = []
        self.aborted: list[str] = []

    async def submit(self, request: GenerateRequest) -> FakeStream:
        self.requests.append(request)
        if request.model is not None and request.model != MODEL:
            raise ModelNotFoundError(request.model, MODEL)
        if (request.prompt is None) == (request.messages is None):
            raise InvalidRequestError("prompt", "give exactly one of prompt or messages")
        if request.messages is not None:
            text = "\n".join(f"{m['role']}: {m['content']}" for m in request.messages)
        elif isinstance(request.prompt, str):
            text = request.prompt
        else:
            text = " ".join("x" * max(1, t) for t in request.prompt)
        ids = [len(w) for w in text.split()]
        if not ids:
            raise InvalidRequestError("prompt", "must not be empty")
        if len(ids) + request.sampling.max_tokens > MAX_MODEL_LEN:
            raise InvalidRequestError("max_tokens", f"prompt ({len(ids)} tokens) + max_tokens must be <= "
                                                    f"{MAX_MODEL_LEN}")
        if text.strip() == "overload":
            raise OverloadedError("all decode workers are full; retry later", retry_after_s=2.0)
        rid = request.request_id or f"fake-{len(self.requests)}"
        return FakeStream(rid, ids, request.sampling.max_tokens, text.strip() == "explode", self,
                          request.sampling.logprobs, request.sampling.seed)

    def tokenize(self, request: GenerateRequest) -> list[int]:
        """One id per whitespace-separated word: its length."""
        if request.model is not None and request.model != MODEL:
            raise ModelNotFoundError(request.model, MODEL)
        text = request.prompt if request.messages is None else \
            "\n".join(f"{m['role']}: {m['content']}" for m in request.messages)
        return [len(w) for w in str(text).split()]

    def detokenize(self, token_ids: list[int], model: str | None) -> str:
        if model is not None and model != MODEL:
            raise ModelNotFoundError(model, MODEL)
        return " ".join("x" * t for t in token_ids)

    def models(self) -> list[ModelCard]:
        return [ModelCard(MODEL, 1700000000, "pdserve", MAX_MODEL_LEN)]

    def healthy(self) -> bool:
        return True

    def cost_model(self) -> dict:
        return {"hop_s": 0.01}

    def metrics_text(self) -> tuple[bytes, str]:
        return b"# HELP pdserve_up 1 when serving\n# TYPE pdserve_up gauge\npdserve_up 1.0\n", \
            "text/plain; version=0.0.4; charset=utf-8"
