"""response_format through the official `openai` SDK against a real `pdserve serve` whose round_robin policy
alternates the remote path (prefill worker, then decode worker) and the local one: json_schema output
validates for several prompts on both paths, chat and completions, streamed and not; json_object parses;
a bad response_format is a 400 naming it."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

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
