"""response_format through the official `openai` SDK against a real `pdserve serve` whose round_robin policy
alternates the remote path (prefill worker, then decode worker) and the local one: json_schema output
validates for several prompts on both paths, chat and completions, streamed and not; json_object parses;
a bad response_format is a 400 naming it; gRPC's sampling.response_format gives the same. Tool calling rides the same grammar path: tool_choice required and a
named function give tool_calls whose arguments validate against the tool's parameters, on both paths and
streamed, and a follow-up with the assistant's tool_calls and a tool message is answered; bad tools are a 400."""
from __future__ import annotations

import json

import grpc
import jsonschema
import openai
import pytest

from protos.pdserve.v1 import pdserve_pb2 as pb
from protos.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from tests.e2e.conftest import start_server, stop_server
from tests.integration.test_structured_output import PERSON

pytestmark = pytest.mark.model

SCHEMA = PERSON  # the engine tests' schema: one that SmolLM2 completes
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
PROMPTS = ["Describe a person as JSON.", "Invent a character for a story.", "Tell me about a student in Paris.",
           "Describe an old sailor.", "Make up a user profile.", "Hi!"]


@pytest.fixture(scope="module")
def alternating():
    # the grammar path, not the compiled step or loans: a server that starts without them (a minute sooner)
    srv = start_server(["--prefill", "1", "--decode", "1", "--policy", "round_robin", "--no-compile",
                        "--no-lend-threads"])
    yield srv
    assert stop_server(srv.proc, log=srv.log) == 0, "".join(srv.log[-40:])


@pytest.fixture(scope="module")
def client(alternating):
    return openai.OpenAI(base_url=alternating.http + "/v1", api_key="unused", max_retries=0, timeout=120)


def path_of(resp) -> str:
    return resp.usage.model_extra["pdserve_timings"]["path"]


def test_json_schema_validates_on_both_paths(client, alternating):
    paths = set()
    for prompt in PROMPTS:
        for temperature in (0, 0.7):
            resp = client.chat.completions.create(model=alternating.model, messages=[{"role": "user", "content": prompt}],
                                                  max_tokens=150, temperature=temperature, seed=1, response_format=FORMAT)
            choice = resp.choices[0]
            assert choice.finish_reason == "stop", choice.message.content
            jsonschema.validate(json.loads(choice.message.content), SCHEMA)
            paths.add(path_of(resp))
    assert paths == {"remote", "local"}


def test_json_schema_streamed_and_on_completions(client, alternating):
    paths = set()
    for _ in range(2):
        stream = client.chat.completions.create(
            model=alternating.model, messages=[{"role": "user", "content": PROMPTS[2]}], max_tokens=150, temperature=0,
            response_format=FORMAT, stream=True, stream_options={"include_usage": True})
        text, usage = "", None
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
            usage = chunk.usage or usage
        jsonschema.validate(json.loads(text), SCHEMA)
        paths.add(usage.model_extra["pdserve_timings"]["path"])
    assert paths == {"remote", "local"}
    for _ in range(2):  # completions: the same field, a raw prompt
        resp = client.completions.create(model=alternating.model, prompt="A person, as JSON: ", max_tokens=150,
                                         temperature=0, extra_body={"response_format": FORMAT})
        jsonschema.validate(json.loads(resp.choices[0].text), SCHEMA)


def test_json_object_parses(client, alternating):
    """Any JSON object; prompts the small model copies, so that it closes its object well before max_tokens."""
    for prompt in ('Repeat this JSON object exactly: {"answer": "yes", "count": 3}',
                   'Repeat this JSON object exactly: {"city": "Paris", "capital": true}'):
        resp = client.chat.completions.create(model=alternating.model, messages=[{"role": "user", "content": prompt}],
                                              max_tokens=100, temperature=0, response_format={"type": "json_object"})
        assert resp.choices[0].finish_reason == "stop", resp.choices[0].message.content
        assert isinstance(json.loads(resp.choices[0].message.content), dict)


def test_grpc_response_format_validates(alternating):
    fmt = pb.ResponseFormat(type=pb.ResponseFormat.JSON_SCHEMA, json_schema=json.dumps(SCHEMA))
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=PROMPTS[0])])
    with grpc.insecure_channel(alternating.grpc) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        responses = list(stub.Generate(pb.GenerateRequest(chat=chat, sampling=pb.SamplingParams(
            max_tokens=150, response_format=fmt)), timeout=120))
        assert responses[-1].finish_reason == "stop"
        jsonschema.validate(json.loads("".join(r.text for r in responses)), SCHEMA)
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(response_format=pb.ResponseFormat(
                type=pb.ResponseFormat.JSON_SCHEMA, json_schema='{"type": "foo"}'))), timeout=60))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details().startswith("response_format:")


@pytest.mark.parametrize("response_format", [
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}},
    {"type": "json_schema", "json_schema": {"name": "x"}},
    {"type": "yaml"},
])
def test_a_bad_response_format_is_a_400_naming_it(client, alternating, response_format):
    with pytest.raises(openai.BadRequestError, match="response_format") as info:
        client.chat.completions.create(model=alternating.model, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=5, response_format=response_format)
    assert info.value.body["param"] == "response_format"
    assert "Traceback" not in info.value.body["message"]


WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                   "unit": {"enum": ["celsius", "fahrenheit"]}},
                  "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city now.",
                                           "parameters": WEATHER_PARAMS}},
         {"type": "function", "function": {"name": "get_time", "description": "The local time in a city.",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string", "maxLength": 20}},
                                               "required": ["city"], "additionalProperties": False}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def test_tool_calls_validate_on_both_paths_and_the_history_is_answered(client, alternating):
    paths = set()
    for tool_choice in ("required", "required", NAMED, NAMED):
        resp = client.chat.completions.create(model=alternating.model, messages=ASK, tools=TOOLS, tool_choice=tool_choice,
                                              parallel_tool_calls=False, max_tokens=60, temperature=0)
        choice = resp.choices[0]
        assert choice.finish_reason == "tool_calls", choice.message
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        if tool_choice == NAMED:
            assert call.function.name == "get_weather"
        params = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call.function.name)
        jsonschema.validate(json.loads(call.function.arguments), params)
        assert resp.usage.completion_tokens > 0
        paths.add(path_of(resp))
    assert paths == {"remote", "local"}
    history = [*ASK, choice.message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 22, "sky": "clear"}'}]
    answer = client.chat.completions.create(model=alternating.model, messages=history, tools=TOOLS, max_tokens=40,
                                            temperature=0)
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert answer.choices[0].message.content or answer.choices[0].message.tool_calls
    assert answer.usage.prompt_tokens > resp.usage.prompt_tokens  # the call and its result are in the prompt


def test_streamed_tool_call_arguments_arrive_in_pieces(client, alternating):
    stream = client.chat.completions.create(model=alternating.model, messages=ASK, tools=TOOLS, tool_choice=NAMED,
                                            max_tokens=60, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    pieces, ids, finish, usage = [], set(), None, None
    for chunk in stream:
        usage = chunk.usage or usage
        if not chunk.choices:
            continue
        for delta in chunk.choices[0].delta.tool_calls or []:
            assert delta.index == 0
            ids.add(delta.id) if delta.id else None
            pieces.append(delta.function.arguments or "")
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and len(ids) == 1 and len(pieces) > 1
    jsonschema.validate(json.loads("".join(pieces)), WEATHER_PARAMS)
    assert usage.completion_tokens > 0


@pytest.mark.parametrize(("fields", "param"), [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": ["x"]}}]}, "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
])
def test_bad_tools_are_a_400_naming_the_field(client, alternating, fields, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=alternating.model, messages=ASK, max_tokens=5, **fields)
    assert info.value.body["param"] == param
    assert "Traceback" not in info.value.body["message"]
