"""OpenAI wire format: request bodies → `GenerateRequest`, router output → response bodies. Pure, no I/O.

Parsing checks every field the OpenAI API defines for /v1/completions and /v1/chat/completions,
raising `InvalidRequestError(field, message)` that names the field and what is allowed; fields we
cannot honour (functions, suffix, ...) are refused rather than silently ignored,
and so are the sampling extensions of other OpenAI-compatible servers that pdserve does not implement
(`UNSUPPORTED_EXTENSIONS`), and OpenAI's chat fields for what pdserve does not serve (`UNSUPPORTED_CHAT_FIELDS`:
audio, web search, reasoning controls, predicted outputs, moderation; `modalities` other than ["text"]).
OpenAI's fields that speak to the platform, not the output (`NO_EFFECT_FIELDS`: user, metadata, store,
service_tier, ...) are taken without effect. Other unknown top-level fields are ignored, as such servers
commonly do.

Several choices (`ParsedRequest`; served by `router.choices`, a fan-out of one router request per
sequence): `n` (both endpoints) in [1, `RequestLimits.max_choices`]; on completions `prompt` may be a
batch (a list of strings or of token-id lists, at most `RequestLimits.max_prompts`; a single list of
integers is one prompt of token ids), each prompt with n choices at index prompt_index * n + i;
`best_of` (>= n, same bound; not with stream: true, as OpenAI) generates that many per prompt and
returns the n with the highest cumulative log-probability; `echo: true` starts each choice's text
with its prompt as sent (token ids: their decoded text), streamed in the choice's first chunk; echo
with logprobs is refused (naming echo): the prompt's tokens would need prompt log-probabilities,
which pdserve does not compute.

Token ids (`return_token_ids: true`, both endpoints, as vLLM names it): each choice carries the ids of
its output tokens (`token_ids`) and its prompt's ids as the model ran them (`prompt_token_ids`: on the
completions choice, top-level on a chat response, the chat template applied); streamed, every chunk
carries the ids of its own tokens (also when their text is held back) and the choice's first chunk the
prompt's. A client that continues a conversation with them resends exactly the tokens the model produced,
so the prefix cache holds its whole history. Not with echo (400 naming return_token_ids).

Log-probabilities: completions `logprobs` (an integer in [0, 20]), chat `logprobs: true` with
`top_logprobs` (an integer in [0, 20]; above 0 only with `logprobs: true`) become
`SamplingParams.logprobs`; out of range → InvalidRequestError naming the field. They are the model's
raw log-softmax (`engine.logprobs`). `LogprobsBuilder` writes them in OpenAI's shapes: completions
`{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}] (the top k and the chosen token),
"text_offset"}`, chat `{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}`. A token's
string is the tokenizer's decode of its id alone (special tokens included), as vLLM gives it; a
`text_offset` is where the token starts in the concatenation of those strings. They follow the tokens,
not the text: a streamed chunk carries the logprobs of its tokens, also when their text is held back
(it then has empty text), so every token's entry comes exactly once, in order.

Defaults follow OpenAI: temperature 1.0, top_p 1.0, max_tokens 16 for completions; chat without
max_tokens gets the server's default (cut to the room left in the context). presence_penalty,
frequency_penalty and logit_bias (token ids as strings → bias in [-100, 100], at most 300 tokens;
applied to greedy requests too) as OpenAI defines them. Extensions (names common among OpenAI-compatible servers):
top_k (-1 or 0 disables), min_p, min_tokens, repetition_penalty, ignore_eos, stop_token_ids,
skip_special_tokens (true only: text never holds special tokens).

Structured output: `response_format` {"type": "text"} (or null) is plain text; {"type": "json_object"} any
JSON object; {"type": "json_schema", "json_schema": {"name", "schema", "strict"}} output matching the
schema (strict or not: the schema is always enforced). Both become `SamplingParams.json_schema` (the
schema's JSON text), checked here by compiling it (`engine.grammar.check_json_schema`): a malformed
response_format or a schema the grammar library cannot compile → InvalidRequestError naming response_format.

Tool calling (chat): `tools`, `tool_choice`, `parallel_tool_calls` and the tool messages of the history
are parsed by `router.tool_calls` into `ParsedRequest.tools` (a `ToolCalling`, None when no tool may be
called) and `GenerateRequest.tools` (the tools the prompt shows); "required" and a named function set
`SamplingParams.json_schema` to the calls' schema, "auto" `SamplingParams.structural_tag` (free text with
well-formed tagged calls). Not with a response_format other than text (the output
has one shape; 400 naming it). `ResponseBuilder` turns the output into `tool_calls`; with logprobs, they
are those of every generated token, content and calls alike, as the output's tokens come (streamed: each
chunk's ride its first event, or an empty delta while the text is held back).

Size limits (`router.limits.RequestLimits`: prompt characters, messages, stop strings, stop token
ids) are checked here too, shared with the gRPC API; over a limit → InvalidRequestError naming the field.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from engine.errors import InvalidRequestError
from engine.grammar import JSON_OBJECT_SCHEMA, check_json_schema
from engine.logprobs import MAX_LOGPROBS, TokenLogprob
from engine.sampling_params import SamplingParams
from router.json_fields import json_type as _json_type
from router.json_fields import valid_unicode as _unicode
from router.limits import DEFAULT_LIMITS, RequestLimits, check_limits
from router.tool_calls import ToolCalling, ToolStream, history_message, parse_tool_calling
from router.types import Chunk, GenerateRequest, PhaseTimings, RequestFailed, Usage
from worker_core.protocol import ErrorKind

DEFAULT_MAX_TOKENS = 16
# Sampling and output options other OpenAI-compatible servers take that pdserve does not implement: a
# request that sets one (to anything but null) is refused naming it, never served as if it were absent.
UNSUPPORTED_EXTENSIONS = ("use_beam_search", "length_penalty", "early_stopping", "bad_words", "allowed_token_ids",
                          "prompt_logprobs", "include_stop_str_in_output", "spaces_between_special_tokens",
                          "truncate_prompt_tokens", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                          "guided_decoding_backend", "guided_whitespace_pattern", "structured_outputs",
                          "logits_processors", "return_tokens_as_token_ids", "min_new_tokens")
# OpenAI chat fields pdserve cannot honour (audio output, web search, reasoning controls, predicted outputs,
# moderation): refused naming the field unless null; `modalities` is taken when it is ["text"] only.
UNSUPPORTED_CHAT_FIELDS = ("audio", "web_search_options", "reasoning_effort", "verbosity", "prediction", "moderation")
# OpenAI fields that speak to the platform (who asks, storage, billing tier, prompt-cache hints), not to the
# output: taken and without effect (pdserve stores nothing, has one tier, and caches prompt prefixes always).
NO_EFFECT_FIELDS = ("user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key",
                    "prompt_cache_retention", "prompt_cache_options")
MAX_TOKEN_ID = 2**31 - 1
CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")
FINISH_REASONS = ("stop", "length")
LOWEST_LOGPROB = -9999.0  # what a log-probability of -inf is written as (JSON has no infinity), as OpenAI does
_MISSING = object()


@dataclass(frozen=True)
class ParsedRequest:
    """A validated OpenAI request: what to generate and how to answer.

    Args:
        requests: one per prompt, in the client's order (chat and a single prompt: one), each with the
            client's own sampling settings (`router.choices` derives each sequence's seed and logprobs).
        stream / include_usage: stream server-sent events; end them with a usage chunk.
        n: choices returned per prompt.
        best_of: sequences generated per prompt (>= n); the n with the highest cumulative
            log-probability are returned. None: n (every sequence is returned).
        echo: each completion's text starts with its prompt (completions only).
        return_token_ids: each choice carries its prompt's and its output's token ids.
        tools: how the choices may call tools (chat only); None: they answer in text.
    Raises: InvalidRequestError naming the field for a combination OpenAI refuses or pdserve cannot serve.
    """

    requests: tuple[GenerateRequest, ...]
    stream: bool = False
    include_usage: bool = False
    n: int = 1
    best_of: int | None = None
    echo: bool = False
    tools: ToolCalling | None = None
    return_token_ids: bool = False

    def __post_init__(self) -> None:
        if not self.requests:
            raise InvalidRequestError("prompt", "must not be empty")
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise InvalidRequestError("n", f"must be an integer >= 1, got {self.n!r}")
        if self.best_of is not None:
            if isinstance(self.best_of, bool) or not isinstance(self.best_of, int) or self.best_of < self.n:
                raise InvalidRequestError("best_of", f"must be an integer >= n ({self.n}), got {self.best_of!r}")
            if self.stream and self.best_of != self.n:
                raise InvalidRequestError("best_of", "cannot be used with stream: true (as on OpenAI): the best "
                                                     "choices are known only once every sequence has finished")
        if self.echo:
            if any(r.prompt is None for r in self.requests):
                raise InvalidRequestError("echo", "is a completions field: it needs a prompt")
            if self.request.sampling.logprobs is not None:
                raise InvalidRequestError("echo", "cannot be combined with logprobs: the prompt's tokens would need "
                                                  "prompt log-probabilities, which pdserve does not compute")
            if self.return_token_ids:
                raise InvalidRequestError("return_token_ids", "cannot be combined with echo: the prompt's ids "
                                                              "come as prompt_token_ids")

    @property
    def request(self) -> GenerateRequest:
        """The first prompt's request (the only one for chat or a single prompt)."""
        return self.requests[0]

    @property
    def per_prompt(self) -> int:
        """Sequences generated per prompt: best_of, else n."""
        return self.best_of if self.best_of is not None else self.n

    @property
    def ranked(self) -> bool:
        """More sequences are generated than returned: they are ranked by cumulative log-probability."""
        return self.per_prompt > self.n


# ---------------------------------------------------------------- parsing


def parse_completion_request(body: Any, default_max_tokens: int = DEFAULT_MAX_TOKENS,
                             limits: RequestLimits = DEFAULT_LIMITS) -> ParsedRequest:
    """Args: the decoded JSON body of POST /v1/completions; the default max_tokens; the size limits.
    Returns: the parsed request. Raises: InvalidRequestError naming the offending field."""
    body = _object(body)
    logprobs = _logprobs_count(body, "logprobs")
    echo = _typed(body, "echo", bool, "a boolean", False)
    best_of = _choices(body, "best_of", limits, None)
    _only_null_or(body, "suffix", ("",), "is not supported; use null or leave it out", str)
    prompts = _prompts(body.get("prompt", _MISSING), limits.max_prompts)
    sampling = _sampling(body, _int_field(body, "max_tokens", default_max_tokens), logprobs)
    model, timeout = _model(body), _timeout(body)
    requests = tuple(check_limits(GenerateRequest(prompt=p, sampling=sampling, model=model, timeout_s=timeout), limits)
                     for p in prompts)
    chars = sum(len(p) for p in prompts if isinstance(p, str))
    if chars > limits.max_prompt_chars:
        raise InvalidRequestError("prompt", f"has {chars} characters in its {len(prompts)} prompts together; at most "
                                            f"{limits.max_prompt_chars} are allowed")
    return _parsed(body, requests, limits, best_of=best_of, echo=echo)


def parse_chat_request(body: Any, default_max_tokens: int = DEFAULT_MAX_TOKENS,
                       limits: RequestLimits = DEFAULT_LIMITS) -> ParsedRequest:
    """Args: the decoded JSON body of POST /v1/chat/completions; the default max_tokens; the size limits.
    Returns: the parsed request. Raises: InvalidRequestError naming the offending field."""
    body = _object(body)
    logprobs = _chat_logprobs(body)
    calling = parse_tool_calling(body)
    _only_null_or(body, "functions", ([],), "function calling is not supported; leave functions out")
    _only_null_or(body, "function_call", ("none",), "function calling is not supported; use \"none\"")
    for name in UNSUPPORTED_CHAT_FIELDS:
        if body.get(name) is not None:
            raise InvalidRequestError(name, "is not supported by pdserve; leave it out")
    _only_null_or(body, "modalities", (["text"],), "only [\"text\"] is served (pdserve writes no audio)")
    messages = _messages(body.get("messages", _MISSING), limits.max_messages)
    if body.get("max_completion_tokens") is not None:
        max_tokens = _int_field(body, "max_completion_tokens", default_max_tokens)
    else:
        max_tokens = _int_field(body, "max_tokens", default_max_tokens)
    sampling = _sampling(body, max_tokens, logprobs)
    if calling is not None:
        sampling = _tool_sampling(sampling, calling)
    unset = body.get("max_completion_tokens") is None and body.get("max_tokens") is None
    request = GenerateRequest(messages=messages, sampling=sampling, model=_model(body), max_tokens_default=unset,
                              timeout_s=_timeout(body), tools=calling.tools if calling is not None else ())
    return _parsed(body, (check_limits(request, limits),), limits, tools=calling)


def _tool_sampling(sampling: SamplingParams, calling: ToolCalling) -> SamplingParams:
    """The sampling of a request that may call tools: its output constrained to the calls' schema
    ("required", a named function) or, for "auto", to free text with well-formed tagged calls in it (a
    structural tag). Refuses what cannot go with tool calls."""
    if sampling.json_schema is not None:
        raise InvalidRequestError("response_format", "cannot be combined with tool calling (tool_choice "
                                                     f"{calling.choice!r}); use tool_choice \"none\" or leave "
                                                     "response_format out")
    schema = calling.json_schema
    if schema is not None and sampling.min_tokens:
        raise InvalidRequestError("tool_choice", f"{calling.choice!r} cannot be combined with min_tokens (the call's "
                                                 "JSON decides where the output ends); leave min_tokens out")
    return replace(sampling, json_schema=schema, structural_tag=calling.structural_tag)


def parse_tokenize_request(body: Any, limits: RequestLimits = DEFAULT_LIMITS) -> GenerateRequest:
    """POST /tokenize: {"prompt": text} or {"messages": [...]} (rendered with the chat template, with
    `tools` as chat renders them: not when tool_choice is "none"), optional "model". Returns the request
    to tokenize. Raises: InvalidRequestError naming the field."""
    body = _object(body)
    if (body.get("prompt") is None) == (body.get("messages") is None):
        raise InvalidRequestError("prompt", "give exactly one of prompt (a string) or messages")
    if body.get("messages") is not None:
        calling = parse_tool_calling(body)
        request = GenerateRequest(messages=_messages(body["messages"], limits.max_messages), model=_model(body),
                                  tools=calling.tools if calling is not None else ())
    else:
        prompts = _prompts(body["prompt"], 1)
        if not isinstance(prompts[0], str):
            raise InvalidRequestError("prompt", "must be a string (it is what gets tokenized)")
        prompt = prompts[0]
        request = GenerateRequest(prompt=prompt, model=_model(body))
    return check_limits(request, limits)


def parse_detokenize_request(body: Any) -> tuple[list[int], str | None]:
    """POST /detokenize: {"tokens": [ids]}, optional "model". Returns (token ids, model).
    Raises: InvalidRequestError naming the field."""
    body = _object(body)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(_is(t, int) and 0 <= t <= MAX_TOKEN_ID for t in tokens):
        raise InvalidRequestError("tokens", f"is required: a list of token ids (integers in [0, {MAX_TOKEN_ID}])")
    return list(tokens), _model(body)


def _parsed(body: dict, requests: tuple[GenerateRequest, ...], limits: RequestLimits, *, best_of: int | None = None,
            echo: bool = False, tools: ToolCalling | None = None) -> ParsedRequest:
    stream = _typed(body, "stream", bool, "a boolean", False)
    options = _typed(body, "stream_options", dict, "an object", None)
    if options is not None and not stream:
        raise InvalidRequestError("stream_options", "is only allowed when stream is true")
    include_usage = _typed(options or {}, "include_usage", bool, "a boolean", False, "stream_options.include_usage")
    return ParsedRequest(requests=requests, stream=stream, include_usage=include_usage,
                         n=_choices(body, "n", limits, 1), best_of=best_of, echo=echo, tools=tools,
                         return_token_ids=_typed(body, "return_token_ids", bool, "a boolean", False))


def _choices(body: dict, name: str, limits: RequestLimits, default: int | None) -> int | None:
    """body[name] (n, best_of): null, or a number of choices in [1, limits.max_choices]."""
    value = _typed(body, name, int, f"an integer in [1, {limits.max_choices}]", default)
    if value is not None and not 1 <= value <= limits.max_choices:
        raise InvalidRequestError(name, f"must be an integer in [1, {limits.max_choices}] (choices per prompt), "
                                        f"got {value}")
    return value


def _logprobs_count(body: dict, name: str) -> int | None:
    """body[name]: null, or how many likeliest tokens to give beside each chosen one, in [0, 20]."""
    value = _typed(body, name, int, f"an integer in [0, {MAX_LOGPROBS}]", None)
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise InvalidRequestError(name, f"must be an integer in [0, {MAX_LOGPROBS}], got {value}")
    return value


def _chat_logprobs(body: dict) -> int | None:
    """Chat: `logprobs` (a boolean) turns them on, `top_logprobs` says how many alternatives."""
    wanted = _typed(body, "logprobs", bool, "a boolean", False)
    top = _logprobs_count(body, "top_logprobs")
    if top and not wanted:
        raise InvalidRequestError("top_logprobs", "needs logprobs set to true")
    return (top or 0) if wanted else None


def _sampling(body: dict, max_tokens: int, logprobs: int | None = None) -> SamplingParams:
    for name in UNSUPPORTED_EXTENSIONS:
        if body.get(name) is not None:
            raise InvalidRequestError(name, "is not supported by pdserve; leave it out")
    _only_null_or(body, "skip_special_tokens", (True,), "only true is supported (text never holds special tokens)",
                  bool)
    logit_bias = _typed(body, "logit_bias", dict, "an object", None) or {}
    top_k = _typed(body, "top_k", int, "an integer", 0)
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=_typed(body, "temperature", (int, float), "a number", 1.0),
        top_p=_typed(body, "top_p", (int, float), "a number", 1.0),
        top_k=0 if top_k == -1 else top_k,
        seed=_typed(body, "seed", int, "an integer", None),
        stop=_stop(body.get("stop")),
        stop_token_ids=tuple(_typed(body, "stop_token_ids", list, "a list of token ids", [])),
        ignore_eos=_typed(body, "ignore_eos", bool, "a boolean", False),
        min_p=_typed(body, "min_p", (int, float), "a number", 0.0),
        min_tokens=_typed(body, "min_tokens", int, "an integer", 0),
        presence_penalty=_typed(body, "presence_penalty", (int, float), "a number", 0.0),
        frequency_penalty=_typed(body, "frequency_penalty", (int, float), "a number", 0.0),
        repetition_penalty=_typed(body, "repetition_penalty", (int, float), "a number", 1.0),
        logprobs=logprobs,
        logit_bias=tuple((_token_id_key(k), v) for k, v in logit_bias.items()),
        json_schema=_response_format(body.get("response_format")),
    )


def _token_id_key(key: str) -> int:
    """A `logit_bias` key: a token id written as a string (JSON object keys are strings)."""
    if not key.isdecimal():
        raise InvalidRequestError("logit_bias", f"keys must be token ids (decimal integers), got {key!r}")
    return int(key)


def _object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise InvalidRequestError("body", f"must be a JSON object, got {_json_type(body)}")
    return body


def _timeout(body: dict) -> float | None:
    """pdserve's extension `timeout`: the request's deadline in seconds (queueing included)."""
    value = body.get("timeout")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1e7:
        raise InvalidRequestError("timeout", f"must be a number of seconds in (0, 1e7), got {value!r}")
    return float(value)


def _model(body: dict) -> str | None:
    return _typed(body, "model", str, "a string", None)


def _prompts(value: Any, max_prompts: int) -> list[str | list[int]]:
    """`prompt` as OpenAI defines it: a string or a list of token ids (one prompt), or a list of
    strings / token-id lists (a batch, each with its own choices)."""
    if value is _MISSING or value is None:
        raise InvalidRequestError("prompt", "is required: a string, a list of token ids, or a list of either")
    if isinstance(value, list) and value and all(isinstance(v, (str, list)) for v in value):
        if len(value) > max_prompts:  # before parsing each one
            raise InvalidRequestError("prompt", f"has {len(value)} prompts; at most {max_prompts} are allowed")
        return [_prompt(v, f" (prompt {i} of the batch)" if len(value) > 1 else "") for i, v in enumerate(value)]
    return [_prompt(value, "")]


def _prompt(value: Any, where: str) -> str | list[int]:
    if isinstance(value, str):
        if not value:
            raise InvalidRequestError("prompt", f"must not be empty{where}")
        return _unicode("prompt", value)
    if not isinstance(value, list):
        raise InvalidRequestError("prompt", f"must be a string or a list of token ids, got {_json_type(value)}{where}")
    if not value:
        raise InvalidRequestError("prompt", f"must not be empty{where}")
    if not all(_is(t, int) and 0 <= t <= MAX_TOKEN_ID for t in value):
        raise InvalidRequestError("prompt", f"token ids must be integers in [0, {MAX_TOKEN_ID}]{where}")
    return list(value)


def _messages(value: Any, max_messages: int) -> list[dict]:
    if value is _MISSING or value is None:
        raise InvalidRequestError("messages", "is required: a non-empty list of messages")
    if not isinstance(value, list) or not value:
        raise InvalidRequestError("messages", "must be a non-empty list of {role, content} objects")
    if len(value) > max_messages:  # before parsing each one
        raise InvalidRequestError("messages", f"has {len(value)} messages; at most {max_messages} are allowed")
    return [_message(i, m) for i, m in enumerate(value)]


def _message(i: int, message: Any) -> dict:
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise InvalidRequestError(where, f"must be an object with role and content, got {_json_type(message)}")
    role = message.get("role")
    if role not in CHAT_ROLES:
        raise InvalidRequestError(f"{where}.role", f"must be one of {', '.join(CHAT_ROLES)}; got {role!r}")
    content = message.get("content")
    return history_message(where, message, role, None if content is None else _content(where + ".content", content))


def _content(where: str, content: Any) -> str:
    if isinstance(content, str):
        return _unicode(where, content)
    if not isinstance(content, list):
        raise InvalidRequestError(where, "must be a string or a list of {\"type\": \"text\", \"text\"} parts")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text":
            raise InvalidRequestError(f"{where}[{j}]", "only {\"type\": \"text\", \"text\": ...} parts are supported")
        if not isinstance(part.get("text"), str):
            raise InvalidRequestError(f"{where}[{j}].text", "must be a string")
        texts.append(_unicode(f"{where}[{j}].text", part["text"]))
    return "\n".join(texts)


def _response_format(value: Any) -> str | None:
    """`response_format` → `SamplingParams.json_schema`: None for text, the schema's JSON text for json_schema,
    {"type": "object"} for json_object; a schema the grammar library cannot compile is refused here."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidRequestError("response_format", f"must be an object, got {_json_type(value)}")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return JSON_OBJECT_SCHEMA
    if kind != "json_schema":
        raise InvalidRequestError("response_format", f"type must be \"text\", \"json_object\" or \"json_schema\", "
                                                     f"got {kind!r}")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise InvalidRequestError("response_format", "json_schema must be an object with the schema under \"schema\"")
    if spec.get("name") is not None and not isinstance(spec["name"], str):
        raise InvalidRequestError("response_format", "json_schema.name must be a string")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise InvalidRequestError("response_format", "json_schema.strict must be a boolean")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise InvalidRequestError("response_format", f"json_schema.schema must be a JSON Schema object, "
                                                     f"got {_json_type(schema)}")
    text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
    check_json_schema(text)
    return text


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise InvalidRequestError("stop", "must be a string or a list of strings")
    return tuple(_unicode("stop", s) for s in value)


def _int_field(body: dict, name: str, default: int) -> int:
    value = _typed(body, name, int, "an integer >= 1", default)
    if value < 1:
        raise InvalidRequestError(name, f"must be an integer >= 1, got {value}")
    return value


def _typed(body: dict, name: str, kind: type | tuple[type, ...], what: str, default: Any,
           field: str | None = None) -> Any:
    """body[name] if it is of JSON type `kind`, default when absent or null."""
    value = body.get(name)
    if value is None:
        return default
    if not _is(value, kind):
        raise InvalidRequestError(field or name, f"must be {what}, got {_json_type(value)}")
    return value


def _only_null_or(body: dict, name: str, allowed: tuple, message: str, kind: type | None = None) -> None:
    value = body.get(name)
    if value is None:
        return
    if kind is not None and not _is(value, kind):
        raise InvalidRequestError(name, f"{message} (got {_json_type(value)})")
    if not any(type(value) is type(a) and value == a for a in allowed):
        raise InvalidRequestError(name, message)


def _is(value: Any, kind: type | tuple[type, ...]) -> bool:
    """JSON type check: a boolean is not a number."""
    return isinstance(value, kind) and (kind is bool or not isinstance(value, bool))


# ---------------------------------------------------------------- responses


def openai_finish_reason(chunk: Chunk, request_id: str) -> str:
    """The chunk's finish reason in OpenAI's vocabulary; an aborted or otherwise ended request raises
    RequestFailed (reported to the client as an error, never as a normal finish)."""
    if chunk.finish_reason in FINISH_REASONS:
        return chunk.finish_reason
    if chunk.finish_reason == "abort":
        raise RequestFailed(f"request {request_id} was aborted", ErrorKind.ABORTED)
    raise RequestFailed(f"request {request_id} ended with {chunk.finish_reason!r}")


def usage_body(usage: Usage, timings: PhaseTimings | None) -> dict:
    """OpenAI's usage object plus our `pdserve_timings` (null when the router gave none)."""
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens, "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
            "pdserve_timings": timings.as_dict() if timings is not None else None}


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class LogprobsBuilder:
    """One request's logprobs objects in OpenAI's shapes, for the whole response or chunk by chunk
    (it keeps the running `text_offset`). `token_text(id)`: the string of one token id."""

    def __init__(self, chat: bool, token_text: Callable[[int], str]) -> None:
        self.chat = chat
        self._token_text = token_text
        self._texts: dict[int, str] = {}
        self._offset = 0

    def fresh(self) -> LogprobsBuilder:
        """A builder for another choice (its `text_offset` from 0), sharing the token texts seen."""
        other = LogprobsBuilder(self.chat, self._token_text)
        other._texts = self._texts
        return other

    def build(self, entries: Iterable[TokenLogprob]) -> dict:
        """The logprobs object of these tokens (the next ones of the request, in order)."""
        return self._chat(entries) if self.chat else self._completion(entries)

    def _text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._token_text(token_id)
        return text

    def _completion(self, entries: Iterable[TokenLogprob]) -> dict:
        body: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for e in entries:
            token = self._text(e.token_id)
            top: dict[str, float] = {}
            for tid, lp in (*zip(e.top_ids, e.top_logprobs), (e.token_id, e.logprob)):  # the chosen one too
                top.setdefault(self._text(tid), _finite(lp))
            body["tokens"].append(token)
            body["token_logprobs"].append(_finite(e.logprob))
            body["top_logprobs"].append(top)
            body["text_offset"].append(self._offset)
            self._offset += len(token)
        return body

    def _chat(self, entries: Iterable[TokenLogprob]) -> dict:
        return {"content": [{**self._chat_token(e.token_id, e.logprob),
                             "top_logprobs": [self._chat_token(t, lp) for t, lp in zip(e.top_ids, e.top_logprobs)]}
                            for e in entries]}

    def _chat_token(self, token_id: int, logprob: float) -> dict:
        text = self._text(token_id)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}


def _finite(logprob: float) -> float:
    return max(logprob, LOWEST_LOGPROB)


@dataclass(frozen=True)
class ChoiceOutput:
    """One finished choice of a non-streamed response: its index in `choices`, text, OpenAI finish
    reason, the logprobs of its tokens and its output's and prompt's token ids (each written only when
    the request asked for them)."""

    index: int
    text: str
    finish_reason: str
    logprobs: tuple[TokenLogprob, ...] = ()
    token_ids: tuple[int, ...] = ()
    prompt_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class ResponseBuilder:
    """Builds one request's response bodies (whole, or stream chunks) in OpenAI's shapes; with
    `logprobs` (the request asked for them) each choice carries its tokens' logprobs, with `token_ids`
    its output's and its prompt's token ids. Stream chunks are those of choice `index`: `for_choice(i)`
    gives the builder of another choice. With `tools` (chat), a choice's output becomes its message's
    `tool_calls` when it holds calls (`router.tool_calls`); its stream chunks go through the builder's own
    `ToolStream`."""

    chat: bool
    request_id: str
    model: str
    created: int
    include_usage: bool = False
    logprobs: LogprobsBuilder | None = None
    index: int = 0
    tools: ToolCalling | None = None
    token_ids: bool = False
    _tool_stream: ToolStream | None = field(init=False, default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.tools is not None and self.chat:  # a fresh one per builder: `replace` makes a new builder
            object.__setattr__(self, "_tool_stream", ToolStream(self.tools))

    def for_choice(self, index: int) -> ResponseBuilder:
        """The builder of choice `index`'s stream chunks (its logprobs offsets counted on their own)."""
        return replace(self, index=index, logprobs=self.logprobs.fresh() if self.logprobs is not None else None)

    def _head(self, chunked: bool) -> dict:
        prefix, obj = ("chatcmpl-", "chat.completion") if self.chat else ("cmpl-", "text_completion")
        if chunked and self.chat:
            obj = "chat.completion.chunk"
        return {"id": prefix + self.request_id, "object": obj, "created": self.created, "model": self.model}

    def full(self, text: str, finish_reason: str, usage: Usage, timings: PhaseTimings | None,
             logprobs: Iterable[TokenLogprob] = ()) -> dict:
        """The non-streamed response of one choice; `logprobs`: those of every output token, when asked."""
        return self.full_choices([ChoiceOutput(self.index, text, finish_reason, tuple(logprobs))], usage, timings)

    def full_choices(self, choices: Iterable[ChoiceOutput], usage: Usage, timings: PhaseTimings | None) -> dict:
        """The non-streamed response: these choices (in the order given), the request's usage and timings."""
        body: list[dict] = []
        head = self._head(False)
        for c in choices:
            lp = self.logprobs.fresh().build(c.logprobs) if self.logprobs is not None else None
            if self.chat and self.tools is not None:
                out = self.tools.extract(c.text, c.finish_reason)
                message = {"role": "assistant", "content": out.content}
                if out.calls:
                    message["tool_calls"] = [call.body() for call in out.calls]
                body.append({"index": c.index, "message": message, "finish_reason": out.finish_reason, "logprobs": lp})
            elif self.chat:
                body.append({"index": c.index, "message": {"role": "assistant", "content": c.text},
                             "finish_reason": c.finish_reason, "logprobs": lp})
            else:
                body.append({"text": c.text, "index": c.index, "logprobs": lp, "finish_reason": c.finish_reason})
            if self.token_ids:
                body[-1]["token_ids"] = list(c.token_ids)
                if self.chat:
                    head.setdefault("prompt_token_ids", list(c.prompt_token_ids))
                else:
                    body[-1]["prompt_token_ids"] = list(c.prompt_token_ids)
        return {**head, "choices": body, "usage": usage_body(usage, timings)}

    def start_events(self) -> list[dict]:
        """Stream events before any output: the chat role chunk."""
        return [self._chunk({"role": "assistant", "content": ""}, None)] if self.chat else []

    def chunk_events(self, chunk: Chunk, finish_reason: str | None, usage: Usage | None,
                     prompt_token_ids: list[int] | None = None) -> list[dict]:
        """Stream events for one router chunk; finish_reason (OpenAI's) on the last one only. With
        include_usage, `usage` (given) adds the usage chunk with the chunk's timings after the finishing
        one; without it, the timings go top-level on the finishing chunk. When the request asked for
        logprobs or token ids, a chunk with tokens is sent even while its text is held back; its ids ride
        its first event, with `prompt_token_ids` (given for the choice's first chunk)."""
        events = []
        lp = self.logprobs.build(chunk.logprobs) if self.logprobs is not None else None
        tokens = bool(chunk.token_ids) if self.token_ids else lp is not None and bool(chunk.logprobs)
        if self._tool_stream is not None:
            events += [self._chunk(delta, None) for delta in self._tool_stream.feed(chunk.text)]
            if finish_reason is not None:
                deltas, finish_reason = self._tool_stream.finish(finish_reason)
                events += [self._chunk(delta, None) for delta in deltas]
                events.append(self._chunk({}, finish_reason))
            if tokens:  # the chunk's tokens, content or call: on its first event, or on an empty delta
                if events:
                    events[0]["choices"][0]["logprobs"] = lp
                else:
                    events.append(self._chunk({}, None, lp))
        elif self.chat:
            if chunk.text or tokens:
                events.append(self._chunk({"content": chunk.text}, None, lp))
            if finish_reason is not None:
                events.append(self._chunk({}, finish_reason))
        elif chunk.text or tokens or finish_reason is not None:
            events.append(self._chunk(chunk.text, finish_reason, lp))
        if self.token_ids and events:
            self._add_token_ids(events, chunk.token_ids, prompt_token_ids)
        if finish_reason is not None:
            if self.include_usage:
                if usage is not None:
                    events.append(self.usage_event(usage, chunk.timings))
            elif chunk.timings is not None:
                events[-1]["pdserve_timings"] = chunk.timings.as_dict()
        return events

    def _add_token_ids(self, events: list[dict], token_ids: list[int], prompt_token_ids: list[int] | None) -> None:
        """The chunk's ids on its first event (the others carry none), the prompt's beside them when given."""
        for j, event in enumerate(events):
            event["choices"][0]["token_ids"] = list(token_ids) if j == 0 else []
        if prompt_token_ids is not None:
            (events[0] if self.chat else events[0]["choices"][0])["prompt_token_ids"] = list(prompt_token_ids)

    def usage_event(self, usage: Usage, timings: PhaseTimings | None) -> dict:
        """The stream's last event with include_usage: no choices, the request's usage and timings."""
        return {**self._head(True), "choices": [], "usage": usage_body(usage, timings)}

    def _chunk(self, delta: dict | str, finish_reason: str | None, logprobs: dict | None = None) -> dict:
        if self.chat:
            choice = {"index": self.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        else:
            choice = {"text": delta, "index": self.index, "logprobs": logprobs, "finish_reason": finish_reason}
        event = {**self._head(True), "choices": [choice]}
        if self.include_usage:
            event["usage"] = None
        return event


def final_usage(chunk: Chunk, prompt_tokens: int, completion_tokens: int) -> Usage:
    """The last chunk's usage, or one counted by the server when the router gave none."""
    return chunk.usage if chunk.usage is not None else Usage(prompt_tokens, completion_tokens)
