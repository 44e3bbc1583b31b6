"""Tool calling (`router.tool_calls`, through `openai_protocol`): tools / tool_choice validation naming the
field, the output schema of "required" and named calls, the history in transformers' format, the prompt
for templates with and without tool support, and outputs turned into OpenAI's tool_calls, whole and streamed."""
from __future__ import annotations

import json

import jsonschema
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from engine import grammar
from engine.errors import InvalidRequestError
from engine.grammar import check_json_schema, check_structural_tag
from engine.logprobs import TokenLogprob
from engine.model_loader import encode_prompt
from router.limits import RequestLimits
from router.openai_protocol import LogprobsBuilder, ResponseBuilder, parse_chat_request, parse_tokenize_request
from router.tool_calls import MAX_TOOLS, ToolCalling, ToolStream, chat_prompt, fallback_messages, template_renders_tools
from router.types import Chunk, Usage

USER = [{"role": "user", "content": "Weather in Paris?"}]
PARAMS = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
          "required": ["city", "unit"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather now.", "parameters": PARAMS}}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters: OpenAI's empty object
TOOLS = [WEATHER, TIME]
HISTORY = [*USER, {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
    {"role": "tool", "tool_call_id": "call_a", "content": "22"}]
# a template that renders tools and tool calls, as tool-using models' templates do
TOOL_TEMPLATE = ("{% if tools %}[TOOLS]{% for t in tools %}{{ t.function.name }};{% endfor %}{% endif %}"
                 "{% for m in messages %}<{{ m.role }}>{% if m.tool_calls %}{% for c in m.tool_calls %}"
                 "CALL {{ c.function.name }} {{ c.function.arguments.city }}{% endfor %}{% else %}{{ m.content }}"
                 "{% endif %}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
PLAIN_TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"


def chat(**fields) -> dict:
    return {"messages": USER, "tools": TOOLS, **fields}


@pytest.mark.parametrize(("body", "field"), [
    (chat(tools={"type": "function"}), "tools"),
    (chat(tools=[{"type": "custom", "custom": {"name": "x"}}]), "tools"),
    (chat(tools=[{"type": "function"}]), "tools"),
    (chat(tools=[{"type": "function", "function": {"name": "bad name"}}]), "tools"),
    (chat(tools=[{"type": "function", "function": {"name": "f", "parameters": "{}"}}]), "tools"),
    (chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]), "tools"),
    (chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                                "properties": {"a": {"type": "foo"}}}}}]),
     "tools"),
    (chat(tools=[WEATHER, WEATHER]), "tools"),
    (chat(tools=[{"type": "function", "function": {"name": "f", "description": 3}}]), "tools"),
    (chat(tool_choice="sometimes"), "tool_choice"),
    (chat(tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
    (chat(tool_choice={"type": "function"}), "tool_choice"),
    ({"messages": USER, "tool_choice": "required"}, "tool_choice"),
    ({"messages": USER, "tools": [], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
     "tool_choice"),
    (chat(parallel_tool_calls="yes"), "parallel_tool_calls"),
    (chat(tool_choice="required", response_format={"type": "json_object"}), "response_format"),
    (chat(tool_choice="required", min_tokens=2), "tool_choice"),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f"}}]}]},
     "messages[0].tool_calls"),
    ({"messages": [*USER, {"role": "assistant", "tool_calls": [{"type": "function", "function": {
        "name": "f", "arguments": "not json"}}]}]}, "messages[1].tool_calls[0].function.arguments"),
    ({"messages": [*USER, {"role": "assistant", "tool_calls": [{"type": "function"}]}]},
     "messages[1].tool_calls[0].function"),
    ({"messages": [*USER, {"role": "tool", "content": "1", "tool_call_id": 5}]}, "messages[1].tool_call_id"),
])
def test_bad_tool_fields_are_refused_naming_the_field(body: dict, field: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        parse_chat_request(body)
    assert info.value.field == field


def test_no_tool_may_be_called_without_tools_or_with_none() -> None:
    for body in ({"messages": USER}, {"messages": USER, "tools": []}, chat(tool_choice="none"),
                 {"messages": USER, "tool_choice": "none"}):
        parsed = parse_chat_request(body)
        assert parsed.tools is None and parsed.request.tools == () and parsed.request.sampling.json_schema is None


def test_auto_is_the_default_and_constrains_only_the_tagged_calls() -> None:
    parsed = parse_chat_request(chat(min_tokens=2))  # free text around the calls: min_tokens is fine
    assert parsed.tools is not None and parsed.tools.choice == "auto" and parsed.tools.parallel
    assert [t.name for t in parsed.request.tools] == ["get_weather", "get_time"]
    sampling = parsed.request.sampling
    assert sampling.json_schema is None and sampling.structural_tag == parsed.tools.structural_tag
    tag = json.loads(sampling.structural_tag)["format"]
    assert tag["type"] == "triggered_tags" and tag["triggers"] == ["<tool_call>"] and not tag["stop_after_first"]
    (only,) = tag["tags"]
    assert only["begin"] == "<tool_call>" and only["end"] == "</tool_call>"
    call = json.loads(parse_chat_request(chat(tool_choice="required", parallel_tool_calls=False))
                      .request.sampling.json_schema)
    assert only["content"]["elements"][1]["json_schema"] == call  # one call, as "required" writes it
    single = json.loads(parse_chat_request(chat(parallel_tool_calls=False)).request.sampling.structural_tag)
    assert single["format"]["stop_after_first"]
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        assert parse_chat_request(chat(tool_choice=choice)).request.sampling.structural_tag is None


def test_a_named_function_constrains_the_output_to_its_parameters() -> None:
    parsed = parse_chat_request(chat(tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    assert json.loads(parsed.request.sampling.json_schema) == PARAMS


def test_required_output_is_one_call_of_a_listed_tool_or_a_list_when_parallel() -> None:
    one = json.loads(parse_chat_request(chat(tool_choice="required", parallel_tool_calls=False)).request.sampling.json_schema)
    jsonschema.validate({"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}, one)
    jsonschema.validate({"name": "get_time", "arguments": {}}, one)
    for wrong in ({"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "other", "arguments": {}},
                  [{"name": "get_time", "arguments": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, one)
    many = json.loads(parse_chat_request(chat(tool_choice="required")).request.sampling.json_schema)
    jsonschema.validate([{"name": "get_time", "arguments": {}}, {"name": "get_time", "arguments": {}}], many)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([], many)


def test_history_messages_take_transformers_format() -> None:
    messages = parse_chat_request({"messages": HISTORY, "tools": TOOLS}).request.messages
    assert messages[1] == {"role": "assistant", "tool_calls": [{"id": "call_a", "type": "function", "function": {
        "name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}}]}
    assert messages[2] == {"role": "tool", "content": "22", "tool_call_id": "call_a"}


@pytest.fixture
def tok() -> PreTrainedTokenizerFast:
    t = Tokenizer(models.BPE(unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    t.train_from_iterator(["<user> <assistant> <tool> <system> [TOOLS] CALL get_weather Paris 22 tool_call"] * 4,
                          trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<eos>"], show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=t, eos_token="<eos>", unk_token="<unk>")


def test_a_template_that_renders_tools_gets_them_as_transformers_documents(tok) -> None:
    tok.chat_template = TOOL_TEMPLATE
    request = parse_chat_request({"messages": HISTORY, "tools": TOOLS}).request
    assert template_renders_tools(tok)
    messages, tools = chat_prompt(tok, request.messages, request.tools)
    assert tools == TOOLS[:1] + [{"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {}}}}]
    text = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert text == "[TOOLS]get_weather;get_time;<user>Weather in Paris?<assistant>CALL get_weather Paris<tool>22<assistant>"
    assert encode_prompt(tok, messages, chat=True, tools=tools) == tok(text)["input_ids"]


def test_a_template_without_tools_gets_them_written_in_the_prompt(tok) -> None:
    tok.chat_template = PLAIN_TEMPLATE
    request = parse_chat_request({"messages": HISTORY, "tools": TOOLS}).request
    assert not template_renders_tools(tok)
    messages, tools = chat_prompt(tok, request.messages, request.tools)
    assert tools is None and messages == fallback_messages(request.messages, request.tools)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool"]
    assert '"name": "get_weather"' in messages[0]["content"] and "<tool_call>" in messages[0]["content"]
    assert messages[2]["content"] == ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}'
                                      '\n</tool_call>')
    assert messages[3]["content"] == "<tool_response>\n22\n</tool_response>"
    # the client's system message keeps its text, the tools follow it; no tools and no tool messages: as sent
    own = fallback_messages([{"role": "system", "content": "Be brief."}, *USER], request.tools)
    assert own[0]["content"].startswith("Be brief.\n\n") and len(own) == 2
    assert chat_prompt(tok, USER, ()) == (USER, None)


def test_tokenize_takes_tools_too(tok) -> None:
    assert [t.name for t in parse_tokenize_request({"messages": USER, "tools": TOOLS}).tools] == ["get_weather",
                                                                                                    "get_time"]


def calling(choice="auto", function=None, parallel=True) -> ToolCalling:
    return parse_chat_request(chat(tool_choice=choice if function is None else {
        "type": "function", "function": {"name": function}}, parallel_tool_calls=parallel)).tools


def test_outputs_become_tool_calls() -> None:
    named = calling(function="get_weather").extract('{"city": "Paris", "unit": "c"}', "stop")
    assert named.content is None and named.finish_reason == "tool_calls"
    assert [(c.name, json.loads(c.arguments)) for c in named.calls] == [("get_weather", {"city": "Paris", "unit": "c"})]
    two = calling("required").extract('[{"name": "get_time", "arguments": {}}, {"name": "get_time", "arguments": {}}]',
                                      "stop")
    assert [c.name for c in two.calls] == ["get_time", "get_time"] and two.calls[0].id != two.calls[1].id
    assert all(c.id.startswith("call_") and len(c.id) > 20 for c in two.calls)
    one = calling("required", parallel=False).extract('{"name": "get_time", "arguments": {}}', "stop")
    assert [(c.name, c.arguments) for c in one.calls] == [("get_time", "{}")]
    auto = calling().extract('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", '
                             '"unit": "f"}}\n</tool_call>', "stop")
    assert auto.content == "Let me look." and auto.finish_reason == "tool_calls"
    assert json.loads(auto.calls[0].arguments) == {"city": "Oslo", "unit": "f"}


@pytest.mark.parametrize(("text", "finish"), [
    ("It is sunny.", "stop"),  # auto: an answer in words
    ('<tool_call>{"name": "unknown", "arguments": {}}</tool_call>', "stop"),  # not a listed tool
    ("<tool_call>{not json</tool_call>", "stop"),
    ("It is sunny and", "length"),  # an answer in words, cut by max_tokens
    ("<tool_call>{not json</tool_call> and <tool_call>{", "length"),  # a closed block that does not parse
])
def test_outputs_without_a_valid_call_stay_content(text: str, finish: str) -> None:
    out = calling().extract(text, finish)
    assert (out.content, out.calls, out.finish_reason) == (text, (), finish)


CALL = '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "f"}}'


@pytest.mark.parametrize(("tool_calling", "pieces", "content", "names"), [
    (calling("required"), ['[{"name": "get_wea'], None, []),  # nothing complete: no call, no content
    (calling("required"), ["[" + CALL, ', {"name": "get_time", "argum'], None, ["get_weather"]),
    (calling("required", parallel=False), [CALL[:30]], None, []),
    (calling(), ["Let me look.", "\n<tool_call>\n" + CALL[:25]], "Let me look.", []),
    (calling(), ["Both.\n<tool_call>\n" + CALL, "\n</tool_call>\n", "<tool_call>\n" + CALL[:20]],
     "Both.", ["get_weather"]),
    (calling(), ["<tool_call>" + CALL + "</tool_call> and th"], "and th", ["get_weather"]),
])
def test_an_output_cut_inside_a_call_keeps_the_whole_calls_and_length(tool_calling, pieces, content, names) -> None:
    """Cut by max_tokens under "required" or "auto": finish_reason "length" (as OpenAI), the calls completed
    before the cut, never the cut one (its JSON is no valid call); streamed gives the same as whole."""
    whole = tool_calling.extract("".join(pieces), "length")
    assert whole.finish_reason == "length" and whole.content == content
    assert [c.name for c in whole.calls] == names
    assert all(json.loads(c.arguments) == {"city": "Oslo", "unit": "f"} for c in whole.calls)
    deltas, reason = feed_all(ToolStream(tool_calling), pieces, "length")
    assert reason == "length"
    assert "".join(d.get("content") or "" for d in deltas) == (content or "")
    streamed = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert [(c["index"], c["function"]["name"], c["function"]["arguments"]) for c in streamed] == \
        [(i, c.name, c.arguments) for i, c in enumerate(whole.calls)]


def feed_all(stream: ToolStream, pieces: list[str], finish: str) -> tuple[list[dict], str]:
    deltas = [d for p in pieces for d in stream.feed(p)]
    last, reason = stream.finish(finish)
    return deltas + last, reason


def test_streamed_named_arguments_come_as_they_are_written() -> None:
    deltas, reason = feed_all(ToolStream(calling(function="get_weather")), ['{"city": ', '"Paris", ', '"unit": "c"}'],
                              "stop")
    first = deltas[0]["tool_calls"][0]
    assert first["index"] == 0 and first["id"].startswith("call_") and first["type"] == "function"
    assert first["function"]["name"] == "get_weather"
    args = "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas)
    assert json.loads(args) == {"city": "Paris", "unit": "c"} and reason == "tool_calls"
    assert all("id" not in d["tool_calls"][0] for d in deltas[1:])


def test_streamed_auto_sends_text_until_a_tag_may_begin() -> None:
    stream = ToolStream(calling())
    assert stream.feed("Sure, ") == [{"content": "Sure,"}]  # blanks wait: a call after them drops them
    assert stream.feed("checking <tool") == [{"content": " checking"}]  # "<tool" may begin a tag: held
    deltas, reason = feed_all(stream, ['_call>{"name": "get_time", ', '"arguments": {}}</tool_call>'], "stop")
    assert reason == "tool_calls" and len(deltas) == 1
    call = deltas[0]["tool_calls"][0]
    assert call["index"] == 0 and call["function"] == {"name": "get_time", "arguments": "{}"}
    words, reason = feed_all(ToolStream(calling()), ["a <to", "y> b"], "stop")  # not a tag after all
    assert "".join(d["content"] for d in words) == "a <toy> b" and reason == "stop"


def test_streamed_required_calls_come_whole_at_the_end() -> None:
    stream = ToolStream(calling("required"))
    assert stream.feed('[{"name": "get_time", ') == []
    deltas, reason = feed_all(stream, ['"arguments": {}}]'], "stop")
    assert reason == "tool_calls" and [d["tool_calls"][0]["function"]["name"] for d in deltas] == ["get_time"]


def test_response_bodies_carry_tool_calls_in_openai_shape() -> None:
    builder = ResponseBuilder(chat=True, request_id="r1", model="m", created=1, tools=calling("required"))
    body = builder.full('[{"name": "get_weather", "arguments": {"city": "Rome", "unit": "c"}}]', "stop",
                        Usage(10, 7), None)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Rome", "unit": "c"}
    assert body["usage"]["completion_tokens"] == 7
    # streamed: each choice's builder has a stream of its own
    b0, b1 = builder.for_choice(0), builder.for_choice(1)
    assert b0.chunk_events(Chunk('[{"name": "get_time", ', [5]), None, None) == []
    events = b1.chunk_events(Chunk('[{"name": "get_time", "arguments": {}}]', [6], "stop"), "stop", None)
    assert [e["choices"][0]["index"] for e in events] == [1, 1]
    assert events[0]["choices"][0]["delta"]["tool_calls"][0]["function"]["name"] == "get_time"
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_tool_calls_and_tools_count_against_the_prompt_limit() -> None:
    limits = RequestLimits(max_prompt_chars=200)
    parse_chat_request({"messages": HISTORY, "tools": [TIME]}, limits=limits)
    long_call = [*USER, {"role": "assistant", "tool_calls": [{"type": "function", "function": {
        "name": "get_time", "arguments": json.dumps({"city": "x" * 300})}}]}]
    for body in ({"messages": long_call}, {"messages": USER, "tools": [
            {"type": "function", "function": {"name": "f", "description": "d" * 300}}]}):
        with pytest.raises(InvalidRequestError) as info:
            parse_chat_request(body, limits=limits)
        assert info.value.field == "messages"


# ---------------------------------------------------------------- review fixes


def numbered_tools(n: int) -> list[dict]:
    return [{"type": "function", "function": {"name": f"f{i}"}} for i in range(n)]


def test_at_most_128_tools_are_taken_and_names_are_checked_in_one_pass() -> None:
    assert len(parse_chat_request(chat(tools=numbered_tools(MAX_TOOLS))).request.tools) == MAX_TOOLS == 128
    for tools in (numbered_tools(MAX_TOOLS + 1), [None] * 20_000):  # refused before each tool is parsed
        with pytest.raises(InvalidRequestError) as info:
            parse_chat_request(chat(tools=tools))
        assert info.value.field == "tools" and "at most 128" in info.value.message
    with pytest.raises(InvalidRequestError) as info:
        parse_chat_request(chat(tools=[*numbered_tools(MAX_TOOLS - 1), numbered_tools(1)[0]]))
    assert info.value.field == "tools" and "'f0' twice" in info.value.message


# as openai.pydantic_function_tool writes nested models: $defs at the root, "#/$defs/..." references
SEND = {"$defs": {"Address": {"properties": {"city": {"type": "string"}, "zip": {"$ref": "#/$defs/Zip"}},
                              "required": ["city", "zip"], "title": "Address", "type": "object",
                              "additionalProperties": False},
                  "Zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
        "properties": {"to": {"$ref": "#/$defs/Address"},
                       "cc": {"anyOf": [{"$ref": "#/$defs/Address"}, {"type": "null"}]}},
        "required": ["to", "cc"], "title": "Send", "type": "object", "additionalProperties": False}
# another tool whose own "Address" differs (older drafts' "definitions"), and a reference to its own root
ROUTE = {"definitions": {"Address": {"type": "object", "properties": {"stop": {"type": "integer"}},
                                     "required": ["stop"], "additionalProperties": False}},
         "type": "object", "properties": {"at": {"$ref": "#/definitions/Address"},
                                          "next": {"anyOf": [{"type": "null"}, {"$ref": "#"}]}},
         "required": ["at", "next"], "additionalProperties": False}
REF_TOOLS = [{"type": "function", "function": {"name": "send", "parameters": SEND}},
             {"type": "function", "function": {"name": "route", "parameters": ROUTE}}]


@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize("tools", [REF_TOOLS, REF_TOOLS[:1]])
def test_required_keeps_each_tools_references(tools: list[dict], parallel: bool) -> None:
    schema = json.loads(parse_chat_request(chat(tools=tools, tool_choice="required", parallel_tool_calls=parallel))
                        .request.sampling.json_schema)
    send = {"name": "send", "arguments": {"to": {"city": "Oslo", "zip": "01234"}, "cc": None}}
    route = {"name": "route", "arguments": {"at": {"stop": 1}, "next": {"at": {"stop": 2}, "next": None}}}
    good = [send, route] if len(tools) == 2 else [send]
    for call in good:
        jsonschema.validate([call] if parallel else call, schema)
    bad_zip = {"name": "send", "arguments": {"to": {"city": "Oslo", "zip": "x"}, "cc": None}}
    bad_route = {"name": "route", "arguments": {"at": {"stop": 1}, "next": {"at": {"city": "x"}, "next": None}}}
    for call in [bad_zip, bad_route] if len(tools) == 2 else [bad_zip]:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate([call] if parallel else call, schema)
    check_json_schema(json.dumps(schema))  # the grammar library compiles it too


@pytest.mark.parametrize("parallel", [True, False])
def test_autos_call_grammar_keeps_each_tools_references(parallel: bool) -> None:
    """"auto"'s tag holds one call's schema ($defs hoisted to its root, refs rewritten), whichever
    parallel_tool_calls: each tag is one call."""
    tag = parse_chat_request(chat(tools=REF_TOOLS, parallel_tool_calls=parallel)).request.sampling.structural_tag
    schema = json.loads(tag)["format"]["tags"][0]["content"]["elements"][1]["json_schema"]
    jsonschema.validate({"name": "send", "arguments": {"to": {"city": "Oslo", "zip": "01234"}, "cc": None}}, schema)
    jsonschema.validate({"name": "route", "arguments": {"at": {"stop": 1}, "next": None}}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "route", "arguments": {"at": {"city": "x"}, "next": None}}, schema)
    check_structural_tag(tag)  # the grammar library compiles it too


def test_a_forced_call_is_always_a_call_whole_and_streamed() -> None:
    named = calling(function="get_weather")
    for pieces, finish in (([' {"city": ', '"Paris", "unit": "c"} '], "stop"), (['{"city": ', '"Par'], "length")):
        whole = named.extract("".join(pieces), finish)
        deltas, reason = feed_all(ToolStream(named), pieces, finish)
        streamed = "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas)
        assert whole.content is None and whole.finish_reason == reason == ("tool_calls" if finish == "stop" else finish)
        assert [(c.name, c.arguments) for c in whole.calls] == [("get_weather", streamed)]
        assert streamed == "".join(pieces)  # as written, blanks too


def test_parameters_without_a_type_are_an_object() -> None:
    body = chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
                tool_choice={"type": "function", "function": {"name": "f"}})
    schema = json.loads(parse_chat_request(body).request.sampling.json_schema)
    jsonschema.validate({}, schema)
    for wrong in ("abc", [1], 3):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, schema)
    with pytest.raises(InvalidRequestError) as info:
        parse_chat_request(chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {
            "type": ["object", "null"]}}}]))
    assert info.value.field == "tools"


def test_arguments_are_the_models_own_json_text() -> None:
    surrogate = '{"city": "\\ud83d", "unit": "c"}'  # an escape the grammar allows: a lone surrogate once decoded
    big = '{"city": "x", "unit": 1e400}'  # json.loads: inf, which json.dumps writes as Infinity (no JSON)
    twice = '{"city": "a", "city": "b"}'  # json.loads keeps one
    for arguments in (surrogate, big, twice, '{ "city" : "Rome" }'):
        for c, text in (("required", f'[{{"name": "get_weather", "arguments": {arguments}}}]'),
                        ("auto", f'<tool_call>{{"name": "get_weather", "arguments": {arguments}}}</tool_call>')):
            out = calling(c).extract(text, "stop")
            assert [call.arguments for call in out.calls] == [arguments]
            deltas, _ = feed_all(ToolStream(calling(c)), [text], "stop")
            assert deltas[0]["tool_calls"][0]["function"]["arguments"] == arguments
            json.dumps(deltas, ensure_ascii=False).encode()  # as the stream writes them: no UnicodeEncodeError
    # arguments written as a JSON string: its text, a decoded lone surrogate escaped back
    out = calling("required").extract('[{"name": "get_weather", "arguments": "{\\"city\\": \\"\\ud83d\\"}"}]', "stop")
    assert out.calls[0].arguments == '{"city": "\\ud83d"}'
    for text in ('[{"name": "get_weather", "arguments": {"n": NaN}}]', '[{"name": "get_time"}] x', '[1]', '[]'):
        assert calling("required").extract(text, "stop").calls == ()


def test_named_templates_are_probed_as_transformers_picks_them(tok) -> None:
    tok.chat_template = {"default": PLAIN_TEMPLATE, "tool_use": TOOL_TEMPLATE}
    assert template_renders_tools(tok)
    request = parse_chat_request({"messages": USER, "tools": TOOLS}).request
    messages, tools = chat_prompt(tok, request.messages, request.tools)
    assert encode_prompt(tok, messages, chat=True, tools=tools) == tok("[TOOLS]get_weather;get_time;<user>Weather "
                                                                        "in Paris?<assistant>")["input_ids"]
    tok.chat_template = {"default": PLAIN_TEMPLATE}
    assert not template_renders_tools(tok)


def test_the_worker_grammar_cache_is_bounded(tok, monkeypatch) -> None:
    made = []

    class Compiler:
        def __init__(self, info, **options) -> None:
            made.append(options)

        def compile_json_schema(self, schema, **options):
            return schema

    monkeypatch.setattr(grammar.xgrammar, "GrammarCompiler", Compiler)
    grammar.Grammars(tok, len(tok), frozenset({tok.eos_token_id})).compile(grammar.JSON_OBJECT_SCHEMA)
    assert made == [{"max_threads": 1, "cache_limit_bytes": grammar.GRAMMAR_CACHE_BYTES}]
    assert 0 < grammar.GRAMMAR_CACHE_BYTES <= 1 << 30


def test_history_calls_count_as_written_and_their_names_are_checked() -> None:
    limits = RequestLimits(max_prompt_chars=200)

    def history(arguments="{}", name="get_time", call_id="call_a", result_id="call_a") -> dict:
        call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
        return {"messages": [*USER, {"role": "assistant", "tool_calls": [call]},
                             {"role": "tool", "tool_call_id": result_id, "content": "1"}]}

    parse_chat_request(history(json.dumps({"city": "é" * 150}, ensure_ascii=False)), limits=limits)  # 150, not 900
    for body in (history(call_id="c" * 200), history(result_id="c" * 200), history(name="g" * 64, call_id="c" * 120)):
        with pytest.raises(InvalidRequestError) as info:
            parse_chat_request(body, limits=limits)
        assert info.value.field == "messages"
    with pytest.raises(InvalidRequestError) as info:
        parse_chat_request(history(name="bad name"))
    assert info.value.field == "messages[1].tool_calls[0].function.name"


LONE = "\ud83d"  # what JSON's "\\ud83d" decodes to


@pytest.mark.parametrize(("body", "field"), [
    (chat(tools=[{"type": "function", "function": {"name": "f", "description": "a" + LONE}}]), "tools"),
    (chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "description": LONE}}}}}]), "tools"),
    ({"messages": [*USER, {"role": "assistant", "tool_calls": [{"type": "function", "function": {
        "name": "f", "arguments": '{"a": "' + LONE + '"}'}}]}]}, "messages[1].tool_calls[0].function.arguments"),
    ({"messages": [*USER, {"role": "assistant", "tool_calls": [{"type": "function", "function": {
        "name": "f", "arguments": '{"a": "\\ud83d"}'}}]}]}, "messages[1].tool_calls[0].function.arguments"),
    ({"messages": [*USER, {"role": "assistant", "tool_calls": [{"id": LONE, "type": "function", "function": {
        "name": "f", "arguments": "{}"}}]}]}, "messages[1].tool_calls[0].id"),
    ({"messages": [*USER, {"role": "tool", "content": "1", "tool_call_id": LONE}]}, "messages[1].tool_call_id"),
])
def test_tool_text_must_be_valid_unicode(body: dict, field: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        parse_chat_request(body)
    assert info.value.field == field and "unpaired surrogate" in info.value.message


def test_tokenize_shows_no_tools_with_tool_choice_none() -> None:
    assert parse_tokenize_request({"messages": USER, "tools": TOOLS, "tool_choice": "none"}).tools == ()


@pytest.mark.parametrize(("choice", "pieces"), [
    ("required", ['[{"name": "get_time", ', '"arguments": {}}]']),
    ({"type": "function", "function": {"name": "get_weather"}}, ['{"city": ', '"Paris", ', '"unit": "c"}']),
    ("auto", ["Sure. ", "<tool_call>", '{"name": "get_time", "arguments": {}}', "</tool_call>"]),
])
def test_logprobs_with_tools_cover_every_token_whole_and_streamed(choice, pieces) -> None:
    """logprobs with tool calling: one entry per generated token, content and call tokens alike, in
    `choices[].logprobs.content`; streamed, each chunk's entries come once, also while its text is held."""
    parsed = parse_chat_request(chat(tool_choice=choice, logprobs=True, top_logprobs=1))
    assert parsed.request.sampling.logprobs == 1 and parsed.tools is not None
    entries = [(TokenLogprob(10 + i, -0.5 - i, (3,), (-0.1,)),) for i in range(len(pieces))]
    chunks = [Chunk(p, [10 + i], "stop" if i == len(pieces) - 1 else None, logprobs=e)
              for i, (p, e) in enumerate(zip(pieces, entries))]
    builder = ResponseBuilder(chat=True, request_id="r1", model="m", created=1, tools=parsed.tools,
                              logprobs=LogprobsBuilder(True, lambda t: f"<{t}>"))
    whole = builder.full("".join(pieces), "stop", Usage(5, len(pieces)), None, [e for es in entries for e in es])
    content = whole["choices"][0]["logprobs"]["content"]
    assert [(c["token"], c["logprob"]) for c in content] == [(f"<{10 + i}>", -0.5 - i) for i in range(len(pieces))]
    assert all(c["top_logprobs"] == [{"token": "<3>", "logprob": -0.1, "bytes": list(b"<3>")}] for c in content)
    assert whole["choices"][0]["message"]["tool_calls"] and whole["choices"][0]["finish_reason"] == "tool_calls"
    stream = builder.for_choice(0)
    events = [e for c in chunks for e in stream.chunk_events(c, c.finish_reason, None)]
    streamed = [c for e in events if e["choices"][0]["logprobs"] for c in e["choices"][0]["logprobs"]["content"]]
    assert streamed == content
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    calls = [d for e in events for d in e["choices"][0]["delta"].get("tool_calls", [])]
    assert calls and calls[0]["function"]["name"] in ("get_time", "get_weather")
    if choice == "required":  # held until the end: the chunks before it come as empty deltas with their tokens
        assert events[0]["choices"][0]["delta"] == {} and events[0]["choices"][0]["logprobs"]["content"]


@pytest.mark.parametrize("text", [
    "Let me look.\n<tool_call>\n" + CALL + "\n</tool_call>",
    " A\n\n<tool_call>" + CALL + "</tool_call>\n then \n<tool_call>" + CALL + "</tool_call>\nB \n",
    "<tool_call>" + CALL + "</tool_call>\n\nDone.",
    "No call, just words. \n",
    "Cut: <tool_call>" + CALL + "</tool_call> and <tool_call>{\"name\": \"get_we",
])
@pytest.mark.parametrize("finish", ["stop", "length"])
def test_auto_streamed_equals_whole_however_the_output_is_chunked(text: str, finish: str) -> None:
    """Content, calls and finish reason of an "auto" output are the same streamed as whole, wherever the
    chunks split it (blanks next to a call are dropped from the content both ways)."""
    tool_calling = calling()
    whole = tool_calling.extract(text, finish)
    for cut in range(len(text) + 1):
        for pieces in ([text[:cut], text[cut:]], [text[:cut // 2], text[cut // 2:cut], text[cut:]]):
            deltas, reason = feed_all(ToolStream(tool_calling), pieces, finish)
            assert reason == whole.finish_reason
            assert "".join(d.get("content") or "" for d in deltas) == (whole.content or ""), pieces
            streamed = [d["tool_calls"][0]["function"] for d in deltas if "tool_calls" in d]
            assert [(f["name"], f["arguments"]) for f in streamed] == [(c.name, c.arguments) for c in whole.calls]
