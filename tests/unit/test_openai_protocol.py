"""OpenAI request parsing and response bodies, without a server."""
from __future__ import annotations

import json
import re

import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params

from engine.errors import InvalidRequestError
from engine.logprobs import TokenLogprob
from router.limits import RequestLimits
from router.openai_protocol import (
    NO_EFFECT_FIELDS,
    UNSUPPORTED_CHAT_FIELDS,
    ChoiceOutput,
    LogprobsBuilder,
    ResponseBuilder,
    openai_finish_reason,
    parse_chat_request,
    parse_completion_request,
)
from router.types import Chunk, PhaseTimings, RequestFailed, Usage

P = {"prompt": "hi"}
M = {"messages": [{"role": "user", "content": "hi"}]}

COMPLETION_REJECTS = [  # (body, field)
    (None, "body"), ([P], "body"), ("hi", "body"), (3, "body"),
    ({}, "prompt"), ({"prompt": None}, "prompt"), ({"prompt": ""}, "prompt"), ({"prompt": []}, "prompt"),
    ({"prompt": 5}, "prompt"), ({"prompt": {"a": 1}}, "prompt"), ({"prompt": ["a", ""]}, "prompt"),
    ({"prompt": [[1], []]}, "prompt"), ({"prompt": ["a", [1, "b"]]}, "prompt"), ({"prompt": ["a"] * 17}, "prompt"),
    ({"prompt": ["x" * 600_000] * 2}, "prompt"), ({"prompt": [[1], [-1]]}, "prompt"), ({"prompt": [1, "a"]}, "prompt"), ({"prompt": [1, -1]}, "prompt"),
    ({"prompt": [True]}, "prompt"), ({"prompt": [2**40]}, "prompt"), ({"prompt": [1.5]}, "prompt"),
    ({"prompt": [""]}, "prompt"), ({"prompt": [["a"]]}, "prompt"), ({"prompt": [[]]}, "prompt"),
    ({**P, "model": 3}, "model"),
    ({**P, "max_tokens": "10"}, "max_tokens"), ({**P, "max_tokens": 0}, "max_tokens"),
    ({**P, "max_tokens": -3}, "max_tokens"), ({**P, "max_tokens": 1.5}, "max_tokens"),
    ({**P, "max_tokens": True}, "max_tokens"),
    ({**P, "temperature": "hot"}, "temperature"), ({**P, "temperature": True}, "temperature"),
    ({**P, "temperature": -1}, "temperature"), ({**P, "temperature": 1e9}, "temperature"),
    ({**P, "top_p": 0}, "top_p"), ({**P, "top_p": 1.5}, "top_p"), ({**P, "top_p": [1]}, "top_p"),
    ({**P, "top_k": -2}, "top_k"), ({**P, "top_k": 2.0}, "top_k"), ({**P, "top_k": False}, "top_k"),
    ({**P, "n": 0}, "n"), ({**P, "n": 17}, "n"), ({**P, "n": True}, "n"), ({**P, "n": "1"}, "n"),
    ({**P, "n": 2.0}, "n"),
    ({**P, "stream": "yes"}, "stream"), ({**P, "stream": 1}, "stream"),
    ({**P, "stream_options": {"include_usage": True}}, "stream_options"),
    ({**P, "stream": True, "stream_options": []}, "stream_options"),
    ({**P, "stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ({**P, "stop": 3}, "stop"), ({**P, "stop": ["a", 1]}, "stop"), ({**P, "stop": ["a"] * 5}, "stop"),
    ({**P, "stop": ""}, "stop"), ({**P, "stop": [""]}, "stop"),
    ({**P, "seed": "1"}, "seed"), ({**P, "seed": -1}, "seed"), ({**P, "seed": 2**63}, "seed"),
    ({**P, "seed": 1.0}, "seed"),
    ({**P, "logprobs": 21}, "logprobs"), ({**P, "logprobs": -1}, "logprobs"), ({**P, "logprobs": True}, "logprobs"),
    ({**P, "logprobs": 2.0}, "logprobs"), ({**P, "logprobs": "2"}, "logprobs"),
    ({**P, "echo": "no"}, "echo"), ({**P, "echo": 1}, "echo"), ({**P, "echo": True, "logprobs": 0}, "echo"),
    ({**P, "best_of": 0}, "best_of"), ({**P, "best_of": 17}, "best_of"), ({**P, "best_of": True}, "best_of"),
    ({**P, "best_of": "1"}, "best_of"), ({**P, "n": 3, "best_of": 2}, "best_of"),
    ({**P, "best_of": 2, "stream": True}, "best_of"), ({**P, "n": 2, "best_of": 3, "stream": True}, "best_of"),
    ({**P, "presence_penalty": 2.5}, "presence_penalty"), ({**P, "presence_penalty": "0"}, "presence_penalty"),
    ({**P, "frequency_penalty": -3}, "frequency_penalty"), ({**P, "frequency_penalty": False}, "frequency_penalty"),
    ({**P, "repetition_penalty": 0}, "repetition_penalty"), ({**P, "repetition_penalty": "1"}, "repetition_penalty"),
    ({**P, "min_p": 1.5}, "min_p"), ({**P, "min_p": True}, "min_p"),
    ({**P, "min_tokens": -1}, "min_tokens"), ({**P, "min_tokens": 1.0}, "min_tokens"),
    ({**P, "max_tokens": 4, "min_tokens": 5}, "min_tokens"),
    ({**P, "skip_special_tokens": False}, "skip_special_tokens"),
    ({**P, "skip_special_tokens": 1}, "skip_special_tokens"),
    ({**P, "use_beam_search": True}, "use_beam_search"), ({**P, "guided_json": {"type": "object"}}, "guided_json"),
    ({**P, "include_stop_str_in_output": False}, "include_stop_str_in_output"),
    ({**P, "logit_bias": {"a": -100}}, "logit_bias"), ({**P, "logit_bias": [1]}, "logit_bias"),
    ({**P, "logit_bias": {"-3": 1}}, "logit_bias"), ({**P, "logit_bias": {"5": 101}}, "logit_bias"),
    ({**P, "logit_bias": {"5": "1"}}, "logit_bias"),
    ({**P, "suffix": "end"}, "suffix"), ({**P, "suffix": 1}, "suffix"),
    ({**P, "ignore_eos": "true"}, "ignore_eos"),
    ({**P, "stop_token_ids": 5}, "stop_token_ids"), ({**P, "stop_token_ids": [1, "2"]}, "stop_token_ids"),
    ({**P, "stop_token_ids": [-1]}, "stop_token_ids"),
]

CHAT_REJECTS = [  # (body, field)
    ([M], "body"), ({}, "messages"), ({"messages": None}, "messages"), ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"), ({"messages": {"role": "user"}}, "messages"),
    ({"messages": ["hi"]}, "messages[0]"),
    ({"messages": [{"content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}]}, "messages[1].role"),
    ({"messages": [{"role": 1, "content": "a"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": ["hi"]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0].text"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]}, "messages[0].content[0].text"),
    ({**M, "max_tokens": "5"}, "max_tokens"), ({**M, "max_tokens": 0}, "max_tokens"),
    ({**M, "max_completion_tokens": 0}, "max_completion_tokens"),
    ({**M, "max_completion_tokens": "5", "max_tokens": 5}, "max_completion_tokens"),
    ({**M, "temperature": None, "top_p": "x"}, "top_p"),
    ({**M, "logprobs": 1}, "logprobs"), ({**M, "logprobs": "true"}, "logprobs"),
    ({**M, "top_logprobs": 2}, "top_logprobs"), ({**M, "logprobs": False, "top_logprobs": 1}, "top_logprobs"),
    ({**M, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({**M, "logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ({**M, "logprobs": True, "top_logprobs": 1.5}, "top_logprobs"),
    ({**M, "presence_penalty": 3}, "presence_penalty"), ({**M, "frequency_penalty": 2.1}, "frequency_penalty"),
    ({**M, "guided_regex": "a+"}, "guided_regex"), ({**M, "prompt_logprobs": 1}, "prompt_logprobs"),
    ({**M, "response_format": "text"}, "response_format"),
    ({**M, "tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools"),
    ({**M, "tool_choice": "auto"}, "tool_choice"), ({**M, "tool_choice": {"type": "function"}}, "tool_choice"),
    ({**M, "functions": [{"name": "f"}]}, "functions"),
    ({**M, "stop": ["a", "b", "c", "d", "e"]}, "stop"), ({**M, "seed": "x"}, "seed"),
    ({**M, "stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ({**M, "n": 0}, "n"), ({**M, "n": 17}, "n"), ({**M, "n": False}, "n"),
]


@pytest.mark.parametrize(("body", "field"), COMPLETION_REJECTS)
def test_completion_rejects(body: object, field: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        parse_completion_request(body)
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}: ")


@pytest.mark.parametrize(("body", "field"), CHAT_REJECTS)
def test_chat_rejects(body: object, field: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        parse_chat_request(body)
    assert info.value.field == field


def test_completion_defaults() -> None:
    parsed = parse_completion_request({"prompt": "hi", "unknown_field": [1, {"x": None}], "user": "u1"})
    assert not parsed.stream and not parsed.include_usage
    req = parsed.request
    assert (req.prompt, req.messages, req.model, req.request_id) == ("hi", None, None, None)
    s = req.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.seed) == (16, 1.0, 1.0, 0, None)
    assert (s.stop, s.stop_token_ids, s.ignore_eos) == ((), (), False)


def test_completion_all_supported_fields() -> None:
    body = {"model": "m", "prompt": ["one"], "max_tokens": 7, "temperature": 0, "top_p": 0.5, "n": 1,
            "stream": True, "stream_options": {"include_usage": True}, "stop": "x", "seed": 3, "logprobs": None,
            "echo": False, "best_of": 1, "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {},
            "user": "u", "suffix": None, "top_k": -1, "ignore_eos": True, "stop_token_ids": [2, 3]}
    parsed = parse_completion_request(body)
    assert parsed.stream and parsed.include_usage
    req = parsed.request
    assert (req.prompt, req.model) == ("one", "m")
    s = req.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.seed, s.stop) == (7, 0, 0.5, 0, 3, ("x",))
    assert s.ignore_eos and s.stop_token_ids == (2, 3) and s.greedy and not s.adjusts_logits


@pytest.mark.parametrize(("body", "n", "best_of", "per_prompt", "echo"), [
    ({**P}, 1, None, 1, False), ({**P, "n": 3}, 3, None, 3, False), ({**P, "n": 16}, 16, None, 16, False),
    ({**P, "best_of": 4}, 1, 4, 4, False), ({**P, "n": 2, "best_of": 2, "stream": True}, 2, 2, 2, False),
    ({**P, "n": 2, "best_of": 5}, 2, 5, 5, False), ({**P, "echo": True}, 1, None, 1, True),
    ({**P, "echo": True, "n": 2, "stream": True}, 2, None, 2, True), ({**P, "echo": False, "logprobs": 1}, 1, None, 1, False),
    ({**P, "n": None, "best_of": None, "echo": None}, 1, None, 1, False),
])
def test_choices_fields(body: dict, n: int, best_of: int | None, per_prompt: int, echo: bool) -> None:
    parsed = parse_completion_request(body)
    assert (parsed.n, parsed.best_of, parsed.per_prompt, parsed.echo) == (n, best_of, per_prompt, echo)
    assert parsed.ranked == (per_prompt > n)


def test_chat_takes_n() -> None:
    parsed = parse_chat_request({**M, "n": 3, "stream": True})
    assert (parsed.n, parsed.per_prompt, len(parsed.requests)) == (3, 3, 1)


@pytest.mark.parametrize(("prompt", "want"), [
    (["a", "b c"], ["a", "b c"]), ([[1, 2], [3]], [[1, 2], [3]]), (["a", [4, 5]], ["a", [4, 5]]),
    ([1, 2, 3], [[1, 2, 3]]),  # one list of ids is one prompt
    ([[7]], [[7]]), (["x"] * 16, ["x"] * 16)])
def test_batched_prompts(prompt: object, want: list) -> None:
    parsed = parse_completion_request({"prompt": prompt, "seed": 5, "max_tokens": 3, "stop": "z"})
    assert [r.prompt for r in parsed.requests] == want and parsed.request.prompt == want[0]
    assert all(r.sampling == parsed.request.sampling and r.sampling.stop == ("z",) for r in parsed.requests)


def test_choice_limits_come_from_request_limits() -> None:
    limits = RequestLimits(max_choices=3, max_prompts=2)
    assert parse_completion_request({**P, "n": 3, "best_of": 3}, limits=limits).per_prompt == 3
    for body, field, said in [({**P, "n": 4}, "n", "[1, 3]"), ({**P, "best_of": 4}, "best_of", "[1, 3]"),
                              ({"prompt": ["a", "b", "c"]}, "prompt", "at most 2")]:
        with pytest.raises(InvalidRequestError, match=re.escape(said)) as info:
            parse_completion_request(body, limits=limits)
        assert info.value.field == field
    with pytest.raises(InvalidRequestError) as info:
        parse_chat_request({**M, "n": 4}, limits=limits)
    assert info.value.field == "n"


def test_bad_combinations_say_why() -> None:
    with pytest.raises(InvalidRequestError, match="stream"):
        parse_completion_request({**P, "best_of": 3, "stream": True})
    with pytest.raises(InvalidRequestError, match="prompt log-probabilities"):
        parse_completion_request({**P, "echo": True, "logprobs": 2})
    with pytest.raises(InvalidRequestError, match=r"prompt 1 of the batch"):
        parse_completion_request({"prompt": ["a", ""]})


def test_sampling_extensions_are_honoured() -> None:
    """Penalties, min_p and min_tokens reach the sampling parameters (chat and completions alike)."""
    fields = {"presence_penalty": 0.5, "frequency_penalty": -1, "repetition_penalty": 1.3, "min_p": 0.1,
              "min_tokens": 3, "max_tokens": 8, "skip_special_tokens": True}
    for parse, body in ((parse_completion_request, {**P, **fields}), (parse_chat_request, {**M, **fields})):
        s = parse(body).request.sampling
        assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty, s.min_p, s.min_tokens) == \
            (0.5, -1, 1.3, 0.1, 3)
        assert s.adjusts_logits


@pytest.mark.parametrize(("prompt", "want"), [([5, 6, 7], [5, 6, 7]), ([[5, 6]], [5, 6]), (["text"], "text"),
                                              ("text", "text")])
def test_prompt_forms(prompt: object, want: object) -> None:
    assert parse_completion_request({"prompt": prompt}).request.prompt == want


def test_chat_defaults_and_content_parts() -> None:
    body = {"messages": [{"role": "developer", "content": "rules"},
                         {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                          "name": "bob"},
                         {"role": "assistant", "content": []}, {"role": "tool", "content": "42"}]}
    parsed = parse_chat_request(body)
    assert parsed.request.messages == [{"role": "developer", "content": "rules"}, {"role": "user", "content": "a\nb"},
                                       {"role": "assistant", "content": ""}, {"role": "tool", "content": "42"}]
    assert parsed.request.prompt is None and parsed.request.sampling.max_tokens == 16


@pytest.mark.parametrize(("extra", "want"), [({"max_tokens": 5}, 5), ({"max_completion_tokens": 6}, 6),
                                             ({"max_tokens": 5, "max_completion_tokens": 7}, 7),
                                             ({"max_tokens": 5, "max_completion_tokens": None}, 5)])
def test_chat_max_tokens(extra: dict, want: int) -> None:
    assert parse_chat_request({**M, **extra}).request.sampling.max_tokens == want


@pytest.mark.parametrize(("parse", "extra", "want"), [
    (parse_completion_request, {"logprobs": None}, None), (parse_completion_request, {"logprobs": 0}, 0),
    (parse_completion_request, {"logprobs": 2}, 2), (parse_completion_request, {"logprobs": 20}, 20),
    (parse_chat_request, {}, None), (parse_chat_request, {"logprobs": False}, None),
    (parse_chat_request, {"logprobs": False, "top_logprobs": 0}, None),
    (parse_chat_request, {"logprobs": True}, 0), (parse_chat_request, {"logprobs": True, "top_logprobs": None}, 0),
    (parse_chat_request, {"logprobs": True, "top_logprobs": 3}, 3),
    (parse_chat_request, {"logprobs": True, "top_logprobs": 20}, 20),
], ids=lambda v: getattr(v, "__name__", repr(v)))
def test_logprobs_reach_the_sampling_params(parse, extra: dict, want: int | None) -> None:
    body = {**(P if parse is parse_completion_request else M), **extra}
    assert parse(body).request.sampling.logprobs == want


@pytest.mark.parametrize("parse", [parse_completion_request, parse_chat_request], ids=lambda f: f.__name__)
def test_logit_bias_reaches_the_sampling_params_by_token_id(parse) -> None:
    body = {**(P if parse is parse_completion_request else M), "logit_bias": {"50256": -100, "7": 2.5}}
    assert parse(body).request.sampling.logit_bias == ((7, 2.5), (50256, -100.0))
    assert parse({**body, "logit_bias": None}).request.sampling.logit_bias == ()


SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0}},
          "required": ["ok"], "additionalProperties": False}
RESPONSE_FORMAT_REJECTS = [  # response_format values refused (400 naming response_format), never passed on
    "json_object", ["json_object"], {}, {"type": "xml"}, {"type": "json_schema"},
    {"type": "json_schema", "json_schema": "{}"}, {"type": "json_schema", "json_schema": {"name": "x"}},
    {"type": "json_schema", "json_schema": {"name": 3, "schema": SCHEMA}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": "yes"}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": [SCHEMA]}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
        "a": {"$ref": "#/$defs/missing"}}}}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "[a-"}}},
]


@pytest.mark.parametrize("parse", [parse_completion_request, parse_chat_request], ids=lambda f: f.__name__)
@pytest.mark.parametrize("value", RESPONSE_FORMAT_REJECTS)
def test_response_format_refusals_name_it(parse, value) -> None:
    with pytest.raises(InvalidRequestError) as info:
        parse({**(P if parse is parse_completion_request else M), "response_format": value})
    assert info.value.field == "response_format"
    assert str(info.value).startswith("response_format: ")
    assert "Traceback" not in str(info.value) and ".cc:" not in str(info.value)  # the library's location left out


@pytest.mark.parametrize("parse", [parse_completion_request, parse_chat_request], ids=lambda f: f.__name__)
def test_response_format_reaches_the_sampling_params_as_schema_text(parse) -> None:
    """text (or null) is no grammar; json_object any object; json_schema the schema's compact JSON text with
    its keys in the order sent (the order the output writes them), strict or not."""
    base = P if parse is parse_completion_request else M
    for plain in (None, {"type": "text"}):
        assert parse({**base, "response_format": plain}).request.sampling.json_schema is None
    assert parse({**base, "response_format": {"type": "json_object"}}).request.sampling.json_schema == '{"type":"object"}'
    for strict in (None, True, False):
        spec = {"name": "answer", "schema": SCHEMA, **({} if strict is None else {"strict": strict})}
        sp = parse({**base, "response_format": {"type": "json_schema", "json_schema": spec}}).request.sampling
        assert sp.json_schema == json.dumps(SCHEMA, separators=(",", ":"))
        assert list(json.loads(sp.json_schema)["properties"]) == ["ok", "n"]
    with pytest.raises(InvalidRequestError, match="^min_tokens: "):
        parse({**base, "response_format": {"type": "json_object"}, "min_tokens": 2})


def test_chat_accepts_no_op_fields() -> None:
    body = {**M, "logprobs": False, "top_logprobs": None, "response_format": {"type": "text"}, "tools": None,
            "tool_choice": None, "n": 1, "presence_penalty": 0, "user": "u", "stream": False, "stream_options": None}
    assert parse_chat_request(body).request.messages == [{"role": "user", "content": "hi"}]


# ---------------------------------------------------------------- responses

TIMINGS = PhaseTimings("local", None, "decode-1", e2e_s=0.5)


def test_full_bodies() -> None:
    usage = Usage(3, 2, cached_tokens=1)
    body = ResponseBuilder(False, "r1", "m", 123).full("ab", "stop", usage, TIMINGS)
    assert body == {"id": "cmpl-r1", "object": "text_completion", "created": 123, "model": "m",
                    "choices": [{"text": "ab", "index": 0, "logprobs": None, "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                              "prompt_tokens_details": {"cached_tokens": 1}, "pdserve_timings": TIMINGS.as_dict()}}
    chat = ResponseBuilder(True, "r1", "m", 123).full("ab", "length", usage, None)
    assert (chat["id"], chat["object"]) == ("chatcmpl-r1", "chat.completion")
    assert chat["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "ab"},
                                "finish_reason": "length", "logprobs": None}]
    assert chat["usage"]["pdserve_timings"] is None


def test_chat_stream_events() -> None:
    b = ResponseBuilder(True, "r", "m", 1)
    assert [e["choices"][0]["delta"] for e in b.start_events()] == [{"role": "assistant", "content": ""}]
    assert b.chunk_events(Chunk("", []), None, None) == []
    mid = b.chunk_events(Chunk("x", [1]), None, None)
    assert [e["choices"][0]["delta"] for e in mid] == [{"content": "x"}] and "usage" not in mid[0]
    last = b.chunk_events(Chunk("y", [2], "length", Usage(1, 2), TIMINGS), "length", Usage(1, 2))
    assert [(e["choices"][0]["delta"], e["choices"][0]["finish_reason"]) for e in last] == [
        ({"content": "y"}, None), ({}, "length")]
    assert last[-1]["pdserve_timings"] == TIMINGS.as_dict() and last[0]["object"] == "chat.completion.chunk"


def test_completion_stream_events_with_usage() -> None:
    b = ResponseBuilder(False, "r", "m", 1, include_usage=True)
    assert b.start_events() == []
    mid = b.chunk_events(Chunk("x", [1]), None, None)
    assert mid[0]["choices"][0]["text"] == "x" and mid[0]["usage"] is None
    last = b.chunk_events(Chunk("", [], "stop", None, TIMINGS), "stop", Usage(1, 1))
    assert [e["choices"] for e in last] == [[{"text": "", "index": 0, "logprobs": None, "finish_reason": "stop"}], []]
    assert last[1]["usage"]["total_tokens"] == 2 and last[1]["usage"]["pdserve_timings"]["path"] == "local"
    assert "pdserve_timings" not in last[0] and last[1]["object"] == "text_completion"


def test_several_choices_in_one_body() -> None:
    """full_choices: each choice with its index, in the order given; one usage for the request."""
    b = ResponseBuilder(False, "r", "m", 1)
    body = b.full_choices([ChoiceOutput(0, "a", "stop"), ChoiceOutput(1, "b", "length")], Usage(3, 5), TIMINGS)
    assert body["choices"] == [{"text": "a", "index": 0, "logprobs": None, "finish_reason": "stop"},
                               {"text": "b", "index": 1, "logprobs": None, "finish_reason": "length"}]
    assert body["usage"]["total_tokens"] == 8 and body["usage"]["pdserve_timings"] == TIMINGS.as_dict()
    chat = ResponseBuilder(True, "r", "m", 1).full_choices([ChoiceOutput(2, "x", "stop")], Usage(1, 1), None)
    assert chat["choices"] == [{"index": 2, "message": {"role": "assistant", "content": "x"}, "finish_reason": "stop",
                                "logprobs": None}]


@pytest.mark.parametrize("chat", [False, True])
def test_stream_events_of_another_choice(chat: bool) -> None:
    """for_choice(i): its chunks carry index i; with include_usage a finishing chunk adds no usage chunk
    of its own when given none (the request's comes once, after every choice: usage_event)."""
    b = ResponseBuilder(chat, "r", "m", 1, include_usage=True).for_choice(3)
    events = b.start_events() + b.chunk_events(Chunk("x", [1]), None, None) + \
        b.chunk_events(Chunk("y", [2], "stop", Usage(1, 2), TIMINGS), "stop", None)
    assert {e["choices"][0]["index"] for e in events} == {3}
    assert all(e["choices"] and "pdserve_timings" not in e for e in events)
    assert events[-1]["choices"][0]["finish_reason"] == "stop"
    last = b.usage_event(Usage(2, 7, 1), TIMINGS)
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 7


def test_each_choice_counts_its_own_logprob_offsets() -> None:
    b = ResponseBuilder(False, "r", "m", 1, logprobs=logprobs_builder(False))
    body = b.full_choices([ChoiceOutput(0, " ab", "stop", tuple(LP[:2])), ChoiceOutput(1, "b", "stop", (LP[1],))],
                          Usage(1, 3), None)
    assert [c["logprobs"]["text_offset"] for c in body["choices"]] == [[0, 2], [0]]
    one, two = b.for_choice(0), b.for_choice(1)
    first = one.chunk_events(Chunk(" a", [1], logprobs=(LP[0],)), None, None)
    second = two.chunk_events(Chunk("b", [2], logprobs=(LP[1],)), None, None)
    assert first[0]["choices"][0]["logprobs"]["text_offset"] == [0]
    assert second[0]["choices"][0]["logprobs"]["text_offset"] == [0]
    assert one.chunk_events(Chunk("b", [2], logprobs=(LP[1],)), None, None)[0]["choices"][0]["logprobs"][
        "text_offset"] == [2]


TEXTS = {1: " a", 2: "b", 3: "\u00e9", 4: " a"}  # 4 has the same text as 1
LP = [TokenLogprob(1, -0.25, (1, 3), (-0.25, -2.0)), TokenLogprob(2, -1.5, (3, 4), (-0.5, -1.0)),
      TokenLogprob(3, float("-inf"), (), ())]


def logprobs_builder(chat: bool) -> LogprobsBuilder:
    return LogprobsBuilder(chat, TEXTS.__getitem__)


def test_completion_logprobs_shape() -> None:
    """The top k and the chosen token by their text; offsets over the tokens' texts; -inf as -9999."""
    b = ResponseBuilder(False, "r", "m", 1, logprobs=logprobs_builder(False))
    lp = b.full(" ab\u00e9", "stop", Usage(1, 3), None, LP)["choices"][0]["logprobs"]
    assert lp == {"tokens": [" a", "b", "\u00e9"], "token_logprobs": [-0.25, -1.5, -9999.0],
                  "top_logprobs": [{" a": -0.25, "\u00e9": -2.0}, {"\u00e9": -0.5, " a": -1.0, "b": -1.5},
                                   {"\u00e9": -9999.0}],
                  "text_offset": [0, 2, 3]}


def test_chat_logprobs_shape() -> None:
    b = ResponseBuilder(True, "r", "m", 1, logprobs=logprobs_builder(True))
    content = b.full(" ab\u00e9", "stop", Usage(1, 3), None, LP)["choices"][0]["logprobs"]["content"]
    assert content[0] == {"token": " a", "logprob": -0.25, "bytes": [32, 97],
                          "top_logprobs": [{"token": " a", "logprob": -0.25, "bytes": [32, 97]},
                                           {"token": "\u00e9", "logprob": -2.0, "bytes": [195, 169]}]}
    assert [c["token"] for c in content] == [" a", "b", "\u00e9"] and content[2]["top_logprobs"] == []
    assert ResponseBuilder(True, "r", "m", 1).full("x", "stop", Usage(1, 1), None, LP)["choices"][0]["logprobs"] is None


@pytest.mark.parametrize("chat", [False, True])
def test_streamed_logprobs_follow_the_tokens_not_the_text(chat: bool) -> None:
    """A chunk whose text is held back still sends its tokens' logprobs; streamed, every token's entry
    comes once, in order, and the completions offsets run on across chunks: as the whole response."""
    b = ResponseBuilder(chat, "r", "m", 1, logprobs=logprobs_builder(chat))
    chunks = [Chunk("", [1], logprobs=(LP[0],)), Chunk(" ab", [2], logprobs=(LP[1],)),
              Chunk("\u00e9", [3], "stop", Usage(1, 3), TIMINGS, (LP[2],))]
    events = [e for c in chunks for e in b.chunk_events(c, c.finish_reason, c.usage)]
    sent = [e["choices"][0]["logprobs"] for e in events if e["choices"][0]["logprobs"] is not None]
    whole = ResponseBuilder(chat, "r", "m", 1, logprobs=logprobs_builder(chat)).full(
        " ab\u00e9", "stop", Usage(1, 3), None, LP)["choices"][0]["logprobs"]
    if chat:
        assert [e for lp in sent for e in lp["content"]] == whole["content"]
        assert events[0]["choices"][0]["delta"] == {"content": ""}  # held-back text, its token's logprobs
    else:
        assert {k: [v for lp in sent for v in lp[k]] for k in whole} == whole
        assert events[0]["choices"][0]["text"] == ""
    assert len(sent) == 3


@pytest.mark.parametrize(("reason", "want"), [("stop", "stop"), ("length", "length"), ("abort", None),
                                              ("weird", None)])
def test_finish_reasons(reason: str, want: str | None) -> None:
    chunk = Chunk("", [], reason)
    if want is None:
        with pytest.raises(RequestFailed, match="r9"):
            openai_finish_reason(chunk, "r9")
    else:
        assert openai_finish_reason(chunk, "r9") == want


# ---------------------------------------------------------------- every field of the OpenAI SDK's request types

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
# field → (the body's fields, what the parsed request shows of them); each check fails on the default request
CHAT_HONOURED = {
    "messages": ({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]},
                 lambda p: [m["content"] for m in p.request.messages] == ["s", "u"]),
    "model": ({"model": "m"}, lambda p: p.request.model == "m"),
    "frequency_penalty": ({"frequency_penalty": 0.5}, lambda p: p.request.sampling.frequency_penalty == 0.5),
    "presence_penalty": ({"presence_penalty": 0.5}, lambda p: p.request.sampling.presence_penalty == 0.5),
    "logit_bias": ({"logit_bias": {"5": 1}}, lambda p: p.request.sampling.logit_bias == ((5, 1.0),)),
    "logprobs": ({"logprobs": True}, lambda p: p.request.sampling.logprobs == 0),
    "top_logprobs": ({"logprobs": True, "top_logprobs": 3}, lambda p: p.request.sampling.logprobs == 3),
    "max_completion_tokens": ({"max_completion_tokens": 7}, lambda p: p.request.sampling.max_tokens == 7),
    "max_tokens": ({"max_tokens": 7}, lambda p: p.request.sampling.max_tokens == 7),
    "n": ({"n": 3}, lambda p: p.n == 3),
    "parallel_tool_calls": ({"tools": [TOOL], "parallel_tool_calls": False}, lambda p: p.tools and not p.tools.parallel),
    "response_format": ({"response_format": {"type": "json_object"}}, lambda p: p.request.sampling.json_schema),
    "seed": ({"seed": 3}, lambda p: p.request.sampling.seed == 3),
    "stop": ({"stop": "x"}, lambda p: p.request.sampling.stop == ("x",)),
    "stream": ({"stream": True}, lambda p: p.stream),
    "stream_options": ({"stream": True, "stream_options": {"include_usage": True}}, lambda p: p.include_usage),
    "temperature": ({"temperature": 0.5}, lambda p: p.request.sampling.temperature == 0.5),
    "tool_choice": ({"tools": [TOOL], "tool_choice": "required"}, lambda p: p.tools and p.tools.choice == "required"),
    "tools": ({"tools": [TOOL]}, lambda p: [t.name for t in p.request.tools] == ["f"]),
    "top_p": ({"top_p": 0.5}, lambda p: p.request.sampling.top_p == 0.5),
}
COMPLETION_HONOURED = {
    "prompt": ({"prompt": ["a", "b"]}, lambda p: [r.prompt for r in p.requests] == ["a", "b"]),
    "best_of": ({"best_of": 3}, lambda p: p.per_prompt == 3),
    "echo": ({"echo": True}, lambda p: p.echo),
    **{k: v for k, v in CHAT_HONOURED.items() if k in ("model", "frequency_penalty", "presence_penalty", "logit_bias",
                                                        "max_tokens", "n", "seed", "stop", "stream", "stream_options",
                                                        "temperature", "top_p")},
    "logprobs": ({"logprobs": 2}, lambda p: p.request.sampling.logprobs == 2),
}
CHAT_REFUSED = {"audio": {"voice": "alloy", "format": "wav"}, "web_search_options": {}, "reasoning_effort": "low",
                "verbosity": "low", "prediction": {"type": "content", "content": "x"}, "moderation": {},
                "modalities": ["text", "audio"], "functions": [{"name": "f"}], "function_call": "auto"}
COMPLETION_REFUSED = {"suffix": "x"}
NO_EFFECT = {"user": "u", "metadata": {"k": "v"}, "store": True, "service_tier": "flex", "safety_identifier": "s",
             "prompt_cache_key": "k", "prompt_cache_retention": "24h", "prompt_cache_options": {"mode": "implicit"}}


def sdk_fields(module) -> set[str]:
    """The fields of an openai SDK request type (its `stream` lives in the streaming variants)."""
    return set(module.CompletionCreateParamsBase.__annotations__) | {"stream"}


@pytest.mark.parametrize(("endpoint", "parse", "base", "honoured", "refused"), [
    ("chat", parse_chat_request, M, CHAT_HONOURED, CHAT_REFUSED),
    ("completions", parse_completion_request, P, COMPLETION_HONOURED, COMPLETION_REFUSED),
])
def test_every_field_of_the_openai_request_types_is_honoured_refused_or_without_effect(
        endpoint, parse, base, honoured, refused) -> None:
    """Table-driven over the official SDK's request types: no known field is silently ignored. A field the
    SDK gains fails here until it is classified."""
    fields = sdk_fields(chat_create_params if endpoint == "chat" else completion_create_params)
    no_effect = fields & set(NO_EFFECT_FIELDS)
    assert fields == set(honoured) | set(refused) | no_effect, fields ^ (set(honoured) | set(refused) | no_effect)
    assert set(NO_EFFECT_FIELDS) == set(NO_EFFECT) and set(UNSUPPORTED_CHAT_FIELDS) < set(CHAT_REFUSED)
    default = parse(dict(base))
    for name, (body, shows) in honoured.items():
        assert shows(parse({**base, **body})), name
        assert not shows(default), name  # the check can fail: the default request does not show it
    for name, value in refused.items():
        with pytest.raises(InvalidRequestError) as info:
            parse({**base, name: value})
        assert info.value.field == name and str(info.value).startswith(f"{name}: ")
    for name in no_effect:
        assert parse({**base, name: NO_EFFECT[name]}) == default, name
