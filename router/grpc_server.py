"""The gRPC API (protos/pdserve/v1/pdserve.proto) on grpc.aio, in front of a `RouterAPI`.

Lifecycle of one Generate call:
0. With API keys: `ApiKeyInterceptor` wants metadata `authorization: Bearer <key>` or `x-api-key: <key>`
   (missing or wrong → UNAUTHENTICATED, before the request is even decoded). Messages larger than
   `max_message_bytes` (default 8 MiB) are refused by grpc itself with RESOURCE_EXHAUSTED; bytes that
   are not a valid message (corrupt wire format, strings that are not UTF-8) get INVALID_ARGUMENT
   (`MalformedRequestInterceptor`; grpc alone would answer UNKNOWN with the parser's exception).
1. Translate the proto request into a `GenerateRequest`: the oneof `input` becomes the prompt or
   chat messages, unset `sampling` fields take `SamplingParams`' defaults, empty strings mean unset;
   `sampling.response_format` becomes `SamplingParams.json_schema` as on HTTP (JSON_OBJECT: any object,
   JSON_SCHEMA: the schema's text), a schema the grammar library cannot compile refused naming response_format;
   `sampling.logit_bias` becomes `SamplingParams.logit_bias`. `SamplingParams` validates on construction;
   chat roles and the size limits of `router.limits.RequestLimits` (prompt characters, messages, stop
   strings and ids, `n` up to `max_choices`) are checked.
2. `n` choices (`choice_count`; unset: 1) are a fan-out as on HTTP (`router.choices`: one router request
   per choice, choice i seeded seed + i): `router.submit` validates, tokenizes and places each, or raises
   before anything runs (the ones already submitted are then aborted).
3. Relay each `Chunk` of the choices' `RequestStream`s, interleaved as they come, as a `GenerateResponse`
   (the first choice's request id on every one; the choice's `index`; its tokens' log-probabilities when
   `sampling.logprobs` asked; finish_reason, usage and timings on each choice's last).
4. Errors become status codes: invalid field → INVALID_ARGUMENT (message names the field), unknown
   model → NOT_FOUND, overload → RESOURCE_EXHAUSTED (+ trailing `retry-after-s`), a failed request →
   INTERNAL with its message (also mid-stream), anything else → INTERNAL "internal error (request id
   ...)" with the traceback in the server log only.
5. Always close the streams at the end: if the client cancelled or disconnected (the handler task is
   cancelled), or one choice failed, that aborts the requests still running on the workers; after a
   normal end it is a no-op.

The server also serves grpc.health.v1.Health (SERVING while `router.healthy()`, for "" and for the
generation service) and server reflection listing both services; both stay open when API keys are
set (probes and tooling need no secret), as does nothing else. Keys and metadata are never logged.
"""
from __future__ import annotations

import contextlib
import inspect
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from engine.errors import CapacityError, InvalidRequestError
from engine.grammar import JSON_OBJECT_SCHEMA, check_json_schema
from engine.logprobs import TokenLogprob
from engine.sampling_params import SamplingParams
from protos.pdserve.v1 import pdserve_pb2 as pb
from protos.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from router import choices
from router.auth import as_key_set, bearer_token, key_allowed
from router.limits import CLIENT_REQUEST_ID, DEFAULT_LIMITS, RequestLimits, check_limits
from router.openai_protocol import CHAT_ROLES, ParsedRequest
from router.tls import TlsFiles
from router.types import (
    ERROR_STATUS,
    Chunk,
    GenerateRequest,
    ModelNotFoundError,
    PhaseTimings,
    RequestFailed,
    RequestStream,
    RouterAPI,
    Usage,
)

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GenerationService"].full_name
# SamplingParams fields whose proto field is `optional`: unset takes the dataclass default.
_OPTIONAL_SAMPLING = ("max_tokens", "temperature", "top_p", "seed", "min_p", "presence_penalty", "frequency_penalty",
                      "repetition_penalty", "logprobs")
# Methods callable without an API key: health checks and reflection.
OPEN_METHOD_PREFIXES = (f"/{health.SERVICE_NAME}/", f"/{reflection.SERVICE_NAME}/",
                        "/grpc.reflection.v1.ServerReflection/")
DEFAULT_MAX_MESSAGE_BYTES = 8 << 20


def to_generate_request(msg: pb.GenerateRequest, limits: RequestLimits = DEFAULT_LIMITS) -> GenerateRequest:
    """Args: the proto request; the size limits. Returns: the router's request.
    Raises InvalidRequestError (names the field)."""
    kind = msg.WhichOneof("input")
    prompt: str | list[int] | None = None
    messages: list[dict] | None = None
    if kind == "text":
        prompt = msg.text
    elif kind == "token_ids":
        prompt = list(msg.token_ids.ids)
    elif kind == "chat":
        messages = _chat_messages(msg.chat, limits.max_messages)
    else:
        raise InvalidRequestError("input", "set exactly one of text, token_ids or chat")
    if msg.request_id and not CLIENT_REQUEST_ID.fullmatch(msg.request_id):
        raise InvalidRequestError("request_id", "must be 1-128 characters: letters, digits and . _ : - "
                                                "(or empty: the server mints one)")
    request = GenerateRequest(prompt=prompt, messages=messages, sampling=to_sampling_params(msg.sampling),
                              request_id=msg.request_id or None, model=msg.model or None,
                              max_tokens_default=not msg.sampling.HasField("max_tokens"))
    return check_limits(request, limits)


def _chat_messages(chat: pb.ChatMessages, max_messages: int) -> list[dict]:
    if not chat.messages:
        raise InvalidRequestError("messages", "must be a non-empty list of {role, content} messages")
    if len(chat.messages) > max_messages:
        raise InvalidRequestError("messages", f"has {len(chat.messages)} messages; at most {max_messages} "
                                              "are allowed")
    for i, m in enumerate(chat.messages):
        if m.role not in CHAT_ROLES:
            raise InvalidRequestError(f"messages[{i}].role", f"must be one of {', '.join(CHAT_ROLES)}; "
                                                             f"got {m.role[:40]!r}")
    return [{"role": m.role, "content": m.content} for m in chat.messages]


def to_sampling_params(msg: pb.SamplingParams) -> SamplingParams:
    """Args: the proto settings (unset optional fields → defaults). Returns: validated SamplingParams."""
    optional = {name: getattr(msg, name) for name in _OPTIONAL_SAMPLING if msg.HasField(name)}
    return SamplingParams(top_k=msg.top_k, stop=tuple(msg.stop), stop_token_ids=tuple(msg.stop_token_ids),
                          ignore_eos=msg.ignore_eos, min_tokens=msg.min_tokens,
                          logit_bias=tuple(msg.logit_bias.items()), json_schema=_json_schema(msg.response_format),
                          **optional)


def _json_schema(msg: pb.ResponseFormat) -> str | None:
    """`response_format` → `SamplingParams.json_schema` (None: plain text); the schema is compiled once
    here, so a bad one is refused before the request is placed."""
    if msg.type == pb.ResponseFormat.TEXT:
        if msg.json_schema:
            raise InvalidRequestError("response_format", "json_schema is for type JSON_SCHEMA only")
        return None
    if msg.type == pb.ResponseFormat.JSON_OBJECT:
        if msg.json_schema:
            raise InvalidRequestError("response_format", "json_schema is for type JSON_SCHEMA only")
        return JSON_OBJECT_SCHEMA
    if msg.type != pb.ResponseFormat.JSON_SCHEMA:
        raise InvalidRequestError("response_format", f"type must be TEXT, JSON_OBJECT or JSON_SCHEMA, got {msg.type}")
    if not msg.json_schema:
        raise InvalidRequestError("response_format", "type JSON_SCHEMA needs json_schema (JSON text of a schema)")
    text = SamplingParams(json_schema=msg.json_schema).json_schema  # checked: a JSON object, written compact
    check_json_schema(text)
    return text


def choice_count(msg: pb.GenerateRequest, limits: RequestLimits = DEFAULT_LIMITS) -> int:
    """`n`: the choices to generate, in [1, limits.max_choices] (0, the unset value: 1).
    Raises InvalidRequestError naming n."""
    if msg.n > limits.max_choices:
        raise InvalidRequestError("n", f"must be in [1, {limits.max_choices}] (choices of the prompt; 0 means 1), "
                                       f"got {msg.n}")
    return msg.n or 1


def to_response(request_id: str, chunk: Chunk, index: int = 0) -> pb.GenerateResponse:
    """Args: the request id, one chunk of its output and its choice's index. Returns: the proto response."""
    response = pb.GenerateResponse(request_id=request_id, text=chunk.text, token_ids=chunk.token_ids,
                                   finish_reason=chunk.finish_reason or "", index=index,
                                   logprobs=[_token_logprob(lp) for lp in chunk.logprobs])
    if chunk.usage is not None:
        response.usage.CopyFrom(_usage(chunk.usage))
    if chunk.timings is not None:
        response.timings.CopyFrom(_timings(chunk.timings))
    return response


def _token_logprob(lp: TokenLogprob) -> pb.TokenLogprob:
    return pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob,
                           top_logprobs=[pb.TopLogprob(token_id=t, logprob=v) for t, v in zip(lp.top_ids, lp.top_logprobs)])


def _usage(usage: Usage) -> pb.Usage:
    return pb.Usage(prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                    total_tokens=usage.total_tokens, cached_tokens=usage.cached_tokens)


def _timings(t: PhaseTimings) -> pb.PhaseTimings:
    return pb.PhaseTimings(path=t.path, prefill_worker=t.prefill_worker or "", decode_worker=t.decode_worker,
                           queue_s=t.queue_s, prefill_s=t.prefill_s, transfer_s=t.transfer_s,
                           decode_s=t.decode_s, ttft_s=t.ttft_s, e2e_s=t.e2e_s)


def error_status(exc: Exception, request_id: str) -> tuple[grpc.StatusCode, str, tuple[tuple[str, str], ...]]:
    """Args: an error raised while serving `request_id`. Returns: (status code, message, trailing metadata)."""
    if isinstance(exc, ModelNotFoundError):
        return grpc.StatusCode.NOT_FOUND, str(exc), ()
    if isinstance(exc, InvalidRequestError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc), ()
    if isinstance(exc, CapacityError):  # OverloadedError, or a bare CapacityError that got through
        retry_after_s = getattr(exc, "retry_after_s", 1.0)
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc), (("retry-after-s", f"{retry_after_s:g}"),)
    if isinstance(exc, RequestFailed):  # DeadlineExceeded too: its kind is DEADLINE
        return grpc.StatusCode[ERROR_STATUS[exc.kind].grpc], str(exc), ()
    log.error("request %s: unexpected error", request_id, exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"internal error (request id {request_id})", ()


class GenerationServicer(pb_grpc.GenerationServiceServicer):
    """pdserve.v1.GenerationService over a RouterAPI."""

    def __init__(self, router: RouterAPI, limits: RequestLimits = DEFAULT_LIMITS) -> None:
        self._router = router
        self._limits = limits

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        # Writes with context.write (not a generator) so a cancellation always lands in this coroutine.
        request_id = request.request_id or f"grpc-{uuid.uuid4().hex[:12]}"
        streams: list[RequestStream] = []
        try:
            generate = to_generate_request(request, self._limits)
            n = choice_count(request, self._limits)
            remaining = context.time_remaining()  # the client's gRPC deadline, if it set one
            if remaining is not None and generate.timeout_s is None:
                generate = replace(generate, timeout_s=max(1e-3, min(remaining, 1e7 - 1)))
            candidates = choices.plan(ParsedRequest(requests=(generate,), n=n), generate.request_id)
            streams = await choices.submit_all(self._router, candidates)
            request_id = streams[0].request_id
            async with contextlib.aclosing(choices.merge(streams)) as merged:
                async for k, chunk in merged:
                    await context.write(to_response(request_id, chunk, candidates[k].number))
        except Exception as exc:  # noqa: BLE001 - every error gets a status; CancelledError only runs the finally
            code, message, trailers = error_status(exc, request_id)
            await context.abort(code, message, trailing_metadata=trailers)
        finally:
            await choices.close_all(streams)

    async def ListModels(self, request: pb.ListModelsRequest,
                         context: grpc.aio.ServicerContext) -> pb.ListModelsResponse:
        cards = [pb.ModelCard(id=c.id, created=c.created, owned_by=c.owned_by, max_model_len=c.max_model_len)
                 for c in self._router.models()]
        return pb.ListModelsResponse(models=cards)


class RouterHealthServicer(health.aio.HealthServicer):
    """grpc.health.v1.Health: SERVING for "" and the generation service while `router.healthy()`."""

    def __init__(self, router: RouterAPI) -> None:
        super().__init__()
        self._router = router
        self._server_status[SERVICE_NAME] = health_pb2.HealthCheckResponse.SERVING

    async def Check(self, request: health_pb2.HealthCheckRequest,
                    context: grpc.aio.ServicerContext) -> health_pb2.HealthCheckResponse:
        await self.refresh()
        return await super().Check(request, context)

    async def refresh(self) -> None:
        """Set both statuses from `router.healthy()` (also wakes Watch callers on a change)."""
        healthy = self._router.healthy()
        status = health_pb2.HealthCheckResponse.SERVING if healthy else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in (health.OVERALL_HEALTH, SERVICE_NAME):
            if self._server_status.get(service) != status:
                await self.set(service, status)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without a valid key (UNAUTHENTICATED), except health and reflection.

    Accepts metadata `authorization: Bearer <key>` or `x-api-key: <key>`. A refused call's request
    is never decoded, and the status message never echoes what was sent.
    """

    def __init__(self, keys: frozenset[str]) -> None:
        assert keys, "an ApiKeyInterceptor without keys would refuse every call"
        self._keys = keys

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
            details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_METHOD_PREFIXES):
            return handler
        metadata = {}
        for key, value in details.invocation_metadata or ():
            metadata.setdefault(key.lower(), value)
        authorization, api_key = metadata.get("authorization"), metadata.get("x-api-key")
        token = bearer_token(authorization) if isinstance(authorization, str) else None
        if key_allowed(token, self._keys) or (isinstance(api_key, str) and key_allowed(api_key, self._keys)):
            return handler
        if authorization is None and api_key is None:
            message = "missing API key: send metadata 'authorization: Bearer <key>' or 'x-api-key: <key>'"
        else:
            message = "invalid API key (the key sent is not shown)"
        log.info("gRPC %s refused: %s", details.method, "no key" if authorization is None and api_key is None
                 else "wrong or malformed key")
        return _deny(handler, message)


class _Malformed:
    """What the tolerant deserializer hands on in place of a request it could not parse."""

    def __init__(self, error: DecodeError) -> None:
        self.message = f"request: not a valid protobuf message: {error}"


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    """Answers INVALID_ARGUMENT (not UNKNOWN) to a unary request whose bytes do not parse."""

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
            details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        behavior = handler.unary_stream if handler.response_streaming else handler.unary_unary
        if not (inspect.isasyncgenfunction(behavior) or inspect.iscoroutinefunction(behavior)):
            return handler  # a sync handler: grpc's own error handling
        parse = handler.request_deserializer

        def tolerant(data: bytes) -> object:
            try:
                return parse(data)
            except DecodeError as exc:
                return _Malformed(exc)

        if handler.response_streaming:
            return handler._replace(request_deserializer=tolerant, unary_stream=_checked(behavior))
        return handler._replace(request_deserializer=tolerant, unary_unary=_checked(behavior))


def _checked(behavior: Callable) -> Callable:
    """`behavior` (async), aborting with INVALID_ARGUMENT first when the request did not parse; same kind."""
    if inspect.isasyncgenfunction(behavior):
        async def stream(request: object, context: grpc.aio.ServicerContext) -> AsyncIterator[object]:
            if isinstance(request, _Malformed):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
            async for response in behavior(request, context):
                yield response
        return stream

    async def call(request: object, context: grpc.aio.ServicerContext) -> object:
        if isinstance(request, _Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        return await behavior(request, context)
    return call


def _deny(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that aborts with UNAUTHENTICATED without decoding the request."""
    async def deny(request: object, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(deny)
    return grpc.unary_unary_rpc_method_handler(deny)


async def start_grpc_server(router: RouterAPI, host: str, port: int, *, api_keys: frozenset[str] = frozenset(),
                            max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, limits: RequestLimits = DEFAULT_LIMITS,
                            tls: TlsFiles | None = None) -> tuple[grpc.aio.Server, int]:
    """Start the gRPC API; stop it with `await server.stop(grace_s)`.

    Args:
        router: the router core the calls go to.
        host: address to listen on ("0.0.0.0" for all IPv4 interfaces, "127.0.0.1" for local only).
        port: TCP port; 0 picks a free one.
        api_keys: when non-empty, every call but health and reflection needs one of them.
        max_message_bytes: larger request messages are refused with RESOURCE_EXHAUSTED.
        limits: size limits on prompts, messages and stop lists (over → INVALID_ARGUMENT).
        tls: serve over TLS with this certificate and key; None: plaintext.
    Returns:
        (the started server, the port it is bound to).
    Raises:
        ValueError (naming the flag) for TLS files that do not load; OSError when the port is taken.
    """
    credentials = None
    if tls is not None:
        tls.http_context()  # the same check as HTTPS: grpc itself reports a bad PEM only at the first handshake
        credentials = tls.grpc_credentials()
    keys = as_key_set(api_keys)
    interceptors = [ApiKeyInterceptor(keys)] if keys else []  # outermost first: no key, nothing is parsed
    server = grpc.aio.server(interceptors=[*interceptors, MalformedRequestInterceptor()],
                             options=[("grpc.max_receive_message_length", max_message_bytes)])
    pb_grpc.add_GenerationServiceServicer_to_server(GenerationServicer(router, limits), server)
    health_servicer = RouterHealthServicer(router)
    await health_servicer.refresh()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        bound = server.add_insecure_port(address) if credentials is None else server.add_secure_port(address, credentials)
    except RuntimeError as exc:  # grpc raises when the address is taken or invalid
        raise OSError(f"gRPC server cannot listen on {address}: {exc}") from exc
    if bound == 0:
        raise OSError(f"gRPC server cannot listen on {address}")
    await server.start()
    log.info("gRPC API (%s) listening on %s", SERVICE_NAME, f"{host}:{bound}")
    return server, bound
