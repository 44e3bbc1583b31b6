"""Several choices per request (HTTP `n`, `best_of`, prompt batches; gRPC `n`): a fan-out above the router.

Every choice is a request of its own. For each prompt the API server submits `per_prompt` requests
(`best_of`, else `n`) through `RouterAPI.submit`, one after the other, and merges their
`RequestStream`s into one response; nothing below the router's API knows they belong together.
- Choice indices follow OpenAI: prompt p's i-th choice is `choices[p * n + i]`.
- Seeds: with a `seed`, sequence i of a prompt gets `seed + i` (mod 2**63), so a seeded request with
  n = 3 is reproducible and its choices differ from each other. Greedy choices are all equal.
- `best_of` > n: every sequence asks for log-probabilities (`SamplingParams.logprobs` 0 when the
  client asked none; they are then left out of the response); the n with the highest cumulative
  log-probability of their tokens (the model's raw log-softmax, `engine.logprobs`) are returned, best
  first, ties to the earlier sequence.
- Sharing the prompt: the router promises a placed prompt's prefix to the workers that will hold
  its KV (the prefill worker computing it, the decode worker receiving it), so prefix-aware placement
  steers the next choices there, and an engine never computes a prompt block that another request is
  computing or receiving there: the choice waits and reuses it (`engine.block_manager`). So a request
  whose first choice goes remote is prefilled once and shipped once, and the choices placed locally on
  its decode worker compute only the prompt's last partial block. Each choice is still its own request
  (placed, booked, moved on a failure on its own); one the policy sends remote is shipped on its own.
- Usage: prompt_tokens (and cached_tokens) count each prompt once, as its first sequence saw it;
  completion_tokens add up every sequence generated (with best_of the unreturned ones too: they ran,
  and OpenAI bills them as well). The usage's `pdserve_timings` are those of the sequence behind
  choice 0; streamed without include_usage, each choice's finishing chunk carries its own.
- Failures: if submitting sequence k raises (429 overload, say), the ones already submitted are
  closed (aborted) and the error goes to the client. While they run, the first sub-stream that fails
  ends the merged stream with its error; closing (`close_all`) aborts every sub-stream still running.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace

from engine.logprobs import TokenLogprob
from router.openai_protocol import ParsedRequest, final_usage
from router.types import Chunk, GenerateRequest, PhaseTimings, RequestFailed, RequestStream, RouterAPI, Usage

log = logging.getLogger(__name__)
SEED_MODULUS = 2**63  # seeds are integers in [0, 2**63) (`SamplingParams.seed`)


@dataclass(frozen=True)
class Candidate:
    """One sequence to generate: for prompt `prompt_index`, its `number`-th sequence, and the request."""

    prompt_index: int
    number: int
    request: GenerateRequest


def plan(parsed: ParsedRequest, request_id: str | None = None) -> tuple[Candidate, ...]:
    """The sequences a parsed request generates, prompt by prompt: per_prompt of each, the i-th with
    seed + i, logprobs asked for when they rank best_of; `request_id`: the client's id, for all."""
    out = []
    for p, base in enumerate(parsed.requests):
        for i in range(parsed.per_prompt):
            sampling = base.sampling
            if sampling.seed is not None and i:
                sampling = replace(sampling, seed=(sampling.seed + i) % SEED_MODULUS)
            if parsed.ranked and sampling.logprobs is None:
                sampling = replace(sampling, logprobs=0)
            out.append(Candidate(p, i, replace(base, sampling=sampling, request_id=request_id)))
    return tuple(out)


async def submit_all(router: RouterAPI, candidates: Sequence[Candidate]) -> list[RequestStream]:
    """Submit each candidate in order (a later one can then follow the first one's prefix to its
    worker). Raises what `submit` raised, after closing the streams already submitted."""
    streams: list[RequestStream] = []
    try:
        for c in candidates:
            streams.append(await router.submit(c.request))
    except BaseException:
        await close_all(streams)
        raise
    return streams


async def close_all(streams: Sequence[RequestStream]) -> None:
    """Close every stream (aborting those still running), even inside a cancelled task."""
    for stream in streams:
        try:
            await asyncio.shield(stream.aclose())
        except Exception:
            log.exception("request %s: closing its stream failed", stream.request_id)


async def merge(streams: Sequence[RequestStream]) -> AsyncIterator[tuple[int, Chunk]]:
    """(k, chunk) for the chunks of streams[k] as they come, interleaved. Each stream ends at its
    chunk with a finish reason (one that ends without raises RequestFailed); the first exception of
    any stream is raised here. Close it (`contextlib.aclosing`) to stop its readers; closing the
    streams themselves is the caller's (`close_all`)."""
    if len(streams) == 1:  # one request: read it directly
        async for chunk in streams[0]:
            yield 0, chunk
            if chunk.finish_reason is not None:
                return
        raise _unfinished(streams[0])
    queue: asyncio.Queue[tuple[int, Chunk | None, BaseException | None]] = asyncio.Queue()

    async def read(k: int, stream: RequestStream) -> None:
        try:
            async for chunk in stream:
                queue.put_nowait((k, chunk, None))
                if chunk.finish_reason is not None:
                    queue.put_nowait((k, None, None))
                    return
            raise _unfinished(stream)
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            queue.put_nowait((k, None, exc))

    readers = [asyncio.get_running_loop().create_task(read(k, s)) for k, s in enumerate(streams)]
    try:
        running = len(streams)
        while running:
            k, chunk, error = await queue.get()
            if error is not None:
                raise error
            if chunk is None:
                running -= 1
            else:
                yield k, chunk
    finally:
        for task in readers:
            task.cancel()


def _unfinished(stream: RequestStream) -> RequestFailed:
    return RequestFailed(f"request {stream.request_id} ended without a finish reason")


@dataclass
class SequenceOutput:
    """What one candidate's stream produced, gathered chunk by chunk (`add`)."""

    candidate: Candidate
    prompt_tokens: int
    texts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None  # OpenAI's, once finished
    usage: Usage | None = None
    timings: PhaseTimings | None = None

    def add(self, chunk: Chunk) -> None:
        self.texts.append(chunk.text)
        self.token_ids += chunk.token_ids
        self.logprobs += chunk.logprobs

    def finish(self, finish_reason: str, chunk: Chunk) -> None:
        """The last chunk (already `add`ed): its finish reason and usage (counted here when the router gave none)."""
        self.finish_reason = finish_reason
        self.usage = final_usage(chunk, self.prompt_tokens, self.completion_tokens)
        self.timings = chunk.timings

    @property
    def text(self) -> str:
        return "".join(self.texts)

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def cumulative_logprob(self) -> float:
        return sum(e.logprob for e in self.logprobs)


def choose(outputs: Sequence[SequenceOutput], n: int, ranked: bool) -> list[tuple[int, SequenceOutput]]:
    """The returned choices as (index, output), in index order: per prompt the first n sequences, or,
    `ranked`, the n with the highest cumulative log-probability (best first, ties to the earlier)."""
    by_prompt: dict[int, list[SequenceOutput]] = {}
    for o in outputs:
        by_prompt.setdefault(o.candidate.prompt_index, []).append(o)
    chosen = []
    for p in sorted(by_prompt):
        seqs = sorted(by_prompt[p], key=lambda o: o.candidate.number)
        if ranked:
            seqs = sorted(seqs, key=lambda o: -o.cumulative_logprob)  # stable: ties keep the earlier
        chosen += [(p * n + i, o) for i, o in enumerate(seqs[:n])]
    return chosen


def total_usage(outputs: Sequence[SequenceOutput]) -> Usage:
    """The request's usage: each prompt counted once (prompt and cached tokens of its first sequence),
    the completion tokens of every sequence generated (best_of's unreturned ones too: they ran)."""
    first = {o.candidate.prompt_index: o for o in outputs if o.candidate.number == 0}
    prompt = sum(o.usage.prompt_tokens if o.usage else o.prompt_tokens for o in first.values())
    cached = sum(o.usage.cached_tokens if o.usage else 0 for o in first.values())
    completion = sum(o.usage.completion_tokens if o.usage else o.completion_tokens for o in outputs)
    return Usage(prompt, completion, cached)
