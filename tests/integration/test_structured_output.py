"""Structured output (`SamplingParams.json_schema`, OpenAI's response_format) with the embedded SmolLM2:
in the engine, output under a schema parses and validates for 20 prompts, greedy and sampled, and ends on
its own once the JSON is complete; a request moved mid-way (its output at the end of its prompt) goes on
exactly as it would have; an aborted request drops its matcher. Through real workers (direct driver: a
prefill and a decode worker on Ray, as the router wires them): the prefill worker picks the first token
under the grammar, the decode worker the rest; remote output equals local output and validates. tool_choice
"auto" (`SamplingParams.structural_tag`): a request moved into a call writes a valid one, and the output
goes on past the call's JSON."""
from __future__ import annotations

import json
from dataclasses import replace

import jsonschema
import pytest

from engine import CacheConfig, EngineConfig, InvalidRequestError, LLMEngine, SamplingParams
from engine.model_loader import encode_prompt, load_model

pytestmark = pytest.mark.model

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 30},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "mood": {"enum": ["happy", "sad", "neutral"]},
    "student": {"type": "boolean"}},
    "required": ["name", "age", "mood", "student"], "additionalProperties": False}
CITY = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 24},
    "country": {"type": "string", "maxLength": 24},
    "capital": {"type": "boolean"},
    "rank": {"type": "integer", "minimum": 1, "maximum": 10}},
    "required": ["city", "capital", "rank"], "additionalProperties": False}
PROMPTS = ["Describe a person as JSON.", "Invent a character for a story.", "Who is your favourite teacher?",
           "Tell me about a student in Paris.", "Give me a JSON record of a happy child.", "Describe an old sailor.",
           "Make up a user profile.", "Describe yourself.", "A person who likes cats, as JSON.", "Hi!",
           "Tell me about Paris.", "Describe Tokyo.", "Which city is the capital of Italy?", "Rank Berlin.",
           "A small town in Spain, please.", "What do you know about Cairo?", "JSON for New York.",
           "Is Sydney a capital?", "Describe the biggest city in Brazil.", "Pick any city."]
SCHEMAS = [PERSON] * 10 + [CITY] * 10


@pytest.fixture(scope="module")
def smol():
    model, tok = load_model(None, "float32", "cpu")
    engine = LLMEngine(EngineConfig(dtype="float32", cache=CacheConfig(memory_gib=0.25)), model=model, tokenizer=tok)
    return tok, engine


def structured(schema: dict, **kw: object) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 120, **kw, "json_schema": json.dumps(schema)})


def assert_valid(text: str, schema: dict) -> dict:
    obj = json.loads(text)
    jsonschema.validate(obj, schema)
    return obj


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_twenty_prompts_give_json_that_validates_and_ends_on_its_own(smol, temperature):
    """All 20 in one batch (a matcher per row); each ends with EOS (finish_reason stop), well before
    max_tokens, once its JSON is complete."""
    tok, engine = smol
    params = [structured(s, temperature=temperature, seed=i) for i, s in enumerate(SCHEMAS)]
    outs = engine.generate(PROMPTS, params, chat=True)
    for out, schema in zip(outs, SCHEMAS):
        assert out.finish_reason == "stop" and out.output_token_ids[-1] == tok.eos_token_id, out.new_text
        assert len(out.output_token_ids) < 120
        assert_valid(out.new_text, schema)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_the_grammar_changes_what_the_model_would_say(smol):
    """Unconstrained, the model answers in prose; under json_object its first token already opens an object."""
    _, engine = smol
    plain = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=8), chat=True)[0].new_text
    assert not plain.lstrip().startswith("{")
    out = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=200, json_schema='{"type":"object"}'), chat=True)[0]
    assert out.new_text.startswith("{")
    if out.finish_reason == "stop":
        assert isinstance(json.loads(out.new_text), dict)


def test_a_moved_request_goes_on_as_it_would_have(smol):
    """A request moved after k tokens (its output appended to its prompt, `prior_output_tokens` = k) rebuilds
    its matcher from that output: it ends with the same tokens as the request that was not moved."""
    tok, engine = smol
    prompt = encode_prompt(tok, PROMPTS[3], chat=True)
    whole = engine.generate([prompt], structured(PERSON))[0].output_token_ids
    for k in (1, 5, len(whole) // 2):
        rest = engine.generate([prompt + whole[:k]], structured(PERSON, max_tokens=120 - k, prior_output_tokens=k))[0]
        assert whole[:k] + rest.output_token_ids == whole
        assert rest.finish_reason == "stop"


def test_an_aborted_request_drops_its_matcher(smol):
    _, engine = smol
    rid = engine.add_request(PROMPTS[0], structured(PERSON), chat=True)
    seq = engine.scheduler.find(rid)
    while seq.num_output_tokens < 3:
        engine.step()
    assert seq.grammar is not None
    engine.abort(rid)
    assert seq.grammar is None and seq.is_finished
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_bad_structural_tag_is_refused_when_added(smol):
    """A tag xgrammar cannot compile is an InvalidRequestError naming structural_tag at add_request, never
    a failure inside a step; nothing is left running."""
    _, engine = smol
    with pytest.raises(InvalidRequestError, match="^structural_tag: ") as e:
        engine.add_request(PROMPTS[0], SamplingParams(max_tokens=4, structural_tag='{"type":"no such format"}'),
                           chat=True)
    assert e.value.field == "structural_tag" and not engine.has_unfinished()


def test_remote_output_equals_local_and_validates(ray_cluster, smol):
    """The prefill worker's first token is the grammar's (the model's own first token, unconstrained, is
    another), the decode worker's rest too: remote output == local output, and it validates. So for "auto"'s
structural tag: both workers rebuild its matcher from the output so far, and the call validates."""
    from kv_transfer import TransferConfig
    from router.pools import create_pools
    from tests.integration.direct_driver import Orchestrator

    tok, _ = smol
    cfg = EngineConfig(model=None, dtype="float32", num_threads=1, cache=CacheConfig(memory_gib=0.1))
    pools = create_pools(1, 1, cfg, TransferConfig(backend="torch_dist", timeout_s=30, host="127.0.0.1"), num_cpus=0)
    try:
        orch = Orchestrator(pools)
        for i in (0, 4, 10, 16):
            prompt = encode_prompt(tok, PROMPTS[i], chat=True)
            plain = orch.generate(prompt, SamplingParams(max_tokens=1), remote=True).token_ids
            remote = orch.generate(prompt, structured(SCHEMAS[i]), remote=True)
            local = orch.generate(prompt, structured(SCHEMAS[i]), remote=False)
            assert remote.token_ids == local.token_ids and remote.finish_reason == local.finish_reason == "stop"
            assert remote.token_ids[0] != plain[0]  # the prefill worker applied the grammar to the first token
            assert_valid(tok.decode(remote.token_ids, skip_special_tokens=True), SCHEMAS[i])
        calling = auto_calling()  # "auto"'s structural tag, the output moved in just after "<tool_call>"
        prompt, sp = auto_params(tok, calling, True)
        remote, local = orch.generate(prompt, sp, remote=True), orch.generate(prompt, sp, remote=False)
        assert remote.token_ids == local.token_ids
        assert_call(calling, call_text("<tool_call>" + tok.decode(remote.token_ids, skip_special_tokens=True)))
    finally:
        pools.shutdown()


# ---------------------------------------------------------------- tool_choice "auto" (a structural tag)

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris right now? Call the tool."}]


def auto_calling():
    from router.tool_calls import ToolCalling, parse_tools
    tools = parse_tools([{"type": "function", "function": {"name": "get_weather", "description": "Current weather.",
                                                           "parameters": WEATHER}}])
    return ToolCalling(tools, "auto", None, False)


def auto_prompt(tok) -> list[int]:
    from router.tool_calls import chat_prompt
    messages, tools = chat_prompt(tok, ASK_WEATHER, auto_calling().tools)
    return encode_prompt(tok, messages, chat=True, tools=tools)


def assert_call(calling, text: str) -> None:
    """`text` (a finished output) holds a call of get_weather whose arguments validate."""
    out = calling.extract(text, "stop")
    assert out.finish_reason == "tool_calls", text
    (call,) = out.calls
    assert call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER)


def auto_params(tok, calling, started: bool, **kw: object) -> tuple[list[int], SamplingParams]:
    """The weather prompt and "auto"'s sampling; `started`: the output so far is "<tool_call>" (written
    before a move: the end of the prompt, `prior_output_tokens`), so the model is inside a call."""
    prompt, before = auto_prompt(tok), tok.encode("<tool_call>", add_special_tokens=False) if started else []
    return prompt + before, SamplingParams(**{"max_tokens": 80, **kw, "structural_tag": calling.structural_tag,
                                              "prior_output_tokens": len(before),
                                              "prior_output_chars": len("<tool_call>") if started else 0})


def call_text(text: str) -> str:
    """`text` up to the end of its first call (what follows it is free text)."""
    assert "</tool_call>" in text, text
    return text[:text.index("</tool_call>") + len("</tool_call>")]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_auto_calls_validate_and_free_text_goes_on(smol, temperature):
    """Under "auto"'s structural tag, a request inside a call (moved just after "<tool_call>": SmolLM2 rarely
    starts one on its own) gets a valid call for every seed, EOS masked until it closes; the output does not
    end with the call's JSON: the close tag follows, then the end or free text. Unconstrained, the same
    request does not write a valid call."""
    tok, engine = smol
    calling = auto_calling()
    prompts, params = [], []
    for seed in range(4):
        prompt, sp = auto_params(tok, calling, True, temperature=temperature, seed=seed)
        prompts.append(prompt)
        params.append(sp)
    for out in engine.generate(prompts, params):
        assert_call(calling, call_text("<tool_call>" + out.new_text))
    free = engine.generate([prompts[0]], replace(params[0], structural_tag=None))[0]
    with pytest.raises(AssertionError):
        assert_call(calling, call_text("<tool_call>" + free.new_text))
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
