"""The gRPC API over the deterministic FakeRouter: real generated stubs over a real channel.

The server runs on its own event loop in a background thread; the tests call it with sync stubs.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from engine.sampling_params import SamplingParams
from protos.pdserve.v1 import pdserve_pb2 as pb
from protos.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from router.grpc_server import SERVICE_NAME, start_grpc_server
from router.limits import RequestLimits
from tests.unit.fake_router import MAX_MODEL_LEN, MODEL, FakeRouter

TIMEOUT_S = 20


class Served:
    def __init__(self, router: FakeRouter, channel: grpc.Channel, target: str) -> None:
        self.router = router
        self.channel = channel
        self.target = target
        self.stub = pb_grpc.GenerationServiceStub(channel)

    def generate(self, request: pb.GenerateRequest) -> list[pb.GenerateResponse]:
        return list(self.stub.Generate(request, timeout=TIMEOUT_S))


@contextmanager
def serving(root_certificates: bytes | None = None, **options: object) -> Iterator[Served]:
    """A server over a fresh FakeRouter; options go to `start_grpc_server`; a TLS channel when
    `root_certificates` is given."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="grpc-server-loop", daemon=True)
    thread.start()
    router = FakeRouter()
    server, port = asyncio.run_coroutine_threadsafe(start_grpc_server(router, "127.0.0.1", 0, **options),
                                                    loop).result(30)
    assert port > 0
    address = f"127.0.0.1:{port}"
    channel = grpc.insecure_channel(address) if root_certificates is None else \
        grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates))
    try:
        yield Served(router, channel, address)
    finally:
        channel.close()
        asyncio.run_coroutine_threadsafe(server.stop(None), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    with serving() as s:
        yield s


def text_request(text: str, **sampling: object) -> pb.GenerateRequest:
    return pb.GenerateRequest(text=text, sampling=pb.SamplingParams(**sampling))


def assert_complete(responses: list[pb.GenerateResponse], n_tokens: int, prompt_tokens: int) -> None:
    assert "".join(r.text for r in responses) == "".join(f"w{i} " for i in range(n_tokens))
    assert [t for r in responses for t in r.token_ids] == [100 + i for i in range(n_tokens)]
    assert [r.finish_reason for r in responses] == [""] * (len(responses) - 1) + ["length"]
    assert len({r.request_id for r in responses}) == 1 and responses[0].request_id
    assert all(not r.HasField("usage") and not r.HasField("timings") for r in responses[:-1])
    last = responses[-1]
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (prompt_tokens, n_tokens)
    assert last.usage.total_tokens == prompt_tokens + n_tokens and last.usage.cached_tokens == 0


def test_generate_text_streams_deltas_usage_and_timings(served: Served) -> None:
    responses = served.generate(text_request("hello big world", max_tokens=5))
    assert len(responses) == 5
    assert_complete(responses, n_tokens=5, prompt_tokens=3)
    t = responses[-1].timings
    assert (t.path, t.prefill_worker, t.decode_worker) == ("remote", "prefill-0", "decode-0")
    assert (t.queue_s, t.prefill_s, t.transfer_s, t.decode_s, t.ttft_s, t.e2e_s) == \
        pytest.approx((0.001, 0.01, 0.002, 0.05, 0.013, 0.06))


def test_unset_sampling_takes_defaults_and_empty_strings_mean_unset(served: Served) -> None:
    responses = served.generate(pb.GenerateRequest(text="hi"))
    assert_complete(responses, n_tokens=16, prompt_tokens=1)
    sent = served.router.requests[-1]
    assert sent.sampling == SamplingParams()
    assert (sent.prompt, sent.messages, sent.request_id, sent.model) == ("hi", None, None, None)


def test_all_sampling_fields_and_ids_reach_the_router(served: Served) -> None:
    request = pb.GenerateRequest(
        text="a b", request_id="client-7", model=MODEL,
        sampling=pb.SamplingParams(max_tokens=3, temperature=0.7, top_p=0.9, top_k=40, seed=0, stop=["x", "yy"],
                                   stop_token_ids=[2, 5], ignore_eos=True, min_p=0.1, min_tokens=2,
                                   presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.25,
                                   logprobs=4, logit_bias={7: 2.5, 3: -100}))
    responses = served.generate(request)
    assert {r.request_id for r in responses} == {"client-7"}
    sent = served.router.requests[-1]
    assert sent.sampling == SamplingParams(max_tokens=3, temperature=0.7, top_p=0.9, top_k=40, seed=0,
                                           stop=("x", "yy"), stop_token_ids=(2, 5), ignore_eos=True, min_p=0.1,
                                           min_tokens=2, presence_penalty=0.5, frequency_penalty=-0.5,
                                           repetition_penalty=1.25, logprobs=4, logit_bias=((3, -100.0), (7, 2.5)))
    assert (sent.request_id, sent.model) == ("client-7", MODEL)


def test_response_format_becomes_the_json_schema(served: Served) -> None:
    """As on HTTP: JSON_OBJECT is any object, JSON_SCHEMA the schema's compact text, TEXT (unset) none."""
    schema = '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}'
    for fmt, expected in ((pb.ResponseFormat(type=pb.ResponseFormat.JSON_OBJECT), '{"type":"object"}'),
                          (pb.ResponseFormat(type=pb.ResponseFormat.JSON_SCHEMA, json_schema=schema),
                           '{"type":"object","properties":{"a":{"type":"integer"}},"required":["a"]}'),
                          (pb.ResponseFormat(), None)):
        served.generate(text_request("a b", max_tokens=2, response_format=fmt))
        assert served.router.requests[-1].sampling.json_schema == expected


@pytest.mark.parametrize("k", [0, 2])
def test_logprobs_come_with_their_tokens(served: Served, k: int) -> None:
    """One TokenLogprob per token id of each response, with the k likeliest; none when not asked."""
    responses = served.generate(text_request("a b", max_tokens=3, logprobs=k))
    assert [len(r.logprobs) for r in responses] == [len(r.token_ids) for r in responses]
    got = [lp for r in responses for lp in r.logprobs]
    assert [(lp.token_id, lp.logprob) for lp in got] == [(100, 0.0), (101, -0.5), (102, -1.0)]
    assert [[(t.token_id, t.logprob) for t in lp.top_logprobs] for lp in got] == \
        [[(100 + i, -0.5 * i), (1, -5.0)][:k] for i in range(3)]
    assert all(not r.logprobs for r in served.generate(text_request("a b", max_tokens=2)))


def test_chat_input(served: Served) -> None:
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role="system", content="be brief"),
                                     pb.ChatMessage(role="user", content="hi there")])
    responses = served.generate(pb.GenerateRequest(chat=chat, sampling=pb.SamplingParams(max_tokens=2)))
    assert_complete(responses, n_tokens=2, prompt_tokens=6)  # "system: be brief" / "user: hi there"
    sent = served.router.requests[-1]
    assert sent.prompt is None
    assert sent.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]


def test_token_id_input(served: Served) -> None:
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[3, 1, 4, 1]), sampling=pb.SamplingParams(max_tokens=4))
    assert_complete(served.generate(request), n_tokens=4, prompt_tokens=4)
    assert served.router.requests[-1].prompt == [3, 1, 4, 1]


def test_list_models(served: Served) -> None:
    response = served.stub.ListModels(pb.ListModelsRequest(), timeout=TIMEOUT_S)
    assert [(m.id, m.created, m.owned_by, m.max_model_len) for m in response.models] == \
        [(MODEL, 1700000000, "pdserve", MAX_MODEL_LEN)]


@pytest.mark.parametrize("service", ["", SERVICE_NAME])
def test_health_check_serving(served: Served, service: str) -> None:
    stub = health_pb2_grpc.HealthStub(served.channel)
    response = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=TIMEOUT_S)
    assert response.status == health_pb2.HealthCheckResponse.SERVING


def test_reflection_lists_the_services(served: Served) -> None:
    db = ProtoReflectionDescriptorDatabase(served.channel)
    assert {SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME} <= set(db.get_services())
    file = db.FindFileContainingSymbol(SERVICE_NAME)
    assert file.name == "protos/pdserve/v1/pdserve.proto"
    assert [m.name for m in file.service[0].method] == ["Generate", "ListModels"]


ERROR_CASES = [
    (pb.GenerateRequest(), grpc.StatusCode.INVALID_ARGUMENT, "input:"),
    (pb.GenerateRequest(text=""), grpc.StatusCode.INVALID_ARGUMENT, "prompt:"),
    (pb.GenerateRequest(token_ids=pb.TokenIds()), grpc.StatusCode.INVALID_ARGUMENT, "prompt:"),
    (text_request("hi", max_tokens=0), grpc.StatusCode.INVALID_ARGUMENT, "max_tokens:"),
    (text_request("hi", max_tokens=MAX_MODEL_LEN), grpc.StatusCode.INVALID_ARGUMENT, "max_tokens:"),
    (text_request("hi", temperature=-0.5), grpc.StatusCode.INVALID_ARGUMENT, "temperature:"),
    (text_request("hi", temperature=1e6), grpc.StatusCode.INVALID_ARGUMENT, "temperature:"),
    (text_request("hi", top_p=0.0), grpc.StatusCode.INVALID_ARGUMENT, "top_p:"),
    (text_request("hi", top_p=1.5), grpc.StatusCode.INVALID_ARGUMENT, "top_p:"),
    (text_request("hi", seed=2**63), grpc.StatusCode.INVALID_ARGUMENT, "seed:"),
    (text_request("hi", stop=[""]), grpc.StatusCode.INVALID_ARGUMENT, "stop:"),
    (text_request("hi", min_p=1.5), grpc.StatusCode.INVALID_ARGUMENT, "min_p:"),
    (text_request("hi", max_tokens=2, min_tokens=3), grpc.StatusCode.INVALID_ARGUMENT, "min_tokens:"),
    (text_request("hi", presence_penalty=2.5), grpc.StatusCode.INVALID_ARGUMENT, "presence_penalty:"),
    (text_request("hi", frequency_penalty=float("nan")), grpc.StatusCode.INVALID_ARGUMENT, "frequency_penalty:"),
    (text_request("hi", repetition_penalty=0.0), grpc.StatusCode.INVALID_ARGUMENT, "repetition_penalty:"),
    (text_request("hi", logprobs=21), grpc.StatusCode.INVALID_ARGUMENT, "logprobs:"),
    (text_request("hi", response_format=pb.ResponseFormat(type=pb.ResponseFormat.JSON_SCHEMA)),
     grpc.StatusCode.INVALID_ARGUMENT, "response_format:"),
    (text_request("hi", response_format=pb.ResponseFormat(type=pb.ResponseFormat.JSON_SCHEMA, json_schema="[1]")),
     grpc.StatusCode.INVALID_ARGUMENT, "response_format:"),
    (text_request("hi", response_format=pb.ResponseFormat(type=pb.ResponseFormat.JSON_SCHEMA,
                                                          json_schema='{"type": "foo"}')),
     grpc.StatusCode.INVALID_ARGUMENT, "response_format: the JSON schema is not supported"),
    (text_request("hi", response_format=pb.ResponseFormat(json_schema='{"type": "object"}')),
     grpc.StatusCode.INVALID_ARGUMENT, "response_format:"),
    (text_request("hi", max_tokens=5, min_tokens=1, response_format=pb.ResponseFormat(
        type=pb.ResponseFormat.JSON_OBJECT)), grpc.StatusCode.INVALID_ARGUMENT, "min_tokens:"),
    (text_request("hi", logit_bias={5: 100.5}), grpc.StatusCode.INVALID_ARGUMENT, "logit_bias: bias of token 5"),
    (text_request("hi", logit_bias={i: 1.0 for i in range(301)}), grpc.StatusCode.INVALID_ARGUMENT,
     "logit_bias: holds 301 tokens"),
    (pb.GenerateRequest(text="hi", n=17), grpc.StatusCode.INVALID_ARGUMENT, "n: must be in [1, 16]"),
    (pb.GenerateRequest(text="hi", model="gpt-9"), grpc.StatusCode.NOT_FOUND, "model: the model 'gpt-9'"),
    (pb.GenerateRequest(chat=pb.ChatMessages()), grpc.StatusCode.INVALID_ARGUMENT, "messages:"),
    (pb.GenerateRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(role="robot", content="x")])),
     grpc.StatusCode.INVALID_ARGUMENT, "messages[0].role:"),
    (pb.GenerateRequest(text="hi", request_id="two\nlines"), grpc.StatusCode.INVALID_ARGUMENT, "request_id:"),
    (pb.GenerateRequest(text="hi", request_id="x" * 129), grpc.StatusCode.INVALID_ARGUMENT, "request_id:"),
    # size limits (router.limits defaults)
    (pb.GenerateRequest(text="x" * 1_000_001), grpc.StatusCode.INVALID_ARGUMENT, "prompt: has 1000001 characters"),
    (text_request("hi", stop=["a", "b", "c", "d", "e"]), grpc.StatusCode.INVALID_ARGUMENT, "stop: at most 4"),
    (text_request("hi", stop=["a"] * 100_000), grpc.StatusCode.INVALID_ARGUMENT, "stop: at most 4"),
    (text_request("hi", stop_token_ids=range(65)), grpc.StatusCode.INVALID_ARGUMENT, "stop_token_ids: at most 64"),
    (pb.GenerateRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="x")] * 1025)),
     grpc.StatusCode.INVALID_ARGUMENT, "messages: has 1025 messages"),
    (pb.GenerateRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="x" * 600_000)] * 2)),
     grpc.StatusCode.INVALID_ARGUMENT, "messages: have 1200000 characters"),
]


@pytest.mark.parametrize("request_, code, prefix", ERROR_CASES)
def test_invalid_requests(served: Served, request_: pb.GenerateRequest, code: grpc.StatusCode, prefix: str) -> None:
    with pytest.raises(grpc.RpcError) as info:
        served.generate(request_)
    assert info.value.code() == code
    assert info.value.details().startswith(prefix), info.value.details()


def test_overload_is_resource_exhausted_with_retry_after(served: Served) -> None:
    with pytest.raises(grpc.RpcError) as info:
        served.generate(pb.GenerateRequest(text="overload"))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "retry later" in info.value.details()
    assert ("retry-after-s", "2") in tuple(info.value.trailing_metadata())


def test_n_choices_stream_interleaved_each_with_its_index(served: Served) -> None:
    """n = 3: three router requests (seeds 5, 6, 7), each choice's responses whole under its index, the
    first choice's request id on all; each choice's last response has its own usage."""
    before = len(served.router.requests)
    responses = served.generate(pb.GenerateRequest(text="a b c", n=3,
                                                   sampling=pb.SamplingParams(max_tokens=4, seed=5, logprobs=0)))
    sent = served.router.requests[before:]
    assert [r.sampling.seed for r in sent] == [5, 6, 7] and {r.prompt for r in sent} == {"a b c"}
    assert sorted({r.index for r in responses}) == [0, 1, 2]
    for i in range(3):
        mine = [r for r in responses if r.index == i]
        assert_complete(mine, n_tokens=4, prompt_tokens=3)
        assert [lp.logprob for r in mine for lp in r.logprobs] == [-0.5 * t - 0.25 * ((5 + i) % 4) for t in range(4)]
    assert len({r.request_id for r in responses}) == 1
    one = served.generate(text_request("a b", max_tokens=2))
    assert {r.index for r in one} == {0} and len(served.router.requests) == before + 4  # n unset: one


def test_a_failing_choice_fails_the_call_and_aborts_the_others(served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(served.router, "token_delay_ms", 20.0)
    before = len(served.router.aborted)
    with pytest.raises(grpc.RpcError) as info:
        served.generate(pb.GenerateRequest(text="explode", n=2, request_id="boom-n",
                                           sampling=pb.SamplingParams(max_tokens=20)))
    assert info.value.code() == grpc.StatusCode.INTERNAL and "KV transfer failed" in info.value.details()
    deadline = time.monotonic() + 10
    while len(served.router.aborted) < before + 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert served.router.aborted[before:].count("boom-n") >= 2  # neither choice's stream is left running


def test_failure_mid_stream_is_internal_with_its_message(served: Served) -> None:
    call = served.stub.Generate(pb.GenerateRequest(text="explode", request_id="boom-1"), timeout=TIMEOUT_S)
    assert next(call).text == "w0 "
    with pytest.raises(grpc.RpcError) as info:
        next(call)
    assert info.value.code() == grpc.StatusCode.INTERNAL
    assert info.value.details() == "request boom-1: KV transfer failed"


def test_unexpected_error_is_internal_without_traceback(served: Served, monkeypatch: pytest.MonkeyPatch,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    async def broken_submit(request: object) -> None:
        raise KeyError("secret internals")

    monkeypatch.setattr(served.router, "submit", broken_submit)
    with caplog.at_level(logging.ERROR, logger="router.grpc_server"), pytest.raises(grpc.RpcError) as info:
        served.generate(pb.GenerateRequest(text="hi", request_id="r-42"))
    assert info.value.code() == grpc.StatusCode.INTERNAL
    assert info.value.details() == "internal error (request id r-42)"
    assert "Traceback" not in info.value.debug_error_string() and "secret" not in info.value.details()
    logged = [r for r in caplog.records if r.name == "router.grpc_server"]
    assert logged and logged[-1].exc_info is not None and "r-42" in logged[-1].getMessage()


def test_cancel_mid_stream_aborts_the_request(served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(served.router, "token_delay_ms", 50.0)
    call = served.stub.Generate(text_request("cancel me", max_tokens=50), timeout=TIMEOUT_S)
    first = [next(call), next(call)]
    call.cancel()
    with pytest.raises(grpc.RpcError) as info:
        next(call)
    assert info.value.code() == grpc.StatusCode.CANCELLED
    rid = first[0].request_id
    deadline = time.monotonic() + 10
    while rid not in served.router.aborted and time.monotonic() < deadline:
        time.sleep(0.01)
    assert rid in served.router.aborted


def test_still_serves_after_errors(served: Served) -> None:
    for request, _, _ in ERROR_CASES:
        with pytest.raises(grpc.RpcError):
            served.generate(request)
    with pytest.raises(grpc.RpcError):
        served.generate(pb.GenerateRequest(text="explode"))
    assert_complete(served.generate(text_request("still here", max_tokens=3)), n_tokens=3, prompt_tokens=2)
    health_stub = health_pb2_grpc.HealthStub(served.channel)
    assert health_stub.Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT_S).status == \
        health_pb2.HealthCheckResponse.SERVING


def test_huge_message_is_resource_exhausted(served: Served) -> None:
    with pytest.raises(grpc.RpcError) as info:
        served.generate(pb.GenerateRequest(text="x" * (9 << 20)))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert_complete(served.generate(text_request("after", max_tokens=2)), n_tokens=2, prompt_tokens=1)


@pytest.mark.parametrize("raw", [b"\x0a\x02\xff\xfe", b"\xff\xff\xff\xff", b"\x0a\x10ab", b"\x22\x03\x08"])
def test_malformed_bytes_are_invalid_argument(served: Served, raw: bytes) -> None:
    """Bad UTF-8 in a string, corrupt or truncated wire format: INVALID_ARGUMENT, not grpc's UNKNOWN."""
    n_requests = len(served.router.requests)
    methods = [(served.channel.unary_stream, "/pdserve.v1.GenerationService/Generate"),
               (served.channel.unary_unary, "/grpc.health.v1.Health/Check")]
    if raw[0] != 0x0A:  # ListModelsRequest has no field 1: those bytes parse
        methods.append((served.channel.unary_unary, "/pdserve.v1.GenerationService/ListModels"))
    for kind, method in methods:
        with pytest.raises(grpc.RpcError) as info:
            result = kind(method)(raw, timeout=TIMEOUT_S)
            list(result) if kind == served.channel.unary_stream else result
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, info.value.details())
        assert info.value.details().startswith("request: not a valid protobuf message")
    assert len(served.router.requests) == n_requests


def test_configured_limits() -> None:
    limits = RequestLimits(max_prompt_chars=10, max_messages=1, max_stop=1, max_stop_token_ids=1)
    with serving(limits=limits, max_message_bytes=1000) as s:
        assert_complete(s.generate(text_request("x" * 10, max_tokens=1, stop=["s"], stop_token_ids=[1])), 1, 1)
        for request, prefix in [(pb.GenerateRequest(text="x" * 11), "prompt:"),
                                (text_request("x", stop=["a", "b"]), "stop:"),
                                (text_request("x", stop_token_ids=[1, 2]), "stop_token_ids:")]:
            with pytest.raises(grpc.RpcError) as info:
                s.generate(request)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and info.value.details().startswith(prefix)
        with pytest.raises(grpc.RpcError) as info:
            s.generate(pb.GenerateRequest(text="x" * 2000))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


# ---------------------------------------------------------------- API keys


KEY, OTHER_KEY = "sk-test-0123456789", "sk-second-key"


@pytest.fixture(scope="module")
def keyed() -> Iterator[Served]:
    with serving(api_keys=frozenset({KEY, OTHER_KEY})) as s:
        yield s


def calls(served: Served, metadata: tuple[tuple[str, str], ...]) -> list:
    """Both methods of the generation service, as thunks."""
    return [lambda: list(served.stub.Generate(text_request("hi", max_tokens=2), timeout=TIMEOUT_S, metadata=metadata)),
            lambda: served.stub.ListModels(pb.ListModelsRequest(), timeout=TIMEOUT_S, metadata=metadata)]


@pytest.mark.parametrize("metadata", [
    (), (("authorization", "Bearer sk-wrong-guess"),), (("x-api-key", "sk-wrong-guess"),),
    (("authorization", KEY),), (("authorization", "Basic " + KEY),), (("x-api-key", "Bearer " + KEY),),
    (("authorization", "Bearer " + KEY[:-1]),), (("api-key", KEY),), (("authorization", "Bearer " + KEY.upper()),),
])
def test_missing_or_wrong_key_is_unauthenticated(keyed: Served, metadata: tuple[tuple[str, str], ...]) -> None:
    n_requests = len(keyed.router.requests)
    for call in calls(keyed, metadata):
        with pytest.raises(grpc.RpcError) as info:
            call()
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        details = info.value.details()
        assert "API key" in details and KEY not in details and "sk-wrong-guess" not in details
        assert ("missing" in details) == (not metadata or metadata[0][0] == "api-key")
    assert len(keyed.router.requests) == n_requests  # nothing reached the router


@pytest.mark.parametrize("metadata", [(("authorization", "Bearer " + KEY),), (("authorization", "bearer " + OTHER_KEY),),
                                      (("x-api-key", KEY),), (("x-api-key", OTHER_KEY),),
                                      (("authorization", "Bearer wrong"), ("x-api-key", KEY))])
def test_right_key_works(keyed: Served, metadata: tuple[tuple[str, str], ...]) -> None:
    generate, list_models = calls(keyed, metadata)
    assert_complete(generate(), n_tokens=2, prompt_tokens=1)
    assert [m.id for m in list_models().models] == [MODEL]
    with pytest.raises(grpc.RpcError) as info:  # past the key check, the usual validation
        list(keyed.stub.Generate(text_request("hi", top_p=2.0), timeout=TIMEOUT_S, metadata=metadata))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_health_and_reflection_stay_open(keyed: Served) -> None:
    stub = health_pb2_grpc.HealthStub(keyed.channel)
    for service in ("", SERVICE_NAME):
        assert stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=TIMEOUT_S).status == \
            health_pb2.HealthCheckResponse.SERVING
    assert SERVICE_NAME in ProtoReflectionDescriptorDatabase(keyed.channel).get_services()


def test_keys_are_never_logged(keyed: Served, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG):
        for metadata in ((("authorization", "Bearer sk-guess-1234"),), (("x-api-key", KEY),)):
            try:
                calls(keyed, metadata)[1]()
            except grpc.RpcError:
                pass
    assert any("refused" in r.getMessage() for r in caplog.records if r.name == "router.grpc_server")
    assert KEY not in caplog.text and "sk-guess-1234" not in caplog.text


def test_no_keys_means_no_auth(served: Served) -> None:
    generate, list_models = calls(served, (("authorization", "Bearer anything"),))
    assert_complete(generate(), n_tokens=2, prompt_tokens=1)
    assert list_models().models
    assert list(served.stub.ListModels(pb.ListModelsRequest(), timeout=TIMEOUT_S).models)


def test_over_tls_a_trusting_client_streams_and_a_plaintext_one_is_refused(tmp_path):
    from pdserve.grpc_client import generate_stream
    from router.tls import TlsFiles
    from tests.conftest import self_signed_cert

    cert, key = self_signed_cert(tmp_path)
    with serving(root_certificates=cert.read_bytes(), tls=TlsFiles(str(cert), str(key))) as s:
        out = s.generate(text_request("hello world", max_tokens=4))
        assert "".join(r.text for r in out) and out[-1].finish_reason == "length"
        got = list(generate_stream(s.target, "hi", False, 3, 0.0, 1.0, 0, None, [], timeout_s=TIMEOUT_S,
                                   root_certificates=cert.read_bytes()))  # what `generate --tls-ca` runs
        assert got[-1].finish_reason == "length"
        with grpc.insecure_channel(s.target) as plain, pytest.raises(grpc.RpcError) as e:
            list(pb_grpc.GenerationServiceStub(plain).Generate(text_request("hi", max_tokens=2), timeout=5))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_tls_files_that_do_not_load_are_refused_naming_the_flag(tmp_path):
    from router.tls import TlsFiles
    from tests.conftest import self_signed_cert

    cert, key = self_signed_cert(tmp_path)
    with pytest.raises(ValueError, match="ssl_keyfile: cannot read"):
        TlsFiles(str(cert), str(tmp_path / "missing.pem")).http_context()
    with pytest.raises(ValueError, match="ssl_certfile / ssl_keyfile: not a PEM certificate"):
        TlsFiles(str(key), str(key)).http_context()
