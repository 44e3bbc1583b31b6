"""response_format through the official `openai` SDK against a real `pdserve serve` whose round_robin policy
alternates the remote path (prefill worker, then decode worker) and the local one: json_schema output
validates for 20 prompts on both paths, chat and completions, streamed and not; json_object parses;
a bad response_format is a 400 naming it; gRPC's sampling.response_format gives the same. Tool calling rides the same grammar path: tool_choice required and a
named function give tool_calls whose arguments validate against the tool's parameters, on both paths and
streamed, and a follow-up with the assistant's tool_calls and a tool message is answered; bad tools are a 400.
With logprobs, a call's tokens carry the model's log-softmax, whole and streamed; a call cut by max_tokens is
"length" without a call either way. gRPC's `n` (choices on both paths, each under its index) and `logit_bias`
through real stubs. The async SDK: n greedy choices and their logprobs equal the reference on both paths."""
from __future__ import annotations

import asyncio
import json
import urllib.request

import grpc
import jsonschema
import openai
import pytest
import torch

from protos.pdserve.v1 import pdserve_pb2 as pb
from protos.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from tests.e2e.conftest import chat_ids, greedy_ids, start_server, stop_server, text_of
from tests.e2e.test_openai_api import reference_logprobs
from tests.integration.test_structured_output import PERSON
from tests.integration.test_structured_output import PROMPTS as TWENTY_PROMPTS
from tests.integration.test_structured_output import SCHEMAS as TWENTY_SCHEMAS

pytestmark = pytest.mark.model

SCHEMA = PERSON  # the engine tests' schema: one that SmolLM2 completes
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
PROMPTS = ["Describe a person as JSON.", "Invent a character for a story.", "Tell me about a student in Paris.",
           "Describe an old sailor.", "Make up a user profile.", "Hi!"]


@pytest.fixture(scope="module")
def alternating(cost_model_file):
    # the grammar path, not the compiled step, loans or calibration: a server that starts without them
    srv = start_server(["--prefill", "1", "--decode", "1", "--policy", "round_robin", "--no-compile",
                        "--no-lend-threads", "--cost-model", cost_model_file])
    yield srv
    assert stop_server(srv.proc, log=srv.log) == 0, "".join(srv.log[-40:])


@pytest.fixture(scope="module")
def client(alternating):
    return openai.OpenAI(base_url=alternating.http + "/v1", api_key="unused", max_retries=0, timeout=120)


def path_of(resp) -> str:
    return resp.usage.model_extra["pdserve_timings"]["path"]


def test_json_schema_validates_on_both_paths(client, alternating):
    """The engine tests' 20 prompts and schemas through the SDK, greedy and sampled (in pairs, so that each
    goes down both paths: round_robin alternates them): each output parses and validates."""
    paths = set()
    for i, (prompt, schema) in enumerate(zip(TWENTY_PROMPTS, TWENTY_SCHEMAS, strict=True)):
        fmt = {"type": "json_schema", "json_schema": {"name": "record", "schema": schema, "strict": True}}
        temperature = (0, 0.7)[i // 2 % 2]
        resp = client.chat.completions.create(model=alternating.model, messages=[{"role": "user", "content": prompt}],
                                              max_tokens=150, temperature=temperature, seed=1, response_format=fmt)
        choice = resp.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), schema)
        paths.add((path_of(resp), temperature))
    assert paths == {(p, t) for p in ("remote", "local") for t in (0, 0.7)}


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


def token_ids_of(oracle, entries) -> list[int]:
    """The ids of logprobs entries, by their text: each token's text (its id decoded alone) names one id."""
    tokenizer = oracle[1]
    texts: dict[str, list[int]] = {}
    for i, text in enumerate(tokenizer.batch_decode([[i] for i in range(len(tokenizer))])):
        texts.setdefault(text, []).append(i)
    ids = [texts[e.token] for e in entries]
    assert all(len(c) == 1 for c in ids), [e.token for e, c in zip(entries, ids) if len(c) != 1]
    return [c[0] for c in ids]


def test_tool_call_logprobs_are_the_models_whole_and_streamed_on_both_paths(client, alternating, oracle):
    """logprobs with a named call, greedy: one entry per generated token (the first one's included, whichever
    path served it), the call's arguments text token by token, each the model's log-softmax; streamed equal."""
    kw = {"model": alternating.model, "messages": ASK, "tools": TOOLS, "tool_choice": NAMED, "max_tokens": 60,
          "temperature": 0, "logprobs": True, "top_logprobs": 2}
    prompt = json.loads(urllib_post(alternating, "/tokenize", {"messages": ASK, "tools": TOOLS,
                                                                "tool_choice": NAMED}))["tokens"]
    paths, contents = set(), []
    for _ in range(2):
        resp = client.chat.completions.create(**kw)
        choice = resp.choices[0]
        content = choice.logprobs.content
        assert choice.finish_reason == "tool_calls" and len(content) == resp.usage.completion_tokens
        arguments = choice.message.tool_calls[0].function.arguments
        assert "".join(e.token for e in content) in (arguments, arguments + oracle[1].eos_token)  # EOS: a token too
        ids = token_ids_of(oracle, content)
        ref = reference_logprobs(oracle, prompt, ids)
        for i, (entry, token_id) in enumerate(zip(content, ids)):
            assert abs(entry.logprob - float(ref[i, token_id])) < 1e-4
            assert abs(entry.top_logprobs[0].logprob - float(ref[i].max())) < 1e-4  # the raw likeliest
        paths.add(path_of(resp))
        contents.append([(e.token, e.logprob) for e in content])
    assert paths == {"remote", "local"}
    streamed = [e for c in client.chat.completions.create(stream=True, **kw) if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [t for t, _ in contents[0]]
    assert max(abs(e.logprob - lp) for e, (_, lp) in zip(streamed, contents[0])) < 1e-4


def test_a_required_call_cut_by_max_tokens_is_length_without_a_call_streamed_and_whole(client, alternating):
    """A call cut by max_tokens is no call: finish_reason "length", no tool_calls and no content, streamed
    as whole; its tokens are still counted and, asked for, their logprobs given."""
    kw = {"model": alternating.model, "messages": ASK, "tools": TOOLS, "tool_choice": "required",
          "parallel_tool_calls": False, "max_tokens": 6, "temperature": 0, "logprobs": True}
    whole = client.chat.completions.create(**kw)
    choice = whole.choices[0]
    assert choice.finish_reason == "length" and whole.usage.completion_tokens == 6
    assert choice.message.tool_calls is None and choice.message.content is None
    assert len(choice.logprobs.content) == 6
    finish, calls, text, tokens = None, [], "", []
    for chunk in client.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        calls += delta.tool_calls or []
        text += delta.content or ""
        tokens += chunk.choices[0].logprobs.content if chunk.choices[0].logprobs else []
        finish = chunk.choices[0].finish_reason or finish
    assert (finish, calls, text) == ("length", [], "")
    assert [t.token for t in tokens] == [t.token for t in choice.logprobs.content]


def biased_greedy_ids(oracle, prompt_ids: list[int], max_new_tokens: int, bias: dict[int, float]) -> list[int]:
    """transformers' greedy tokens with `bias` added to the logits at every step (the fp32 reference)."""
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = oracle[0](torch.tensor([ids])).logits[0, -1].float()
            for token, b in bias.items():
                logits[token] += b
            ids.append(int(logits.argmax()))
    return ids[len(prompt_ids):]


def test_grpc_n_choices_and_logit_bias_through_real_stubs(alternating, oracle):
    """gRPC `n`: greedy choices, each under its index, all equal transformers' greedy tokens, on both paths;
    seeded sampling is reproducible per index and its choices differ. `sampling.logit_bias`: the greedy
    tokens of the biased logits; an id beyond the vocabulary and n over 16 are INVALID_ARGUMENT naming them."""
    ids = oracle[1]("The capital of France is")["input_ids"]
    prompt = pb.TokenIds(ids=ids)
    with grpc.insecure_channel(alternating.grpc) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)

        def by_index(**kw) -> dict[int, list]:
            out: dict[int, list] = {}
            for r in stub.Generate(pb.GenerateRequest(token_ids=prompt, **kw), timeout=120):
                out.setdefault(r.index, []).append(r)
            return out

        greedy = by_index(n=3, sampling=pb.SamplingParams(max_tokens=8))
        want = greedy_ids(oracle, ids, 8)
        assert sorted(greedy) == [0, 1, 2]
        assert all([t for r in rs for t in r.token_ids] == want for rs in greedy.values())
        assert all(rs[-1].finish_reason and rs[-1].usage.completion_tokens == 8 for rs in greedy.values())
        assert {rs[-1].timings.path for rs in greedy.values()} == {"remote", "local"}
        seeded = [by_index(n=2, sampling=pb.SamplingParams(max_tokens=8, temperature=1.0, seed=11)) for _ in range(2)]
        tokens = [{i: [t for r in rs for t in r.token_ids] for i, rs in s.items()} for s in seeded]
        assert tokens[0] == tokens[1] and tokens[0][0] != tokens[0][1]
        bias = {want[0]: -100.0}
        bias.setdefault(want[2], 5.0)
        biased = by_index(sampling=pb.SamplingParams(max_tokens=6, logit_bias=bias))
        assert [t for r in biased[0] for t in r.token_ids] == biased_greedy_ids(oracle, ids, 6, bias)
        beyond = pb.SamplingParams(logit_bias={oracle[0].config.vocab_size: 1.0})
        for kw, field in (({"sampling": beyond}, "logit_bias"), ({"n": 17}, "n")):
            with pytest.raises(grpc.RpcError) as info:
                by_index(**kw)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert info.value.details().startswith(f"{field}:"), info.value.details()


def test_async_sdk_n_choices_and_logprobs_equal_the_reference_on_both_paths(alternating, oracle):
    """The async `openai` SDK, streamed and not: n=3 greedy chat choices (the round_robin policy sends them
    down both paths: a streamed choice's finishing chunk names its path) each equal transformers' greedy
    tokens, their logprobs the model's log-softmax (1e-4), the first token's included; n=3 seeded sampling
    is reproducible and its choices differ."""
    ask = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = chat_ids(oracle, ask)
    want = greedy_ids(oracle, prompt, 8)
    ref = reference_logprobs(oracle, prompt, want)
    texts = [oracle[1].decode([t]) for t in want]

    def assert_reference(content) -> None:
        assert [e.token for e in content] == texts
        assert max(abs(e.logprob - float(ref[i, t])) for i, (e, t) in enumerate(zip(content, want))) < 1e-4

    async def run() -> None:
        client = openai.AsyncOpenAI(base_url=alternating.http + "/v1", api_key="unused", max_retries=0, timeout=120)
        kw = {"model": alternating.model, "messages": ask, "max_tokens": 8, "temperature": 0, "n": 3,
              "logprobs": True, "top_logprobs": 1}
        resp = await client.chat.completions.create(**kw)
        assert [c.index for c in resp.choices] == [0, 1, 2]
        for choice in resp.choices:
            assert choice.message.content == text_of(oracle, want)
            assert_reference(choice.logprobs.content)
        parts: dict[int, list] = {0: [], 1: [], 2: []}
        paths = set()
        async for chunk in await client.chat.completions.create(stream=True, **kw):
            for choice in chunk.choices:
                parts[choice.index] += choice.logprobs.content if choice.logprobs else []
                if choice.finish_reason is not None:
                    paths.add(chunk.model_extra["pdserve_timings"]["path"])
        for content in parts.values():
            assert_reference(content)
        assert paths == {"remote", "local"}
        seeded = {"model": alternating.model, "messages": ask, "max_tokens": 12, "temperature": 1.0, "seed": 7,
                  "n": 3}
        first = [c.message.content for c in (await client.chat.completions.create(**seeded)).choices]
        again = [c.message.content for c in (await client.chat.completions.create(**seeded)).choices]
        assert first == again and len(set(first)) >= 2, first
        await client.close()

    asyncio.run(run())


def urllib_post(server, path: str, body: dict) -> bytes:
    request = urllib.request.Request(server.http + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as resp:
        return resp.read()
