"""Fuzz the OpenAI endpoints with random JSON: always 200 or a 4xx in the error shape, never a 5xx."""
from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from fake_router import MODEL, FakeRouter
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_http_server import ServerThread, sse_events

FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n",
          "stream", "stream_options", "stop", "seed", "logprobs", "top_logprobs", "echo", "best_of",
          "presence_penalty", "frequency_penalty", "logit_bias", "user", "suffix", "response_format", "tools",
          "tool_choice", "top_k", "ignore_eos", "stop_token_ids", "repetition_penalty", "min_p", "min_tokens",
          "skip_special_tokens", "use_beam_search"]

# Token ids stay small: the fake router materialises a word of `id` characters per prompt token.
ints = st.one_of(st.integers(-1000, 1000), st.sampled_from([2**31, 2**63, -(2**63), 10**30]))
scalars = st.one_of(st.none(), st.booleans(), ints, st.floats(), st.text(max_size=20))
json_values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                            st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                           max_leaves=12)
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "bot"]),
                                           "content": st.one_of(st.text(max_size=20), json_values)}), max_size=3)
plausible = {  # per field: values that are often valid
    "model": st.just(MODEL),
    "prompt": st.one_of(st.text(max_size=30), st.lists(st.integers(0, 50), max_size=5),
                        st.lists(st.one_of(st.text(max_size=10), st.lists(st.integers(0, 50), max_size=3)),
                                 max_size=3)),
    "messages": messages,
    "max_tokens": st.integers(-2, 70),
    "max_completion_tokens": st.integers(-2, 70),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0, 1),
    "top_k": st.integers(-2, 50),
    "n": st.integers(0, 3),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=5)),
    "seed": st.integers(-1, 2**64),
    "ignore_eos": st.booleans(),
    "stop_token_ids": st.lists(st.integers(-1, 200), max_size=3),
    "presence_penalty": st.sampled_from([0, 0.0, None, 0.5]),
    "frequency_penalty": st.sampled_from([0, None, -1]),
    "logprobs": st.sampled_from([None, False, True, 0, 5]),
    "top_logprobs": st.sampled_from([None, 0, 2]),
    "echo": st.booleans(),
    "best_of": st.sampled_from([None, 1, 2, 3, 17]),
    "suffix": st.sampled_from([None, "", "x"]),
    "logit_bias": st.sampled_from([None, {}, {"1": 2}]),
    "response_format": st.sampled_from([None, {"type": "text"}, {"type": "json_object"}]),
    "tools": st.sampled_from([None, [], [{"type": "function"}]]),
    "tool_choice": st.sampled_from([None, "none", "auto"]),
    "repetition_penalty": st.sampled_from([None, 1, 1.3, 0, -1.0]),
    "min_p": st.sampled_from([None, 0, 0.2, 1.5]),
    "min_tokens": st.integers(-1, 80),
    "skip_special_tokens": st.sampled_from([None, True, False]),
    "use_beam_search": st.sampled_from([None, False]),
}
random_bodies = st.dictionaries(st.sampled_from(FIELDS),
                                st.deferred(lambda: json_values), max_size=6)


@st.composite
def plausible_bodies(draw: st.DrawFn) -> dict:
    """Mostly-valid bodies with a few fields set to random values."""
    names = draw(st.lists(st.sampled_from(FIELDS), max_size=2, unique=True))
    body = {"model": MODEL, "prompt": "hello there", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 3, "stream": draw(st.booleans())}
    for name in names:
        valid_ish = plausible.get(name, json_values)
        body[name] = draw(st.one_of(valid_ish, valid_ish, json_values))
    return body


bodies = st.one_of(plausible_bodies(), plausible_bodies(), random_bodies, json_values, st.binary(max_size=40))


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    s = ServerThread(FakeRouter())
    yield s
    s.stop()


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]), body=bodies)
def test_random_bodies_never_5xx(server: ServerThread, path: str, body: object) -> None:
    if isinstance(body, bytes):
        status, headers, raw = server.request("POST", path, raw=body)
    else:
        status, headers, raw = server.request("POST", path, body=body)
    assert status == 200 or 400 <= status < 500, (status, raw)
    if status != 200:
        err = json.loads(raw)["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
    elif headers["content-type"].startswith("text/event-stream"):
        events = sse_events(raw)
        assert events[-1] == "[DONE]" and all("error" not in json.loads(e) for e in events[:-1])
    else:
        assert json.loads(raw)["choices"]
    assert b"Traceback" not in raw


def test_still_serving(server: ServerThread) -> None:
    status, _, raw = server.request("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert status == 200 and json.loads(raw)["choices"][0]["text"] == "w0 w1 "
    assert server.request("GET", "/health")[0] == 200
