"""Tool calling on /v1/chat/completions: `tools` and `tool_choice` in, `tool_calls` out. Pure, no I/O.

Request lifecycle:
1. Parsing (`parse_tool_calling`, called by `openai_protocol.parse_chat_request`): `tools` (type
   "function" with a name, an optional description and a `parameters` JSON Schema of type object),
   `tool_choice` ("none" | "auto" | "required" | {"type": "function", "function": {"name"}}) and
   `parallel_tool_calls` become a `ToolCalling` (None when no tool may be called: no tools, or
   tool_choice "none"). Anything malformed is an InvalidRequestError naming `tools`, `tool_choice` or
   `parallel_tool_calls`. The chat history may hold assistant messages with `tool_calls` and `tool`
   messages (`history_message` keeps them in transformers' format: arguments as a dict).
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
   parallel_tool_calls is true). "auto" leaves the model free; its output is parsed for the tagged calls.
4. Response (`ToolCalling.extract` whole, `ToolStream` streamed): the output becomes `ToolCall`s with ids
   "call_<random>", finish_reason "tool_calls". Output that does not parse (cut by max_tokens, or an
   "auto" answer in words) is the message's content, with the generation's own finish_reason.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from engine.errors import InvalidRequestError
from engine.grammar import check_json_schema

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESULT_OPEN, RESULT_CLOSE = "<tool_response>", "</tool_response>"
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
_TAGGED = re.compile(re.escape(CALL_OPEN) + r"(.*?)(?:" + re.escape(CALL_CLOSE) + r"|\Z)", re.DOTALL)
_EMPTY_PARAMETERS = '{"type":"object","properties":{}}'  # a function without parameters (OpenAI's default)
_PROBE_MESSAGES = [{"role": "user", "content": "Hello!"}]
_PROBE_TOOL = {"type": "function", "function": {"name": "pdserve_probe", "description": "A probe.",
                                                 "parameters": {"type": "object", "properties": {}}}}
_RENDERS_TOOLS: dict[str, bool] = {}  # template text → whether it renders `tools`
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

    @property
    def json_schema(self) -> str | None:
        """The output's JSON Schema (`SamplingParams.json_schema`): None for "auto" (free output)."""
        if self.choice == "function":
            return self._tool(self.function).parameters
        if self.choice != "required":
            return None
        calls = [{"type": "object", "properties": {"name": {"const": t.name}, "arguments": json.loads(t.parameters)},
                  "required": ["name", "arguments"], "additionalProperties": False} for t in self.tools]
        one = calls[0] if len(calls) == 1 else {"anyOf": calls}
        schema = {"type": "array", "items": one, "minItems": 1} if self.parallel else one
        return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)

    def extract(self, text: str, finish_reason: str) -> ToolOutput:
        """The message of a finished output `text` (finish_reason: the generation's, OpenAI's words)."""
        if finish_reason != "stop":  # cut short: whatever was written is content
            return ToolOutput(text or None, (), finish_reason)
        calls = self._calls(text)
        if calls is None:
            return ToolOutput(text or None, (), finish_reason)
        content = _TAGGED.sub("", text).strip() if self.choice == "auto" else ""
        return ToolOutput(content or None, calls, "tool_calls")

    def _calls(self, text: str) -> tuple[ToolCall, ...] | None:
        """The calls `text` holds, or None when it holds none that parse (all of them must)."""
        if self.choice == "function":
            arguments = _json_object(text)
            return None if arguments is None else (new_call(self.function, text.strip()),)
        if self.choice == "required":
            value = _json(text)
            items = value if isinstance(value, list) else [value]
        else:
            items = [_json(m.group(1).strip()) for m in _TAGGED.finditer(text)]
        calls = [self._call(item) for item in items]
        if not calls or any(c is None for c in calls):
            return None
        return tuple(calls[:1] if not self.parallel else calls)  # type: ignore[arg-type]

    def _call(self, item: Any) -> ToolCall | None:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        if not any(t.name == item["name"] for t in self.tools):
            return None
        arguments = item.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            arguments = _json_object(arguments)
        if not isinstance(arguments, dict):
            return None
        return new_call(item["name"], json.dumps(arguments, ensure_ascii=False))

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
                                           f"objects, got {_json_type(value)}")
    tools = [_tool(i, t) for i, t in enumerate(value)]
    names = [t.name for t in tools]
    for name in names:
        if names.count(name) > 1:
            raise InvalidRequestError("tools", f"name the function {name!r} twice; function names must be unique")
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
    if function.get("strict") is not None and not isinstance(function["strict"], bool):
        raise InvalidRequestError("tools", f"{where}.function.strict must be a boolean")
    parameters = function.get("parameters")
    if parameters is None:
        return Tool(name, description, _EMPTY_PARAMETERS)
    if not isinstance(parameters, dict):
        raise InvalidRequestError("tools", f"{where}.function.parameters must be a JSON Schema object, "
                                           f"got {_json_type(parameters)}")
    if parameters.get("type", "object") != "object":
        raise InvalidRequestError("tools", f"{where}.function.parameters must describe an object (type \"object\": "
                                           f"arguments are named), got type {parameters['type']!r}")
    text = json.dumps(parameters, separators=(",", ":"), ensure_ascii=False)
    try:
        check_json_schema(text)
    except InvalidRequestError as e:
        raise InvalidRequestError("tools", f"{where}.function.parameters: {e.message}") from None
    return Tool(name, description, text)


def parse_tool_calling(body: dict) -> ToolCalling | None:
    """`tools`, `tool_choice` and `parallel_tool_calls` of a chat body: None when no tool may be called."""
    tools = parse_tools(body.get("tools"))
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidRequestError("parallel_tool_calls", f"must be a boolean, got {_json_type(parallel)}")
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
    return ToolCalling(tools, choice, function, True if parallel is None else parallel)


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
        out["tool_call_id"] = call_id
    return out


def _history_call(where: str, call: Any) -> dict:
    if not isinstance(call, dict) or call.get("type", "function") != "function":
        raise InvalidRequestError(where, "must be {\"id\", \"type\": \"function\", \"function\": {\"name\", "
                                         "\"arguments\"}}")
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise InvalidRequestError(f"{where}.function", "must be an object with the function's name and arguments")
    arguments = function.get("arguments", "{}")
    parsed = _json_object(arguments) if isinstance(arguments, str) else None
    if parsed is None:
        raise InvalidRequestError(f"{where}.function.arguments", "must be a JSON object written as a string")
    out: dict[str, Any] = {"type": "function", "function": {"name": function["name"], "arguments": parsed}}
    if call.get("id") is not None:
        if not isinstance(call["id"], str):
            raise InvalidRequestError(f"{where}.id", "must be a string")
        out["id"] = call["id"]
    return out


# ---------------------------------------------------------------- prompt


def has_tool_content(messages: list[dict], tools: tuple[Tool, ...]) -> bool:
    """Whether the chat needs tool-aware rendering: tools to show, or tool calls / results in its history."""
    return bool(tools) or any("tool_calls" in m or m["role"] == "tool" for m in messages)


def template_renders_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template renders `tools` (else it ignores them): a one-message
    conversation rendered with and without a tool differs. Cached by template text."""
    template = tokenizer.chat_template
    known = _RENDERS_TOOLS.get(template)
    if known is None:
        plain = tokenizer.apply_chat_template(_PROBE_MESSAGES, add_generation_prompt=True, tokenize=False)
        with_tool = tokenizer.apply_chat_template(_PROBE_MESSAGES, tools=[_PROBE_TOOL], add_generation_prompt=True,
                                                  tokenize=False)
        known = _RENDERS_TOOLS[template] = plain != with_tool
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
    until a `<tool_call>` tag may begin (a held-back tail that could start one); from the tag on it is
    held and, at the end, sent as calls, or as content when it does not parse."""

    def __init__(self, calling: ToolCalling) -> None:
        self.calling = calling
        self._held = ""  # output not sent yet
        self._named: ToolCall | None = None
        self._tagged = False  # "auto": a <tool_call> tag came; the rest is held

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
            sent, self._held = self._held[:start], self._held[start:]
        else:
            keep = _partial_tag(self._held)
            sent, self._held = self._held[:len(self._held) - keep], self._held[len(self._held) - keep:]
        return [{"content": sent}] if sent else []

    def finish(self, finish_reason: str) -> tuple[list[dict], str]:
        """The last deltas and the choice's finish reason, once the output ended with `finish_reason`."""
        if self.calling.choice == "function":
            return [], "tool_calls" if finish_reason == "stop" and self._named is not None else finish_reason
        held, self._held = self._held, ""
        out = self.calling.extract(held, finish_reason)
        deltas = [{"content": out.content}] if out.content else []
        deltas += [{"tool_calls": [{"index": i, **c.body()}]} for i, c in enumerate(out.calls)]
        return deltas, out.finish_reason


def _partial_tag(text: str) -> int:
    """How many characters at the end of `text` could begin a <tool_call> tag."""
    for n in range(min(len(CALL_OPEN) - 1, len(text)), 0, -1):
        if CALL_OPEN.startswith(text[-n:]):
            return n
    return 0


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _json_object(text: str) -> dict | None:
    value = _json(text)
    return value if isinstance(value, dict) else None


def _json_type(v: Any) -> str:
    names = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object"}
    return "null" if v is None else names.get(type(v), type(v).__name__)
