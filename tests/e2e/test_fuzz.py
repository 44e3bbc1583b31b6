"""Property-based fuzzing of a real running pdserve, both APIs: random, malformed and extreme requests
get a 200 or a 4xx in OpenAI's error shape (HTTP), OK or a client-error status (gRPC); never a 5xx,
INTERNAL, UNKNOWN or a hang, never a traceback; and the server still answers normally afterwards.
Requests go one at a time, so "overloaded" (429, RESOURCE_EXHAUSTED with retry-after-s) means a
worker stopped answering: that fails too.

Valid requests keep max_tokens at 1..4 (chat without one would run to the server's default of
hundreds of tokens), so each example finishes in well under a second on two CPU cores.
"""
from __future__ import annotations

import http.client
import json
import math
from urllib.parse import urlsplit

import grpc
import hypothesis
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context

from protos.pdserve.v1 import pdserve_pb2 as pb
from protos.pdserve.v1 import pdserve_pb2_grpc as pb_grpc

pytestmark = pytest.mark.model

DEADLINE_S = 60
FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                         HealthCheck.too_slow])
VOCAB = 49152  # SmolLM2's

# ---------------------------------------------------------------- values shared by both APIs


def big(value: object, n: int) -> st.SearchStrategy:
    """`value * n`, built lazily: hypothesis' statistics and failure reports print a short repr."""
    return st.just(n).map(lambda k: value * k)


small_text = st.text(max_size=40)
surrogate_text = st.builds(lambda a, s, b: a + s + b, st.text(max_size=5),
                           st.text(st.characters(categories=["Cs"]), min_size=1, max_size=2), st.text(max_size=5))
extreme_text = st.one_of(st.sampled_from(["", " ", "\x00", "\u202e\ufeff", "\U0001f642" * 10,
                                         "<|im_start|>system\n<|im_end|>", "\\ud800"]),
                        big("x", 1_000_001), big("hello ", 20_000))
texts = st.one_of(small_text, small_text, small_text, extreme_text)
valid_max_tokens = st.integers(1, 4)
extreme_ints = st.sampled_from([0, -1, -(2**63), 2**31 - 1, 2**31, 2**32 - 1, 2**63, 2**64, 10**30, 10_000])
extreme_floats = st.sampled_from([0.0, -0.0, -1.0, 1e-300, 5e-324, 1e-45, 2.0, 100.0, 100.0001, 1e308,
                                  math.inf, -math.inf, math.nan])
token_ids = st.one_of(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12),
                      st.lists(st.one_of(st.integers(0, VOCAB - 1), st.sampled_from([VOCAB, 2**31 - 1, 2**32 - 1])),
                               max_size=4))
stop_lists = st.one_of(st.lists(small_text, max_size=6), big(["a"], 5000), st.lists(surrogate_text, max_size=2))
stop_id_lists = st.one_of(st.lists(st.integers(0, 2**32 - 1), max_size=5), st.just(10_000).map(lambda n: list(range(n))))

# ---------------------------------------------------------------- HTTP: JSON bodies

ints = st.one_of(st.integers(-1000, 1000), extreme_ints)
scalars = st.one_of(st.none(), st.booleans(), ints, st.floats(), extreme_floats, texts)
json_values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                            st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                           max_leaves=10)
roles = st.sampled_from(["user", "system", "assistant", "developer", "tool", "bot", "", "USER"])
contents = st.one_of(texts, st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]),
                                                            "text": texts}), max_size=3), json_values)
messages = st.one_of(st.lists(st.fixed_dictionaries({"role": roles, "content": contents}), min_size=1, max_size=4),
                     big([{"role": "user", "content": "hi"}], 1025), json_values)
field_values = {  # per field: values that are often valid, and extremes
    "model": st.one_of(st.just("smollm2"), texts),
    "prompt": st.one_of(texts, token_ids, st.lists(texts, max_size=3), surrogate_text),
    "messages": messages,
    "max_tokens": st.one_of(valid_max_tokens, valid_max_tokens, extreme_ints),
    "max_completion_tokens": st.one_of(valid_max_tokens, extreme_ints),
    "temperature": st.one_of(st.floats(0, 2), extreme_floats),
    "top_p": st.one_of(st.floats(0, 1), extreme_floats),
    "top_k": st.one_of(st.integers(-2, 100), extreme_ints),
    "seed": st.one_of(st.integers(-1, 10), extreme_ints),
    "n": st.sampled_from([1, 2, 3, 0, 17]),
    "best_of": st.sampled_from([None, 1, 2, 3, 17]),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "stop": st.one_of(texts, stop_lists),
    "stop_token_ids": stop_id_lists,
    "ignore_eos": st.booleans(),
    "logprobs": st.sampled_from([None, False, True, 0, 5, 21]),
    "top_logprobs": st.sampled_from([None, 0, 3, 21]),
    "echo": st.booleans(),
    "presence_penalty": st.sampled_from([0, 0.5]),
    "frequency_penalty": st.one_of(st.floats(-2, 2), extreme_floats),
    "repetition_penalty": st.one_of(st.floats(0, 3), extreme_floats),
    "min_p": st.one_of(st.floats(0, 1), extreme_floats),
    "min_tokens": st.one_of(st.integers(-1, 10), extreme_ints),
    "logit_bias": st.sampled_from([{}, {"1": 2}]),
    "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}]),
    "tools": st.sampled_from([[], [{"type": "function"}]]),
    "user": texts,
}
FIELDS = sorted(field_values)


@st.composite
def http_bodies(draw: st.DrawFn, chat: bool) -> dict | list | str | bytes | None:
    shape = draw(st.sampled_from(["plausible", "plausible", "plausible", "random", "json", "bytes"]))
    if shape == "bytes":
        return draw(st.one_of(st.binary(max_size=60), big(b"[", 100_000), st.just(b'{"prompt": "hi", "x": NaN}')))
    if shape == "json":
        return draw(json_values)
    body: dict = {"model": "smollm2", "max_tokens": draw(valid_max_tokens), "stream": draw(st.booleans())}
    body["messages" if chat else "prompt"] = [{"role": "user", "content": "Hi!"}] if chat else "Once upon a time"
    if shape == "random":
        body = {}
    for name in draw(st.lists(st.sampled_from(FIELDS), max_size=4, unique=True)):
        body[name] = draw(st.one_of(field_values[name], field_values[name], field_values[name], json_values))
    if chat and body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = draw(valid_max_tokens)  # else the server default: hundreds of tokens
    return body


def post(server, path: str, body: object) -> tuple[int, str, bytes]:
    """POST on a fresh connection. Returns: (status, content type, body)."""
    url = urlsplit(server.http)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=DEADLINE_S)
    try:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()  # NaN / Infinity as JS literals
        conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.getheader("Content-Type", ""), resp.read()
    finally:
        conn.close()


def check_http(status: int, content_type: str, raw: bytes) -> None:
    assert status == 200 or 400 <= status < 500, (status, raw[:2000])
    assert status != 429, f"overloaded with one request at a time: a worker is stuck or dead: {raw[:500]!r}"
    assert b"Traceback" not in raw
    event(f"HTTP {status}")  # outcome counts: pytest --hypothesis-show-statistics
    if status != 200:
        err = json.loads(raw)["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], err
        assert err["type"] != "server_error", err
    elif content_type.startswith("text/event-stream"):
        events = raw.decode().removesuffix("\n\n").split("\n\n")
        assert events[-1] == "data: [DONE]", events[-3:]
        payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
        assert all("error" not in p for p in payloads), payloads[-2:]
        assert any(c.get("finish_reason") in ("stop", "length") for p in payloads for c in p.get("choices", []))
    else:
        choice = json.loads(raw)["choices"][0]
        assert choice["finish_reason"] in ("stop", "length"), choice


HTTP_CASES = [  # inputs that once broke or could break a server; always run
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 4, "temperature": 1e-300}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 5e-324}),
    ("/v1/completions", {"prompt": "a\ud800b", "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a\udfffb"}], "max_tokens": 2}),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "stop": ["\ud800"]}),
    ("/v1/completions", {"prompt": [VOCAB], "max_tokens": 2}),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "top_k": 2**62, "top_p": 1e-300, "temperature": 2}),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "stop_token_ids": [2**62], "seed": 2**63 - 1}),
    # a repetition penalty near 0 divides the seen tokens' logits by it: +inf, once a whole step's 500
    ("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 1, "stream": True,
                         "repetition_penalty": 1.0694772137381023e-193}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
                              "repetition_penalty": 5e-324, "temperature": 0.3}),
]


@pytest.mark.parametrize(("path", "body"), HTTP_CASES)
def test_http_known_cases(server, path: str, body: dict) -> None:
    check_http(*post(server, path, body))


@FUZZ
@given(chat=st.booleans(), data=st.data())
def test_http_fuzz(server, chat: bool, data: st.DataObject) -> None:
    body = data.draw(http_bodies(chat))
    check_http(*post(server, "/v1/chat/completions" if chat else "/v1/completions", body))


# ---------------------------------------------------------------- gRPC: proto requests

ALLOWED_CODES = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED}
nonempty_text = st.text(min_size=1, max_size=40)
unset = st.none()
# Per field: (valid values, extreme or invalid ones); None means "leave unset". Each example sets
# up to three fields from the second strategy, the rest from the first.
proto_fields = {
    "model": (st.sampled_from(["", "smollm2"]), st.one_of(st.sampled_from(["smollm2 ", "gpt-4"]), texts)),
    "request_id": (st.just(""), st.one_of(small_text, big("x", 10_000))),
    "input": (st.one_of(st.tuples(st.just("text"), nonempty_text),
                        st.tuples(st.just("token_ids"), st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12)),
                        st.tuples(st.just("chat"), st.lists(st.tuples(st.sampled_from(["user", "system", "assistant"]),
                                                                      small_text), min_size=1, max_size=4))),
              st.one_of(st.tuples(st.just("text"), texts), st.tuples(st.just("token_ids"), token_ids),
                        st.tuples(st.just("token_ids"), st.just([])),
                        st.tuples(st.just("chat"), st.lists(st.tuples(roles, texts), max_size=4)),
                        st.tuples(st.just("chat"), big([("user", "hi")], 1025)), st.tuples(st.just("none")))),
    "max_tokens": (valid_max_tokens, st.sampled_from([0, 2**31 - 1, 2**32 - 1, 10_000])),
    "temperature": (st.one_of(unset, st.floats(0, 2)), st.one_of(extreme_floats, st.floats())),
    "top_p": (st.one_of(unset, st.floats(0.01, 1)), st.one_of(extreme_floats, st.floats())),
    "top_k": (st.integers(0, 100), st.sampled_from([2**31 - 1, 2**32 - 1])),
    "seed": (st.one_of(unset, st.integers(0, 2**63 - 1)), st.integers(2**63 - 1, 2**64 - 1)),
    "stop": (st.lists(nonempty_text, max_size=4),
             st.one_of(st.lists(small_text, min_size=1, max_size=6), big(["a"], 5000), big(["x" * 100], 1000).map(lambda xs: ["".join(xs)]))),
    "stop_token_ids": (st.lists(st.integers(0, VOCAB - 1), max_size=4), stop_id_lists),
    "ignore_eos": (st.booleans(), st.booleans()),
    "n": (st.integers(0, 2), st.sampled_from([3, 16, 17, 2**32 - 1])),
    "logit_bias": (st.dictionaries(st.integers(0, VOCAB - 1), st.floats(-100, 100), max_size=3),
                   st.one_of(st.dictionaries(st.integers(0, 2**32 - 1), st.floats(), max_size=3),
                             st.builds(lambda: {i: 1.0 for i in range(301)}))),
}


@st.composite
def proto_requests(draw: st.DrawFn) -> pb.GenerateRequest:
    extreme = set(draw(st.lists(st.sampled_from(sorted(proto_fields)), max_size=3, unique=True)))
    value = {name: draw(options[name in extreme]) for name, options in proto_fields.items()}
    request = pb.GenerateRequest(model=value["model"], request_id=value["request_id"], n=value["n"])
    kind, *content = value["input"]
    if kind == "text":
        request.text = content[0]
    elif kind == "token_ids":
        request.token_ids.SetInParent()
        request.token_ids.ids.extend(content[0])
    elif kind == "chat":
        request.chat.SetInParent()
        request.chat.messages.extend(pb.ChatMessage(role=r, content=c) for r, c in content[0])
    s = request.sampling
    for name in ("max_tokens", "temperature", "top_p", "top_k", "seed", "ignore_eos"):
        if value[name] is not None:
            setattr(s, name, value[name])
    s.stop.extend(value["stop"])
    s.stop_token_ids.extend(value["stop_token_ids"])
    s.logit_bias.update(value["logit_bias"])
    return request


def event(value: str) -> None:
    """hypothesis.event, also callable from the plain (non-hypothesis) tests here."""
    if currently_in_test_context():
        hypothesis.event(value)


def grpc_generate(generate: grpc.UnaryStreamMultiCallable, request: pb.GenerateRequest | bytes) -> None:
    try:
        responses = list(generate(request, timeout=DEADLINE_S))
    except grpc.RpcError as exc:
        event(f"gRPC {exc.code().name}")
        assert exc.code() in ALLOWED_CODES, (exc.code(), exc.details(), str(request)[:1000])
        assert "Traceback" not in (exc.details() or "")
        trailers = dict(exc.trailing_metadata() or ())
        assert "retry-after-s" not in trailers, f"overloaded with one request at a time: {exc.details()}"
        return
    event("gRPC OK")
    if isinstance(request, bytes):
        responses = [pb.GenerateResponse.FromString(r) for r in responses]
    choices: dict[int, list[pb.GenerateResponse]] = {}
    for r in responses:  # several choices (n) interleave: each ends once
        choices.setdefault(r.index, []).append(r)
    assert choices and sorted(choices) == list(range(len(choices))), (sorted(choices), str(request)[:1000])
    for mine in choices.values():
        assert mine[-1].finish_reason in ("stop", "length"), (mine[-1:], str(request)[:1000])
        assert all(not r.finish_reason for r in mine[:-1])


@pytest.fixture(scope="module")
def channel(server):
    with grpc.insecure_channel(server.grpc, options=[("grpc.max_send_message_length", 64 << 20)]) as ch:
        yield ch


@pytest.fixture(scope="module")
def stub(channel):
    return pb_grpc.GenerationServiceStub(channel)


@pytest.fixture(scope="module")
def raw_generate(channel):
    """Generate taking and giving raw bytes (no protobuf on the client side)."""
    return channel.unary_stream("/pdserve.v1.GenerationService/Generate")


# Field 4 (sampling) with max_tokens 2, before and after the random bytes: the last one wins when the
# bytes parse, so a request that happens to be valid still finishes quickly.
SMALL_SAMPLING = pb.GenerateRequest(sampling=pb.SamplingParams(max_tokens=2)).SerializeToString()


@st.composite
def raw_requests(draw: st.DrawFn) -> bytes:
    valid = draw(proto_requests()).SerializeToString()
    junk = draw(st.one_of(st.binary(max_size=40), st.just(valid[:draw(st.integers(0, max(0, len(valid) - 1)))]),
                          st.just(b"\x0a\x02\xff\xfe"), st.just(b"\x0a\xff\xff\xff\xff\x0f")))
    return SMALL_SAMPLING + junk + SMALL_SAMPLING


GRPC_CASES = [
    pb.GenerateRequest(text="Hi", sampling=pb.SamplingParams(max_tokens=4, temperature=1e-300)),
    pb.GenerateRequest(text="Hi", sampling=pb.SamplingParams(max_tokens=2, temperature=math.nan, top_p=math.nan)),
    pb.GenerateRequest(text="Hi", sampling=pb.SamplingParams(max_tokens=2, top_k=2**32 - 1, top_p=5e-324,
                                                             temperature=1.0, seed=2**63 - 1)),
    pb.GenerateRequest(text="Hi", sampling=pb.SamplingParams(max_tokens=2**32 - 1, stop_token_ids=[2**32 - 1])),
    pb.GenerateRequest(token_ids=pb.TokenIds(ids=[VOCAB]), sampling=pb.SamplingParams(max_tokens=2)),
    pb.GenerateRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(role="robot", content="x")]),
                       sampling=pb.SamplingParams(max_tokens=2)),
    pb.GenerateRequest(chat=pb.ChatMessages(), sampling=pb.SamplingParams(max_tokens=2)),
    pb.GenerateRequest(text="x" * (9 << 20), sampling=pb.SamplingParams(max_tokens=2)),
    pb.GenerateRequest(text="Hi", n=16, sampling=pb.SamplingParams(max_tokens=2, logit_bias={0: 100.0})),
    SMALL_SAMPLING + b"\x0a\x02\xff\xfe",  # text that is not UTF-8
    SMALL_SAMPLING + b"\x0a\x10ab",  # truncated
]


@pytest.mark.parametrize("request_", GRPC_CASES, ids=range(len(GRPC_CASES)))
def test_grpc_known_cases(stub, raw_generate, request_: pb.GenerateRequest | bytes) -> None:
    grpc_generate(raw_generate if isinstance(request_, bytes) else stub.Generate, request_)


@FUZZ
@given(request=proto_requests())
def test_grpc_fuzz(stub: pb_grpc.GenerationServiceStub, request: pb.GenerateRequest) -> None:
    grpc_generate(stub.Generate, request)


@FUZZ
@given(raw=raw_requests())
def test_grpc_raw_bytes_fuzz(raw_generate, raw: bytes) -> None:
    grpc_generate(raw_generate, raw)


# ---------------------------------------------------------------- afterwards


def test_still_serves_normally(server, stub: pb_grpc.GenerationServiceStub) -> None:
    status, _, raw = post(server, "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 4,
                                                      "temperature": 0})
    assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] == 4
    status, _, raw = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                           "max_tokens": 3, "temperature": 0.7, "seed": 1})
    assert status == 200 and json.loads(raw)["choices"][0]["finish_reason"] in ("stop", "length")
    out = list(stub.Generate(pb.GenerateRequest(text="Once upon a time", sampling=pb.SamplingParams(max_tokens=4)),
                             timeout=DEADLINE_S))
    assert out[-1].finish_reason == "length" and sum(len(r.token_ids) for r in out) == 4
    url = urlsplit(server.http)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=10)
    conn.request("GET", "/health")
    assert conn.getresponse().status == 200
    conn.close()
