"""The gRPC API of a real running pdserve through the generated stubs: streaming Generate equal to
transformers greedy `generate`, ListModels, health, reflection, and errors as status codes."""
from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from protos.pdserve.v1 import pdserve_pb2, pdserve_pb2_grpc
from tests.e2e.conftest import chat_ids, greedy_ids, text_of

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def channel(server):
    with grpc.insecure_channel(server.grpc) as ch:
        yield ch


def generate(channel, **kw):
    stub = pdserve_pb2_grpc.GenerationServiceStub(channel)
    return list(stub.Generate(pdserve_pb2.GenerateRequest(**kw), timeout=120))


def test_stream_token_ids_match_generate(channel, server, oracle):
    messages = [{"role": "user", "content": "Name a fruit."}]
    want = greedy_ids(oracle, chat_ids(oracle, messages), 16)
    out = generate(channel, chat=pdserve_pb2.ChatMessages(messages=[pdserve_pb2.ChatMessage(**m) for m in messages]),
                   sampling=pdserve_pb2.SamplingParams(max_tokens=16))
    ids = [t for r in out for t in r.token_ids]
    assert ids == want
    assert "".join(r.text for r in out) == text_of(oracle, want)
    last = out[-1]
    assert last.finish_reason in ("stop", "length") and all(not r.finish_reason for r in out[:-1])
    assert last.usage.completion_tokens == len(want) and last.timings.ttft_s > 0
    assert len({r.request_id for r in out}) == 1


def test_token_id_prompt(channel, oracle):
    ids = oracle[1]("Once upon a time")["input_ids"]
    out = generate(channel, token_ids=pdserve_pb2.TokenIds(ids=ids), sampling=pdserve_pb2.SamplingParams(max_tokens=8))
    assert [t for r in out for t in r.token_ids] == greedy_ids(oracle, ids, 8)


def test_logprobs_are_the_models(channel, oracle):
    """logprobs=2, greedy: one per token, the model's log-softmax, the greedy token the likeliest."""
    import torch

    ids = oracle[1]("Once upon a time")["input_ids"]
    out = generate(channel, token_ids=pdserve_pb2.TokenIds(ids=ids),
                   sampling=pdserve_pb2.SamplingParams(max_tokens=5, logprobs=2))
    want = greedy_ids(oracle, ids, 5)
    got = [lp for r in out for lp in r.logprobs]
    assert [lp.token_id for lp in got] == [t for r in out for t in r.token_ids] == want
    with torch.no_grad():
        ref = torch.log_softmax(oracle[0](torch.tensor([ids + want[:-1]])).logits[0, len(ids) - 1:].float(), -1)
    for i, lp in enumerate(got):
        assert abs(lp.logprob - float(ref[i, lp.token_id])) < 1e-3
        assert [t.token_id for t in lp.top_logprobs][:1] == [lp.token_id] and len(lp.top_logprobs) == 2


def test_list_models_health_reflection(channel, server):
    stub = pdserve_pb2_grpc.GenerationServiceStub(channel)
    models = stub.ListModels(pdserve_pb2.ListModelsRequest(), timeout=10).models
    assert [m.id for m in models] == [server.model] and models[0].max_model_len > 0
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    refl = reflection_pb2_grpc.ServerReflectionStub(channel)
    resp = next(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    names = {s.name for s in resp.list_services_response.service}
    assert "pdserve.v1.GenerationService" in names and "grpc.health.v1.Health" in names


@pytest.mark.parametrize("kw,code,field", [
    (dict(text=""), grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
    (dict(), grpc.StatusCode.INVALID_ARGUMENT, "input"),
    (dict(text="hi", sampling=pdserve_pb2.SamplingParams(max_tokens=0)), grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
    (dict(text="hi", sampling=pdserve_pb2.SamplingParams(max_tokens=10**6)), grpc.StatusCode.INVALID_ARGUMENT,
     "max_tokens"),
    (dict(text="hi " * 9000), grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
    (dict(text="hi", sampling=pdserve_pb2.SamplingParams(top_p=1.5)), grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
    (dict(text="hi", sampling=pdserve_pb2.SamplingParams(logprobs=21)), grpc.StatusCode.INVALID_ARGUMENT, "logprobs"),
    (dict(text="hi", model="other"), grpc.StatusCode.NOT_FOUND, "model"),
])
def test_bad_input_gets_a_status(channel, kw, code, field):
    with pytest.raises(grpc.RpcError) as e:
        generate(channel, **kw)
    assert e.value.code() == code
    assert field in e.value.details() and "Traceback" not in e.value.details()
    assert generate(channel, text="Hi", sampling=pdserve_pb2.SamplingParams(max_tokens=2))[-1].finish_reason


def test_cli_generate_talks_to_the_server(server):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "pdserve", "generate", "--server", server.grpc, "Say hi",
                          "--max-tokens", "8"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() and "TTFT" in out.stderr
