"""The gRPC API over the deterministic FakeRouter: real generated stubs over a real channel.

The server runs on its own event loop in a background thread; the tests call it with sync stubs.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from engine.sampling_params import SamplingParams
from protos.pdserve.v1 import pdserve_pb2 as pb
from protos.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from router.grpc_server import SERVICE_NAME, start_grpc_server
from tests.unit.fake_router import MAX_MODEL_LEN, MODEL, FakeRouter

TIMEOUT_S = 20


class Served:
    def __init__(self, router: FakeRouter, channel: grpc.Channel) -> None:
        self.router = router
        self.channel = channel
        self.stub = pb_grpc.GenerationServiceStub(channel)

    def generate(self, request: pb.GenerateRequest) -> list[pb.GenerateResponse]:
        return list(self.stub.Generate(request, timeout=TIMEOUT_S))


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="grpc-server-loop", daemon=True)
    thread.start()
    router = FakeRouter()
    server, port = asyncio.run_coroutine_threadsafe(start_grpc_server(router, "127.0.0.1", 0), loop).result(30)
    assert port > 0
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield Served(router, channel)
    finally:
        channel.close()
        asyncio.run_coroutine_threadsafe(server.stop(None), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


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
                                   stop_token_ids=[2, 5], ignore_eos=True))
    responses = served.generate(request)
    assert {r.request_id for r in responses} == {"client-7"}
    sent = served.router.requests[-1]
    assert sent.sampling == SamplingParams(max_tokens=3, temperature=0.7, top_p=0.9, top_k=40, seed=0,
                                           stop=("x", "yy"), stop_token_ids=(2, 5), ignore_eos=True)
    assert (sent.request_id, sent.model) == ("client-7", MODEL)


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
    (pb.GenerateRequest(text="hi", model="gpt-9"), grpc.StatusCode.NOT_FOUND, "model: the model 'gpt-9'"),
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
