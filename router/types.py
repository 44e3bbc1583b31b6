"""What the API servers (HTTP, gRPC) and the router core exchange: requests, stream chunks, errors.

The servers translate their wire format into a `GenerateRequest`, call `Router.submit`, which
validates and places the request (raising one of the errors below before anything streams), then
relay the `Chunk`s of the returned `RequestStream`. Closing the stream early aborts the request.
"""
from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from engine.errors import CapacityError, InvalidRequestError
from engine.logprobs import TokenLogprob
from engine.sampling_params import SamplingParams
from router.split import RoleSplit
from router.tool_calls import Tool
from worker_core.protocol import ErrorKind, WorkerInfo


class ModelNotFoundError(InvalidRequestError):
    """The request names a model this server does not serve (HTTP 404, gRPC NOT_FOUND)."""

    def __init__(self, model: str, served: str) -> None:
        super().__init__("model", f"the model {model!r} does not exist here; this server serves {served!r}")


class OverloadedError(CapacityError):
    """No worker can take the request now (HTTP 429, gRPC RESOURCE_EXHAUSTED). `retry_after_s`: a hint."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class RequestFailed(RuntimeError):
    """A request ended with an error on a worker (e.g. a lost KV transfer). The message is safe to show;
    `kind` decides the status a client gets (`ERROR_STATUS`)."""

    def __init__(self, message: str, kind: ErrorKind = ErrorKind.INTERNAL) -> None:
        super().__init__(message)
        self.kind = kind


class DeadlineExceeded(RequestFailed):
    """The request's own deadline (`timeout_s`) passed first; it was aborted everywhere."""

    def __init__(self, message: str) -> None:
        super().__init__(message, ErrorKind.DEADLINE)


@dataclass(frozen=True)
class ErrorStatus:
    """What a client gets for a failed request: HTTP status, OpenAI error type / code / param, and the
    gRPC status code (by name, so this module needs no grpc)."""

    http: int
    type: str
    grpc: str
    code: str | None = None
    param: str | None = None


# One entry per error kind, used by both API servers.
ERROR_STATUS: dict[ErrorKind, ErrorStatus] = {
    ErrorKind.TRANSFER_FAILED: ErrorStatus(503, "server_error", "UNAVAILABLE", "kv_transfer_failed"),
    ErrorKind.PREFILL_FAILED: ErrorStatus(503, "server_error", "UNAVAILABLE", "prefill_failed"),
    ErrorKind.WORKER_STOPPING: ErrorStatus(503, "server_error", "UNAVAILABLE", "worker_stopping"),
    ErrorKind.DEADLINE: ErrorStatus(408, "timeout_error", "DEADLINE_EXCEEDED", "request_timeout", "timeout"),
    ErrorKind.INVALID: ErrorStatus(400, "invalid_request_error", "INVALID_ARGUMENT"),
    ErrorKind.ABORTED: ErrorStatus(499, "server_error", "CANCELLED", "request_aborted"),
    ErrorKind.INTERNAL: ErrorStatus(500, "server_error", "INTERNAL"),
}
assert set(ERROR_STATUS) == set(ErrorKind), "every error kind needs its status"


@dataclass(frozen=True)
class GenerateRequest:
    """One generation request, whichever API it came through.

    Args:
        prompt: text (tokenized as is) or token ids. Exactly one of prompt / messages.
        messages: chat messages [{"role": ..., "content": ...}], rendered with the model's chat template.
        sampling: sampling and stop settings (already validated on construction).
        request_id: the client's id for logs; the router mints its own when None.
        model: the model the client asked for; None means the served one.
        max_tokens_default: the client gave no max_tokens: the router uses its default, cut to the
            room left in the context (`sampling.max_tokens` is then ignored).
        timeout_s: the request's deadline in seconds from arrival (queueing included); None: none.
        tools: functions the chat template shows the model (`router.tool_calls`); with messages only.
    """

    prompt: str | list[int] | None = None
    messages: list[dict] | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    request_id: str | None = None
    model: str | None = None
    max_tokens_default: bool = False
    timeout_s: float | None = None
    tools: tuple[Tool, ...] = ()

    def __post_init__(self) -> None:
        if self.timeout_s is not None and not (isinstance(self.timeout_s, (int, float)) and 0 < self.timeout_s < 1e7):
            raise InvalidRequestError("timeout", f"must be a number of seconds in (0, 1e7), got {self.timeout_s!r}")


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class PhaseTimings:
    """Where one request's time went, in seconds, measured by the router (prefill_s / transfer_s by workers).

    path: "remote" (prefill worker + KV transfer) or "local" (prefill on the decode worker).
    queue_s: from arrival until a worker started on it; prefill_s: prompt pass until the first token;
    transfer_s: KV still in flight after prefill (remote only); decode_s: first token to last;
    ttft_s: arrival to first token at the router; e2e_s: arrival to the last token.
    """

    path: str
    prefill_worker: str | None
    decode_worker: str
    queue_s: float = 0.0
    prefill_s: float = 0.0
    transfer_s: float = 0.0
    decode_s: float = 0.0
    ttft_s: float = 0.0
    e2e_s: float = 0.0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class Chunk:
    """A piece of a request's output.

    text: new text (text that may still turn into a stop string is held back until it cannot);
    token_ids: new token ids; finish_reason: None until the last chunk, then "stop", "length" or
    "abort"; usage and timings: set on the last chunk only; logprobs: one per token of token_ids,
    in order, when the request asked (`SamplingParams.logprobs`), else empty. They follow the tokens,
    not the text: a chunk whose text is held back still carries its tokens' logprobs.
    """

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    usage: Usage | None = None
    timings: PhaseTimings | None = None
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class Runtime:
    """How the workers run the model: dtype (and why it was chosen), decode attention kernel,
    whether decode steps are compiled, and which linear layers are packed."""

    dtype: str
    dtype_reason: str
    attention: str
    compiled: bool
    linear: str

    @classmethod
    def from_info(cls, info: WorkerInfo, dtype_reason: str | None = None) -> Runtime:
        """From a worker's `info()`; `dtype_reason` from another worker (the one that chose the dtype)."""
        return cls(info.dtype, dtype_reason or info.dtype_reason, info.attention, info.compiled, info.linear)

    def summary(self) -> str:
        """One line for logs and `pdserve status`: dtype, attention kernel, linear layers, compiled or eager."""
        return f"{self.dtype}, {self.attention}, linear {self.linear}, {'compiled' if self.compiled else 'eager'}"


@dataclass(frozen=True)
class ModelCard:
    id: str
    created: int
    owned_by: str
    max_model_len: int
    runtime: Runtime | None = None


class RequestStream(Protocol):
    """An admitted request's output. Iterate for chunks; `aclose()` before the end aborts it everywhere.
    prompt_token_ids: the prompt as the model runs it (tokenized, the chat template applied)."""

    request_id: str
    prompt_tokens: int
    prompt_token_ids: tuple[int, ...]

    def __aiter__(self) -> AsyncIterator[Chunk]: ...

    async def aclose(self) -> None: ...


class RouterAPI(Protocol):
    """What the HTTP and gRPC servers need from the router."""

    model_name: str
    max_model_len: int

    async def submit(self, request: GenerateRequest) -> RequestStream:
        """Validate, tokenize and place a request. Raises InvalidRequestError (names the field),
        ModelNotFoundError or OverloadedError before anything runs."""
        ...

    def models(self) -> list[ModelCard]: ...

    def tokenize(self, request: GenerateRequest) -> list[int]:
        """The token ids `submit` would run for this prompt or chat (the chat template applied).
        Raises InvalidRequestError (names the field) or ModelNotFoundError."""
        ...

    def detokenize(self, token_ids: list[int], model: str | None) -> str:
        """The text of these token ids. Raises InvalidRequestError or ModelNotFoundError."""
        ...

    def healthy(self) -> bool: ...

    def cost_model(self) -> dict:
        """The calibrated cost model, as `CostModel.to_dict()`."""
        ...

    def metrics_text(self) -> tuple[bytes, str]:
        """Prometheus exposition: (body, content type)."""
        ...

    def split(self) -> RoleSplit:
        """The role split now (`router.split`)."""
        ...

    def set_split(self, prefill: int | None) -> RoleSplit:
        """Pin `prefill` prefill workers to the prefill role (None: automatic flips again). Returns the split
        now. Raises SplitUnavailable (the server flips no roles) or InvalidRequestError naming `prefill`."""
        ...
