"""Size limits on one generation request, shared by the HTTP and gRPC APIs.

They bound what a single request can make the router do before the context-length check
(tokenizing megabytes of text, matching hundreds of stop strings on every token, fanning one HTTP
request out into hundreds of sequences). Bytes on the wire are bounded separately: the HTTP body
limit (413) and gRPC's max receive message size (RESOURCE_EXHAUSTED). A request over a limit is
refused with `InvalidRequestError` naming the field (HTTP 400, gRPC INVALID_ARGUMENT).

A client's request id (HTTP `X-Request-Id`, gRPC `request_id`) goes into every log line and back to
the client, so it must match `CLIENT_REQUEST_ID`: 1-128 letters, digits and `._:-`.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from engine.errors import InvalidRequestError
from router.types import GenerateRequest


@dataclass(frozen=True)
class RequestLimits:
    """Args:
        max_prompt_chars: characters of prompt text (all prompts of a batch together), or of all chat
            message contents together.
        max_messages: chat messages per request.
        max_stop: stop strings per request (OpenAI allows 4).
        max_stop_token_ids: stop token ids per request.
        max_choices: OpenAI's `n` and `best_of`: sequences generated per prompt, each its own request
            at the router (HTTP `n` and `best_of`, gRPC `n`).
        max_prompts: prompts in one batched completions request (`prompt` as a list of prompts). A
            request runs at most max_prompts * max_choices sequences.
    """

    max_prompt_chars: int = 1_000_000
    max_messages: int = 1024
    max_stop: int = 4
    max_stop_token_ids: int = 64
    max_choices: int = 16
    max_prompts: int = 16

    def __post_init__(self) -> None:
        for name, value in self.__dict__.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"RequestLimits.{name} must be an integer >= 1, got {value!r}")


DEFAULT_LIMITS = RequestLimits()
CLIENT_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def check_limits(request: GenerateRequest, limits: RequestLimits = DEFAULT_LIMITS) -> GenerateRequest:
    """Args: a parsed request. Returns: the same request. Raises: InvalidRequestError naming the field."""
    if isinstance(request.prompt, str) and len(request.prompt) > limits.max_prompt_chars:
        raise InvalidRequestError("prompt", f"has {len(request.prompt)} characters; at most "
                                            f"{limits.max_prompt_chars} are allowed")
    if request.messages is not None:
        if len(request.messages) > limits.max_messages:
            raise InvalidRequestError("messages", f"has {len(request.messages)} messages; at most "
                                                  f"{limits.max_messages} are allowed")
        chars = sum(_message_chars(m) for m in request.messages) + \
            sum(len(t.name) + len(t.parameters) + len(t.description or "") for t in request.tools)
        if chars > limits.max_prompt_chars:
            raise InvalidRequestError("messages", f"have {chars} characters of content together (tool calls and "
                                                  f"tools included); at most {limits.max_prompt_chars} are allowed")
    sampling = request.sampling
    if len(sampling.stop) > limits.max_stop:
        raise InvalidRequestError("stop", f"at most {limits.max_stop} stop sequences are allowed, "
                                          f"got {len(sampling.stop)}")
    if len(sampling.stop_token_ids) > limits.max_stop_token_ids:
        raise InvalidRequestError("stop_token_ids", f"at most {limits.max_stop_token_ids} stop token ids are "
                                                    f"allowed, got {len(sampling.stop_token_ids)}")
    return request


def _message_chars(message: dict) -> int:
    """A chat message's characters: its content, its tool_call_id, and its tool calls' ids, names and
    arguments (as JSON, characters as they are)."""
    calls = message.get("tool_calls") or ()
    return len(message.get("content") or "") + len(message.get("tool_call_id") or "") + \
        sum(len(c.get("id") or "") + len(c["function"]["name"]) +
            len(json.dumps(c["function"]["arguments"], ensure_ascii=False)) for c in calls)
