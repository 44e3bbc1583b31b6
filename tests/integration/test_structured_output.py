"""Structured output (`SamplingParams.json_schema`, OpenAI's response_format) with the embedded SmolLM2:
in the engine, output under a schema parses and validates for 20 prompts, greedy and sampled, and ends on
its own once the JSON is complete; a request moved mid-way (its output at the end of its prompt) goes on
exactly as it would have; an aborted request drops its matcher. Through real workers (direct driver: a
prefill and a decode worker on Ray, as the router wires them): the prefill worker picks the first token
under the grammar, the decode worker the rest; remote output equals local output and validates."""
from __future__ import annotations

import json

import jsonschema
import pytest

from engine import CacheConfig, EngineConfig, LLMEngine, SamplingParams
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


def test_remote_output_equals_local_and_validates(ray_cluster, smol):
    """The prefill worker's first token is the grammar's (the model's own first token, unconstrained, is
    another), the decode worker's rest too: remote output == local output, and it validates."""
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
    finally:
        pools.shutdown()
