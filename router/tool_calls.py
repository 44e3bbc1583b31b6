"""Tool calling on /v1/chat/completions: `tools` and `tool_choice` in, `tool_calls` out. Pure, no I/O.

Request lifecycle:
1. Parsing (`parse_tool_calling`, called by `openai_protocol.parse_chat_request`): `tools` (type
   "function" with a name, an optional description and a `parameters` JSON Schema of type object),
   `tool_choice` ("none" | "auto" | "required" | {"type": "function", "function": {"name"}}) and
   `parallel_tool_calls` become a `ToolCalling` (None when no tool may be called: no tools, or
   tool_choice "none"). At most `MAX_TOOLS` tools, counted before any is parsed; a parameters schema
   without a type is an object's; each is compiled (`engine.grammar.check_json_schema`), and so is the
   combined schema of "required" and the structural tag of "auto" (`check_structural_tag`). Anything malformed, or text with an unpaired surrogate, is an
   InvalidRequestError naming `tools`, `tool_choice` or `parallel_tool_calls`. The chat history may hold
   assistant messages with `tool_calls` and `tool` messages (`history_message` keeps them in transformers'
   format: arguments as a dict; names, ids and text checked as the request's own).
2. Prompt (`router.admission` → `chat_prompt`): the tools and the history go to the chat template as
   transformers' `apply_chat_template(messages, tools=...)` documents it when the model's template
   renders tools (`template_renders_tools`: a probe renders one conversation with and without a tool).
   Otherwise (SmolLM2's template ignores them) pdserve writes them itself (`fallback_messages`): a
   system text listing the tools and teaching the Hermes format `<tool_call>{"name", "arguments"}</tool_call>`,
   earlier calls written in that format, tool results in `<tool_response>` tags.
3. Generation: "required" and a named function constrain the output through the structured-output
   path (`ToolCalling.json_schema` → `SamplingParams.json_schema`, masked by xgrammar on the prefill and
   the decode worker): a named function's output is its arguments object; "required" writes
   {"name": one of the tools, "arguments": that tool's parameters} (a list of them, at least one, when
   parallel_tool_calls is true; each tool's $defs hoisted to the root under its own names). "auto"
   is constrained too (`ToolCalling.structural_tag` → `SamplingParams.structural_tag`, an xgrammar
   structural tag): the model writes free text (or ends) as it likes, but once it writes `<tool_call>`
   it must write one call as "required" does (a listed tool's name and its arguments, blanks bounded),
   then `</tool_call>`; then free text again (with parallel_tool_calls false: only the end). Its output
   is parsed for the tagged calls, which are then always well formed (unless cut by max_tokens or a stop).
4. Response (`ToolCalling.extract` whole, `ToolStream` streamed; both give the same): the output becomes
   `ToolCall`s with ids "call_<random>", finish_reason "tool_calls", their arguments the model's own JSON
   text (checked to parse, never re-serialised). A named function's output is always its call (cut by
   max_tokens: partial, finish_reason "length"). A "required" or "auto" output cut by max_tokens has
   finish_reason "length" and the calls it completed; the call it was writing is no call and is left
   out ("auto": the text outside the calls is the content). Other output that does not parse (an "auto"
   answer in words) is the message's content, with the generation's own finish_reason.
"""
from __future__ import annotations

import functools
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from engine.chat_template import PROBE_MESSAGES
from engine.errors import InvalidRequestError
from router.json_fields import json_type, valid_unicode

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESULT_OPEN, RESULT_CLOSE = "<tool_response>", "</tool_response>"
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
_TAGGED = re.compile(re.escape(CALL_OPEN) + r"(.*?)(?:" + re.escape(CALL_CLOSE) + r"|\Z)", re.DOTALL)
_EMPTY_PARAMETERS = '{"type":"object","properties":{}}'  # a function without parameters (OpenAI's default)
MAX_TOOLS = 128  # tools per request (OpenAI's limit)
_TAG_WHITESPACE = 1  # "auto": blanks in a row a call's JSON may hold (a small model cannot wander off)
_DEFS = ("$defs", "definitions")  # where a schema keeps its named subschemas
_DATA_KEYWORDS = ("const", "enum", "default", "examples")  # their values are data, not schemas
_DECODER = json.JSONDecoder(parse_constant=lambda name: _refuse_constant(name))  # no NaN / Infinity
_WS = re.compile(r"[ \t\n\r]*")
_PROBE_TOOL = {"type": "function", "function": {"name": "pdserve_probe", "description": "A probe.",
                                                 "parameters": {"type": "object", "properties": {}}}}
_RENDERS_TOOLS: dict[str, bool] = {}  # template (its text; named templates as sorted JSON) → renders `tools`
FALLBACK_INSTRUCTIONS = (
    "You may call functions to answer. They are listed inside <tools></tools>, one JSON object a line:\n"
    "<tools>\n{tools}\n</tools>\n"
    "To call a function, answer with a JSON object holding its name and its arguments inside "
    "<tool_call></tool_call> tags, like this:\n"
    "<tool_call>\n{{\"name\": \"<function name>\", \"arguments\": {{<arguments as a JSON object>}}}}\n</tool_call>")


@dataclass(frozen=True)
class Tool:
    """One function the model may call: its name, description and parameters (compact JSON Schema text)."""

    name: str
    description: str | None
    parameters: str

    def template_dict(self) -> dict:
        """The tool as transformers' `apply_chat_template(tools=...)` takes it (OpenAI's shape)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = json.loads(self.parameters)
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolCall:
    """One call in a response: its id ("call_" + random), the function's name and its arguments (JSON text)."""

    id: str
    name: str
    arguments: str

    def body(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolOutput:
    """A choice's message: content (None when empty) and tool calls, and its OpenAI finish reason."""

    content: str | None
    calls: tuple[ToolCall, ...]
    finish_reason: str


@dataclass(frozen=True)
class ToolCalling:
    """How a request may call tools.

    Args:
        tools: the functions, in the client's order (names unique).
        choice: "auto" (the model decides), "required" (at least one call) or "function" (`function` is called).
        function: the named function's name when choice is "function".
        parallel: several calls may come in one answer (OpenAI's parallel_tool_calls, default true).
    """

    tools: tuple[Tool, ...]
    choice: str = "auto"
    function: str | None = None
    parallel: bool = True

    @functools.cached_property
    def json_schema(self) -> str | None:
        """The output's JSON Schema (`SamplingParams.json_schema`): None for "auto" (`structural_tag`).

        "required" nests each tool's parameters in one schema, at `_arguments_pointer`; their named
        subschemas (`$defs`, `definitions`) move to the root's `$defs` as "<tool name>.<name>" (a tool
        name has no "."), and their local `$ref`s are rewritten to where they now point."""
        if self.choice == "function":
            return self._tool(self.function).parameters
        if self.choice != "required":
            return None
        return json.dumps(self._call_schema(self.parallel), separators=(",", ":"), ensure_ascii=False)

    @functools.cached_property
    def structural_tag(self) -> str | None:
        """"auto"'s grammar (`SamplingParams.structural_tag`, an xgrammar structural tag): free text until
        `CALL_OPEN`, then one call as "required" writes it without parallel_tool_calls (the same schema:
        a listed tool's name and its parameters), an optional newline either side, `CALL_CLOSE`, then
        free text again (with parallel_tool_calls false: nothing but the end). None for other choices."""
        if self.choice != "auto":
            return None
        call = {"type": "json_schema", "json_schema": self._call_schema(False),
                "max_whitespace_cnt": _TAG_WHITESPACE}
        newline = {"type": "regex", "pattern": "\\n?"}
        tag = {"type": "tag", "begin": CALL_OPEN, "content": {"type": "sequence", "elements": [newline, call, newline]},
               "end": CALL_CLOSE}
        text = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": [CALL_OPEN], "tags": [tag],
                                                     "stop_after_first": not self.parallel}}
        return json.dumps(text, separators=(",", ":"), ensure_ascii=False)

    def _call_schema(self, array: bool) -> dict[str, Any]:
        """The schema of a call of one of the tools ({"name", "arguments"}), or of a list of them
        (at least one) with `array`; each tool's named subschemas hoisted to the root."""
        defs: dict[str, Any] = {}
        calls = []
        for i, t in enumerate(self.tools):
            parameters = json.loads(t.parameters)
            own = {}
            for key in _DEFS:
                if isinstance(parameters.get(key), dict):
                    own.update(parameters.pop(key))
            base = self._arguments_pointer(i, array)
            defs.update((f"{t.name}.{name}", _rewrite_refs(sub, t.name, base)) for name, sub in own.items())
            calls.append({"type": "object", "properties": {"name": {"const": t.name},
                                                           "arguments": _rewrite_refs(parameters, t.name, base)},
                          "required": ["name", "arguments"], "additionalProperties": False})
        one = calls[0] if len(calls) == 1 else {"anyOf": calls}
        schema = {"type": "array", "items": one, "minItems": 1} if array else one
        if defs:
            schema["$defs"] = defs
        return schema

    def _arguments_pointer(self, i: int, array: bool) -> str:
        """The JSON pointer of tool i's parameters in the call schema (`array`: a list of calls)."""
        return ("#/items" if array else "#") + \
            (f"/anyOf/{i}" if len(self.tools) > 1 else "") + "/properties/arguments"

    def extract(self, text: str, finish_reason: str) -> ToolOutput:
        """The message of a finished output `text` (finish_reason: the generation's, OpenAI's words).
        A named function's output is always its call, its arguments the text as written (cut short by
        max_tokens: partial, with finish_reason "length", as OpenAI and `ToolStream` give it). A
        "required" or "auto" output cut by max_tokens keeps finish_reason "length" and the calls it
        completed (`_cut`); the call it was writing is no call (its JSON is cut) and is left out."""
        if self.choice == "function" and text:
            return ToolOutput(None, (new_call(self.function or "", text),),
                              "tool_calls" if finish_reason == "stop" else finish_reason)
        if finish_reason == "length" and self.choice != "function":
            return self._cut(text)
        if finish_reason != "stop":
            return ToolOutput(text or None, (), finish_reason)
        calls = self._calls(text)
        if calls is None:
            return ToolOutput(text or None, (), finish_reason)
        return ToolOutput(_outside(text) if self.choice == "auto" else None, calls, "tool_calls")

    def _cut(self, text: str) -> ToolOutput:
        """An output cut by max_tokens ("required" or "auto"): finish_reason "length", the calls written
        whole before the cut, never the one cut short. "required": the calls of the list (or the one
        call) that were complete, no content. "auto": the closed <tool_call> blocks are the calls, the
        text outside every block (the cut one too) the content; an output without a tag, or with a
        closed block that does not parse, is content as written."""
        if self.choice == "required":
            items = _json_objects(text, self.parallel, prefix=True) or []
            calls = [self._call(item) for item in items]
            return ToolOutput(None, tuple(calls) if all(calls) else (), "length")  # type: ignore[arg-type]
        blocks = list(_TAGGED.finditer(text))
        closed = [_json_objects(m.group(1), False) for m in blocks if m.group(0).endswith(CALL_CLOSE)]
        items = [item for b in closed for item in b or ()]
        calls = [self._call(item) for item in items]
        if not blocks or any(b is None for b in closed) or not all(calls):
            return ToolOutput(text or None, (), "length")
        calls = calls[:1] if not self.parallel else calls
        return ToolOutput(_outside(text), tuple(calls), "length")  # type: ignore[arg-type]

    def _calls(self, text: str) -> tuple[ToolCall, ...] | None:
        """The calls `text` holds, or None when it holds none that parse (all of them must)."""
        if self.choice == "function":  # an empty output: no call
            return None
        if self.choice == "required":
            items = _json_objects(text, True)
        else:
            blocks = [_json_objects(m.group(1), False) for m in _TAGGED.finditer(text)]
            items = None if any(b is None for b in blocks) else [item for b in blocks for item in b]  # type: ignore
        if items is None:
            return None
        calls = [self._call(item) for item in items]
        if not calls or any(c is None for c in calls):
            return None
        return tuple(calls[:1] if not self.parallel else calls)  # type: ignore[arg-type]

    def _call(self, item: dict[str, tuple[Any, str]]) -> ToolCall | None:
        """A call object's members (value, JSON text) → the call, its arguments the model's own JSON text."""
        name = item.get("name", (None, ""))[0]
        if not isinstance(name, str) or not any(t.name == name for t in self.tools):
            return None
        arguments, text = item.get("arguments", ({}, "{}"))
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            arguments, text = _json_object(arguments), _escape_surrogates(arguments)
        if not isinstance(arguments, dict):
            return None
        return new_call(name, text)

    def _tool(self, name: str | None) -> Tool:
        return next(t for t in self.tools if t.name == name)


def new_call(name: str, arguments: str) -> ToolCall:
    return ToolCall("call_" + uuid.uuid4().hex[:24], name, arguments)


# ---------------------------------------------------------------- parsing


def parse_tools(value: Any) -> tuple[Tool, ...]:
    """`tools`: null or a list of {"type": "function", "function": {name, description, parameters, strict}}."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise InvalidRequestError("tools", f"must be a list of {{\"type\": \"function\", \"function\": {{...}}}} "
                                           f"objects, got {json_type(value)}")
    if len(value) > MAX_TOOLS:  # before parsing each one
        raise InvalidRequestError("tools", f"has {len(value)} tools; at most {MAX_TOOLS} are allowed")
    tools = [_tool(i, t) for i, t in enumerate(value)]
    names: set[str] = set()
    for t in tools:
        if t.name in names:
            raise InvalidRequestError("tools", f"name the function {t.name!r} twice; function names must be unique")
        names.add(t.name)
    return tuple(tools)


def _tool(i: int, value: Any) -> Tool:
    where = f"tools[{i}]"
    if not isinstance(value, dict) or value.get("type") != "function":
        raise InvalidRequestError("tools", f"{where} must be an object with type \"function\" (the only tool type "
                                           f"pdserve serves)")
    function = value.get("function")
    if not isinstance(function, dict):
        raise InvalidRequestError("tools", f"{where}.function must be an object with the function's name")
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise InvalidRequestError("tools", f"{where}.function.name must be 1 to 64 letters, digits, _ or -, "
                                           f"got {name!r}")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise InvalidRequestError("tools", f"{where}.function.description must be a string")
    if description is not None:
        _tool_text(f"{where}.function.description", description)
    if function.get("strict") is not None and not isinstance(function["strict"], bool):
        raise InvalidRequestError("tools", f"{where}.function.strict must be a boolean")
    parameters = function.get("parameters")
    if parameters is None:
        return Tool(name, description, _EMPTY_PARAMETERS)
    if not isinstance(parameters, dict):
        raise InvalidRequestError("tools", f"{where}.function.parameters must be a JSON Schema object, "
                                           f"got {json_type(parameters)}")
    if "type" not in parameters:  # arguments are an object: a schema without a type would allow any JSON
        parameters = {"type": "object", **parameters}
    if parameters["type"] != "object":
        raise InvalidRequestError("tools", f"{where}.function.parameters must describe an object (type \"object\": "
                                           f"arguments are named), got type {parameters['type']!r}")
    text = _tool_text(f"{where}.function.parameters", json.dumps(parameters, separators=(",", ":"), ensure_ascii=False))
    _check_schema(f"{where}.function.parameters", text)
    return Tool(name, description, text)


def _tool_text(where: str, text: str) -> str:
    """`text` of a tool if it is valid Unicode; else a 400 naming tools (the place in the message)."""
    try:
        return valid_unicode("tools", text)
    except InvalidRequestError as e:
        raise InvalidRequestError("tools", f"{where} {e.message}") from None


def _check_schema(where: str, schema: str) -> None:
    """Compile `schema` as the workers will; one the grammar library refuses is a 400 naming tools."""
    from engine.grammar import check_json_schema  # here: xgrammar and torch stay out of `router.types`' imports
    try:
        check_json_schema(schema)
    except InvalidRequestError as e:
        raise InvalidRequestError("tools", f"{where}: {e.message}") from None


def _check_tag(where: str, tag: str) -> None:
    """Compile "auto"'s structural tag as the workers will; one the grammar library refuses is a 400
    naming tools."""
    from engine.grammar import check_structural_tag  # here, as in `_check_schema`
    try:
        check_structural_tag(tag)
    except InvalidRequestError as e:
        raise InvalidRequestError("tools", f"{where}: {e.message}") from None


def parse_tool_calling(body: dict) -> ToolCalling | None:
    """`tools`, `tool_choice` and `parallel_tool_calls` of a chat body: None when no tool may be called."""
    tools = parse_tools(body.get("tools"))
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidRequestError("parallel_tool_calls", f"must be a boolean, got {json_type(parallel)}")
    choice = body.get("tool_choice")
    if choice is None:
        choice = "auto" if tools else "none"
    function = None
    if isinstance(choice, dict):
        spec = choice.get("function")
        if choice.get("type") != "function" or not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise InvalidRequestError("tool_choice", "must be \"none\", \"auto\", \"required\" or "
                                                     "{\"type\": \"function\", \"function\": {\"name\": ...}}")
        function = spec["name"]
        if not any(t.name == function for t in tools):
            raise InvalidRequestError("tool_choice", f"names the function {function!r}, which is not in tools")
        choice = "function"
    elif choice not in ("none", "auto", "required"):
        raise InvalidRequestError("tool_choice", f"must be \"none\", \"auto\", \"required\" or "
                                                 f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, "
                                                 f"got {choice!r}")
    if choice == "none":
        return None
    if not tools:
        raise InvalidRequestError("tool_choice", f"is {choice!r} but the request has no tools")
    calling = ToolCalling(tools, choice, function, True if parallel is None else parallel)
    if choice == "required":  # the tools' parameters together: compiled here, as each tool's were
        _check_schema("the schema of a call of one of them", calling.json_schema or "")
    if choice == "auto":
        _check_tag("the grammar of a call of one of them", calling.structural_tag or "")
    return calling


def history_message(where: str, message: dict, role: str, content: str | None) -> dict:
    """A parsed chat message in transformers' format: an assistant's `tool_calls` (arguments as dicts),
    a tool message's `tool_call_id`; other roles carry neither."""
    out: dict[str, Any] = {"role": role, "content": content}
    calls = message.get("tool_calls")
    if calls is not None and calls != []:
        if role != "assistant":
            raise InvalidRequestError(f"{where}.tool_calls", "only assistant messages carry tool_calls")
        if not isinstance(calls, list):
            raise InvalidRequestError(f"{where}.tool_calls", "must be a list of tool calls")
        out["tool_calls"] = [_history_call(f"{where}.tool_calls[{j}]", c) for j, c in enumerate(calls)]
        if content is None:
            del out["content"]
    elif content is None:
        raise InvalidRequestError(f"{where}.content", "is required (it may be null only in an assistant message "
                                                      "with tool_calls)")
    call_id = message.get("tool_call_id")
    if call_id is not None:
        if role != "tool" or not isinstance(call_id, str):
            raise InvalidRequestError(f"{where}.tool_call_id", "is a string, in tool messages only")
        out["tool_call_id"] = valid_unicode(f"{where}.tool_call_id", call_id)
    return out


def _history_call(where: str, call: Any) -> dict:
    if not isinstance(call, dict) or call.get("type", "function") != "function":
        raise InvalidRequestError(where, "must be {\"id\", \"type\": \"function\", \"function\": {\"name\", "
                                         "\"arguments\"}}")
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise InvalidRequestError(f"{where}.function", "must be an object with the function's name and arguments")
    if not _NAME.match(function["name"]):
        raise InvalidRequestError(f"{where}.function.name", f"must be 1 to 64 letters, digits, _ or -, "
                                                            f"got {function['name']!r}")
    arguments = function.get("arguments", "{}")
    parsed = _json_object(valid_unicode(f"{where}.function.arguments", arguments)) if isinstance(arguments, str) \
        else None
    if parsed is None:
        raise InvalidRequestError(f"{where}.function.arguments", "must be a JSON object written as a string")
    # its strings decoded: an escaped surrogate (\\ud83d) is one too, and the prompt writes them out
    valid_unicode(f"{where}.function.arguments", json.dumps(parsed, ensure_ascii=False))
    out: dict[str, Any] = {"type": "function", "function": {"name": function["name"], "arguments": parsed}}
    if call.get("id") is not None:
        if not isinstance(call["id"], str):
            raise InvalidRequestError(f"{where}.id", "must be a string")
        out["id"] = valid_unicode(f"{where}.id", call["id"])
    return out


# ---------------------------------------------------------------- prompt


def has_tool_content(messages: list[dict], tools: tuple[Tool, ...]) -> bool:
    """Whether the chat needs tool-aware rendering: tools to show, or tool calls / results in its history."""
    return bool(tools) or any("tool_calls" in m or m["role"] == "tool" for m in messages)


def template_renders_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template renders `tools` (else it ignores them): a one-message
    conversation rendered with and without a tool differs. Named templates (a dict, as transformers
    allows) are probed as transformers picks them: "tool_use" when tools are given and it has one, else
    "default". Cached by template: its text, or the named templates as sorted JSON."""
    template = tokenizer.chat_template
    key = template if isinstance(template, str) else json.dumps(template, sort_keys=True)
    known = _RENDERS_TOOLS.get(key)
    if known is None:
        plain = tokenizer.apply_chat_template(PROBE_MESSAGES, add_generation_prompt=True, tokenize=False)
        with_tool = tokenizer.apply_chat_template(PROBE_MESSAGES, tools=[_PROBE_TOOL], add_generation_prompt=True,
                                                  tokenize=False)
        known = _RENDERS_TOOLS[key] = plain != with_tool
    return known


def fallback_messages(messages: list[dict], tools: tuple[Tool, ...]) -> list[dict]:
    """The chat as plain {role, content} messages for a template that does not render tools: the tools
    described in the system message (appended to the client's, or a new first one), earlier calls
    written as <tool_call> blocks, tool results inside <tool_response> tags."""
    out = []
    for m in messages:
        content = m.get("content") or ""
        if "tool_calls" in m:
            blocks = [f"{CALL_OPEN}\n{json.dumps(_call_json(c), ensure_ascii=False)}\n{CALL_CLOSE}"
                      for c in m["tool_calls"]]
            content = "\n".join(([content] if content else []) + blocks)
        elif m["role"] == "tool":
            content = f"{RESULT_OPEN}\n{content}\n{RESULT_CLOSE}"
        out.append({"role": m["role"], "content": content})
    if tools:
        listing = "\n".join(json.dumps(t.template_dict(), ensure_ascii=False) for t in tools)
        text = FALLBACK_INSTRUCTIONS.format(tools=listing)
        if out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{text}"}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def chat_prompt(tokenizer: Any, messages: list[dict], tools: tuple[Tool, ...]) -> tuple[list[dict], list[dict] | None]:
    """(messages, tools) to hand `apply_chat_template`: as they are with the tools in transformers'
    format when the template renders tools, else `fallback_messages` and no tools."""
    if not has_tool_content(messages, tools):
        return messages, None
    if template_renders_tools(tokenizer):
        return messages, [t.template_dict() for t in tools] or None
    return fallback_messages(messages, tools), None


def _call_json(call: dict) -> dict:
    return {"name": call["function"]["name"], "arguments": call["function"]["arguments"]}


# ---------------------------------------------------------------- streaming


class ToolStream:
    """One streamed choice's tool calls, delta by delta (`feed` each chunk's text, then `finish`).

    A named function's arguments stream as they come (the first delta carries the call's id and name).
    "required" output is held until it ends, then sent as whole calls. "auto" text streams as content
    until a `<tool_call>` tag may begin (a held-back tail that could start one, and the blanks before
    it, which a call drops); from the tag on it is held and, at the end, sent as calls, or as content
    when it does not parse. The content sent adds up to `ToolCalling.extract`'s for the whole output."""

    def __init__(self, calling: ToolCalling) -> None:
        self.calling = calling
        self._held = ""  # output not sent yet
        self._named: ToolCall | None = None
        self._tagged = False  # "auto": a <tool_call> tag came; the rest is held
        self._sent = False  # "auto": some content was sent

    def feed(self, text: str) -> list[dict]:
        """The deltas to send for the next output text."""
        if not text:
            return []
        if self.calling.choice == "function":
            if self._named is None:  # the first delta names the call
                self._named = new_call(self.calling.function or "", text)
                return [{"tool_calls": [{"index": 0, **self._named.body()}]}]
            return [{"tool_calls": [{"index": 0, "function": {"arguments": text}}]}]
        self._held += text
        if self.calling.choice == "required" or self._tagged:
            return []
        start = self._held.find(CALL_OPEN)
        if start >= 0:
            self._tagged = True
            sent = self._held[:start].rstrip()
            self._held = self._held[len(sent):]
        else:
            keep = _partial_tag(self._held)
            sent = self._held[:len(self._held) - keep].rstrip()  # blanks wait: they go if a call follows
            self._held = self._held[len(sent):]
        self._sent = self._sent or bool(sent)
        return [{"content": sent}] if sent else []

    def finish(self, finish_reason: str) -> tuple[list[dict], str]:
        """The last deltas and the choice's finish reason, once the output ended with `finish_reason`."""
        if self.calling.choice == "function":
            return [], "tool_calls" if finish_reason == "stop" and self._named is not None else finish_reason
        held, self._held = self._held, ""
        out = self.calling.extract(held, finish_reason)
        content = out.content
        if content and out.calls and self._sent:  # after the text sent, as `_outside` joins the pieces
            content = "\n" + content
        deltas = [{"content": content}] if content else []
        deltas += [{"tool_calls": [{"index": i, **c.body()}]} for i, c in enumerate(out.calls)]
        return deltas, out.finish_reason


def _outside(text: str) -> str | None:
    """"auto"'s content beside its calls: the text outside the <tool_call> blocks, the blanks next to
    a block dropped, the pieces between blocks joined by a newline; None when nothing is left."""
    pieces, at = [], 0
    for m in _TAGGED.finditer(text):
        pieces.append(text[at:m.start()])
        at = m.end()
    pieces.append(text[at:])
    last = len(pieces) - 1
    kept = [p.rstrip() if i == 0 else p.lstrip() if i == last else p.strip() for i, p in enumerate(pieces)]
    return "\n".join(p for p in kept if p) or None


def _partial_tag(text: str) -> int:
    """How many characters at the end of `text` could begin a <tool_call> tag."""
    for n in range(min(len(CALL_OPEN) - 1, len(text)), 0, -1):
        if CALL_OPEN.startswith(text[-n:]):
            return n
    return 0


def _json_object(text: str) -> dict | None:
    """`text` as a JSON object (NaN and Infinity are no JSON), or None."""
    try:
        value, end = _DECODER.raw_decode(text, _WS.match(text).end())  # type: ignore[union-attr]
    except ValueError:
        return None
    return value if isinstance(value, dict) and _WS.match(text, end).end() == len(text) else None  # type: ignore


def _json_objects(text: str, array: bool, prefix: bool = False) -> list[dict[str, tuple[Any, str]]] | None:
    """The JSON objects `text` is (one, or with `array` also a list of them), each as its members:
    key → (value, the value's JSON text as written). None when `text` is not that. With `prefix`,
    `text` may be cut short (an output cut by max_tokens): the objects completed before the first one
    that does not parse (the one the cut broke). Linear in `text`: each member's value is decoded once."""
    items: list[dict[str, tuple[Any, str]]] = []
    pos = _WS.match(text).end()  # type: ignore[union-attr]
    try:
        if array and text.startswith("[", pos):
            pos = _WS.match(text, pos + 1).end()  # type: ignore[union-attr]
            while not text.startswith("]", pos):
                if items:
                    pos = _expect(text, pos, ",")
                item, pos = _members(text, pos)
                items.append(item)
                pos = _WS.match(text, pos).end()  # type: ignore[union-attr]
            pos += 1
        else:
            item, pos = _members(text, pos)
            items = [item]
    except ValueError:
        return items if prefix else None
    return items if _WS.match(text, pos).end() == len(text) else None  # type: ignore[union-attr]


def _members(text: str, pos: int) -> tuple[dict[str, tuple[Any, str]], int]:
    """The object at `pos`: key → (value, its JSON text) (a repeated key: the last, as json.loads), and
    where it ends. Raises ValueError when there is none."""
    pos = _expect(text, pos, "{")
    members: dict[str, tuple[Any, str]] = {}
    while not text.startswith("}", pos):
        if members:
            pos = _expect(text, pos, ",")
        if not text.startswith('"', pos):
            raise ValueError("a key must be a string")
        key, pos = _DECODER.raw_decode(text, pos)
        start = _expect(text, pos, ":")
        value, pos = _DECODER.raw_decode(text, start)
        members[key] = (value, text[start:pos])
        pos = _WS.match(text, pos).end()  # type: ignore[union-attr]
    return members, pos + 1


def _expect(text: str, pos: int, char: str) -> int:
    """Past `char` at `pos` (after blanks) and the blanks after it. Raises ValueError when it is not there."""
    pos = _WS.match(text, pos).end()  # type: ignore[union-attr]
    if not text.startswith(char, pos):
        raise ValueError(f"expected {char!r}")
    return _WS.match(text, pos + 1).end()  # type: ignore[union-attr]


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _escape_surrogates(text: str) -> str:
    """JSON text with any lone surrogate (decoded from a \\uXXXX escape inside a JSON string) written
    back as that escape, so that the text encodes as UTF-8."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _rewrite_refs(schema: Any, tool: str, base: str) -> Any:
    """A copy of tool `tool`'s subschema `schema` for the "required" schema: local `$ref`s into its
    `$defs` / `definitions` point to the root's "<tool>.<name>", other local ones under `base` (where
    its parameters now are). Values of data keywords (const, enum, ...) are left as they are."""
    if isinstance(schema, list):
        return [_rewrite_refs(v, tool, base) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = _moved_ref(value, tool, base)
        elif key in _DATA_KEYWORDS:
            out[key] = value
        else:
            out[key] = _rewrite_refs(value, tool, base)
    return out


def _moved_ref(ref: str, tool: str, base: str) -> str:
    parts = ref[1:].split("/")  # "#/$defs/X/..." → ["", "$defs", "X", ...]
    if len(parts) >= 3 and parts[0] == "" and parts[1] in _DEFS:
        name = parts[2].replace("~1", "/").replace("~0", "~")
        moved = f"{tool}.{name}".replace("~", "~0").replace("/", "~1")
        return "/".join(["#", "$defs", moved, *parts[3:]])
    return base + ref[1:]
