"""Several choices per request (`router.choices`): the fan-out plan, merging streams, ranking, usage."""
from __future__ import annotations

import asyncio
import contextlib

import pytest
from fake_router import FakeRouter

from engine.logprobs import TokenLogprob
from router import choices
from router.openai_protocol import parse_chat_request, parse_completion_request
from router.types import Chunk, OverloadedError, RequestFailed, Usage


def test_plan_gives_each_sequence_its_seed() -> None:
    parsed = parse_completion_request({"prompt": ["a", "b"], "n": 3, "seed": 7, "temperature": 0.8})
    plan = choices.plan(parsed, "client-1")
    assert [(c.prompt_index, c.number) for c in plan] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert [c.request.sampling.seed for c in plan] == [7, 8, 9, 7, 8, 9]
    assert [c.request.prompt for c in plan] == ["a"] * 3 + ["b"] * 3
    assert {c.request.request_id for c in plan} == {"client-1"}
    assert all(c.request.sampling.logprobs is None and c.request.sampling.temperature == 0.8 for c in plan)


def test_plan_seeds_wrap_and_unseeded_stay_unseeded() -> None:
    top = 2**63 - 1
    assert [c.request.sampling.seed for c in choices.plan(parse_completion_request({"prompt": "a", "n": 3,
                                                                                    "seed": top}))] == [top, 0, 1]
    assert {c.request.sampling.seed for c in choices.plan(parse_chat_request(
        {"messages": [{"role": "user", "content": "hi"}], "n": 2}))} == {None}


def test_plan_asks_for_logprobs_only_to_rank() -> None:
    ranked = choices.plan(parse_completion_request({"prompt": "a", "n": 2, "best_of": 3}))
    assert len(ranked) == 3 and {c.request.sampling.logprobs for c in ranked} == {0}
    asked = choices.plan(parse_completion_request({"prompt": "a", "best_of": 2, "logprobs": 4}))
    assert {c.request.sampling.logprobs for c in asked} == {4}
    plain = choices.plan(parse_completion_request({"prompt": "a", "n": 2, "best_of": 2}))
    assert {c.request.sampling.logprobs for c in plain} == {None}


def output(prompt: int, number: int, logprobs: list[float], tokens: int = 2, usage: Usage | None = None
           ) -> choices.SequenceOutput:
    parsed = parse_completion_request({"prompt": "a"})
    out = choices.SequenceOutput(choices.Candidate(prompt, number, parsed.request), prompt_tokens=4)
    lps = tuple(TokenLogprob(1, lp) for lp in logprobs)
    out.add(Chunk(f"p{prompt}s{number}", [1] * tokens, "length", usage, logprobs=lps))
    out.finish("length", Chunk("", [], "length", usage))
    return out


def test_best_of_keeps_the_highest_cumulative_logprob() -> None:
    outs = [output(0, 0, [-1.0, -1.0]), output(0, 1, [-0.1, -0.2]), output(0, 2, [-3.0]), output(0, 3, [-0.3]),
            output(1, 0, [-5.0]), output(1, 1, [-0.5]), output(1, 2, [-0.5]), output(1, 3, [float("-inf")])]
    chosen = choices.choose(outs, n=2, ranked=True)
    assert [(i, o.text) for i, o in chosen] == [(0, "p0s3"), (1, "p0s1"), (2, "p1s1"), (3, "p1s2")]
    assert [(i, o.text) for i, o in choices.choose(outs[:2] + outs[4:6], n=2, ranked=False)] == [
        (0, "p0s0"), (1, "p0s1"), (2, "p1s0"), (3, "p1s1")]


def test_usage_counts_each_prompt_once_and_every_sequence() -> None:
    outs = [output(0, 0, [], 3, Usage(10, 3, cached_tokens=0)), output(0, 1, [], 5, Usage(10, 5, cached_tokens=8)),
            output(1, 0, [], 2, Usage(4, 2, cached_tokens=1)), output(1, 1, [], 1, None)]
    usage = choices.total_usage(outs)
    assert (usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens) == (14, 11, 1)


def run(coro):
    return asyncio.run(coro)


def test_merge_interleaves_and_ends_when_all_finished() -> None:
    async def go():
        router = FakeRouter(token_delay_ms=1)
        parsed = parse_completion_request({"prompt": "a b", "n": 3, "max_tokens": 4})
        streams = await choices.submit_all(router, choices.plan(parsed))
        got = []
        async with contextlib.aclosing(choices.merge(streams)) as merged:
            async for k, chunk in merged:
                got.append((k, chunk.text, chunk.finish_reason))
        await choices.close_all(streams)
        return got, router.aborted
    got, aborted = run(go())
    for k in range(3):
        assert [t for j, t, _ in got if j == k] == ["w0 ", "w1 ", "w2 ", "w3 "]
        assert [f for j, _, f in got if j == k][-1] == "length"
    assert {k for k, _, _ in got[:6]} == {0, 1, 2}  # interleaved, not one stream after the other
    assert aborted == []


def test_a_failing_stream_ends_the_merge_and_closing_aborts_the_others() -> None:
    async def go():
        router = FakeRouter(token_delay_ms=5)
        parsed = parse_completion_request({"prompt": ["hi there", "explode"], "max_tokens": 40})
        streams = await choices.submit_all(router, choices.plan(parsed))
        with pytest.raises(RequestFailed, match="KV transfer failed"):
            async with contextlib.aclosing(choices.merge(streams)) as merged:
                async for _ in merged:
                    pass
        await choices.close_all(streams)
        return [s.request_id for s in streams], router.aborted
    ids, aborted = run(go())
    assert ids[0] in aborted  # the healthy one was aborted


def test_a_refused_submit_closes_those_already_submitted() -> None:
    async def go():
        router = FakeRouter()
        parsed = parse_completion_request({"prompt": ["a b", "c", "overload"], "n": 2})
        with pytest.raises(OverloadedError):
            await choices.submit_all(router, choices.plan(parsed))
        return router
    router = run(go())
    assert len(router.requests) == 5 and sorted(router.aborted) == [f"fake-{i}" for i in range(1, 5)]
