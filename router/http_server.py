"""The OpenAI-compatible HTTP API on aiohttp, in front of a `RouterAPI`.

Lifecycle of one POST /v1/completions or /v1/chat/completions:
1. The error middleware gives the request a log id (the client's `X-Request-Id` when valid) and,
   when the server has API keys, checks `Authorization: Bearer <key>` (missing or wrong → 401).
2. Read the body (over `max_body_bytes` → 413) and decode it as strict JSON (no NaN/Infinity).
3. `openai_protocol` parses it into a `GenerateRequest` (invalid field, or over a size limit of
   `router.limits.RequestLimits` → 400 naming it).
4. `router.submit` validates, tokenizes and places it, or raises before anything runs
   (unknown model → 404, overload → 429 + Retry-After, invalid → 400). Several choices (`n`,
   `best_of`, a batch of prompts) are one request per sequence, submitted in turn (`router.choices`);
   when one is refused, those already submitted are closed and the client gets that error.
5. Non-streamed: collect the chunks of every choice, answer one JSON body. Streamed (`stream: true`):
   send server-sent events `data: {...}\\n\\n`, one or two per chunk (the choices' chunks
   interleaved as they come, each with its index and its own finish_reason chunk), then with
   include_usage one usage chunk, then `data: [DONE]\\n\\n`. A failure after the first event (of any
   choice) becomes `data: {"error": {...}}` followed by `data: [DONE]`. Logprobs, when asked, go with
   their tokens (`openai_protocol.LogprobsBuilder`; token strings from the router's tokenizer).
6. Always close every stream at the end: on a client disconnect (write fails, or the handler is
   cancelled), an error (of any choice) or any other early exit this aborts the requests everywhere;
   after a normal end it is a no-op.

Errors are always `{"error": {"message", "type", "param", "code"}}`:

| cause                                | status | type                  | code                |
|--------------------------------------|--------|-----------------------|---------------------|
| malformed JSON, invalid field        | 400    | invalid_request_error | null (param: field) |
| API key missing or wrong             | 401    | invalid_request_error | invalid_api_key     |
| unknown model                        | 404    | invalid_request_error | model_not_found     |
| role split without role flips        | 409    | invalid_request_error | split_unavailable   |
| unknown route                        | 404    | invalid_request_error | null                |
| wrong method                         | 405    | invalid_request_error | null (+ Allow)      |
| body too large                       | 413    | invalid_request_error | null                |
| OverloadedError / CapacityError      | 429    | server_overloaded     | rate_limit_exceeded |
| RequestFailed (DeadlineExceeded too) | by its kind: `router.types.ERROR_STATUS` (408 timeout,    |
|                                      | 503 transfer / prefill failed or worker stopping, 500 ...)|
| anything else                        | 500    | server_error          | null                |

429 carries `Retry-After` (whole seconds) and `retry-after-ms`, which the openai SDKs honour when
they retry; clients key off the status, the type is informational. Tracebacks go to the log only.

Besides the OpenAI routes: POST /tokenize and /detokenize (the model's tokenizer, the chat template
applied as for a request), GET /version, GET and POST /ping (the same answer as /health), GET
/pdserve/cost_model, and the role split (`router.split`): GET /pdserve/split reads it, POST
`{"prefill": N}` pins it (null, or DELETE, makes flips automatic again); each answers the split
then, as `RoleSplit.to_json`.

API keys (`api_keys`, see `router.auth`): when non-empty, every route needs one except GET /health
and /ping (liveness probes) and GET /metrics (so Prometheus scrapes without a secret; it exposes
aggregate counters and worker load only, no prompts or keys; keep the port off the public network,
or set `protect_metrics`). Unknown routes need a key too (401 before 404). A 401
never echoes what was sent. Keys and the Authorization header are never logged: the access log
format (`ACCESS_LOG_FORMAT`) writes the request line, status, size, Referer and User-Agent only.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import json
import logging
import math
import time
import uuid
from collections.abc import Callable
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler

from engine.errors import CapacityError, InvalidRequestError
from router import choices
from router.auth import as_key_set, bearer_token, key_allowed
from router.limits import CLIENT_REQUEST_ID, DEFAULT_LIMITS, RequestLimits
from router.openai_protocol import (
    ChoiceOutput,
    LogprobsBuilder,
    ParsedRequest,
    ResponseBuilder,
    error_body,
    openai_finish_reason,
    parse_chat_request,
    parse_completion_request,
    parse_detokenize_request,
    parse_tokenize_request,
)
from router.split import SplitUnavailable, parse_split_body
from router.tls import TlsFiles
from router.types import ERROR_STATUS, ModelNotFoundError, RequestFailed, RequestStream, RouterAPI

log = logging.getLogger(__name__)

ROUTER_KEY = web.AppKey("pdserve_router", object)
MAX_BODY_KEY = web.AppKey("pdserve_max_body_bytes", int)
API_KEYS_KEY = web.AppKey("pdserve_api_keys", frozenset)
LIMITS_KEY = web.AppKey("pdserve_limits", RequestLimits)
OPEN_KEY = web.AppKey("pdserve_open_routes", frozenset)
OPEN_ROUTES = frozenset({"/health", "/ping", "/metrics"})  # served without an API key (/metrics: unless protect_metrics)
# aiohttp's default access log format, pinned: no header but Referer and User-Agent is ever logged.
ACCESS_LOG_FORMAT = '%a %t "%r" %s %b "%{Referer}i" "%{User-Agent}i"'
_LOG_ID = web.RequestKey("pdserve_log_id", str)
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
_DONE = b"data: [DONE]\n\n"
_VERSION = importlib.metadata.version("pdserve")


def build_app(router: RouterAPI, max_body_bytes: int = 4 << 20, *, api_keys: frozenset[str] = frozenset(),
              limits: RequestLimits = DEFAULT_LIMITS, protect_metrics: bool = False) -> web.Application:
    """Args:
        router: the router core.
        max_body_bytes: larger request bodies get 413.
        api_keys: when non-empty, every route but /health and /metrics needs `Authorization: Bearer <key>`.
        limits: size limits on prompts, messages and stop lists (over → 400).
        protect_metrics: /metrics needs a key too (when there are keys).
    Returns: the aiohttp app."""
    app = web.Application(middlewares=[error_middleware], client_max_size=max_body_bytes)
    app[ROUTER_KEY] = router
    app[MAX_BODY_KEY] = max_body_bytes
    app[API_KEYS_KEY] = as_key_set(api_keys)
    app[LIMITS_KEY] = limits
    app[OPEN_KEY] = OPEN_ROUTES - {"/metrics"} if protect_metrics else OPEN_ROUTES
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/pdserve/cost_model", cost_model)
    app.router.add_get("/pdserve/split", get_split)
    app.router.add_post("/pdserve/split", set_split)
    app.router.add_delete("/pdserve/split", release_split)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/version", version)
    app.router.add_get("/ping", health)
    app.router.add_post("/ping", health)
    return app


async def start_http_server(router: RouterAPI, host: str, port: int, *, api_keys: frozenset[str] = frozenset(),
                            max_body_bytes: int = 4 << 20, limits: RequestLimits = DEFAULT_LIMITS,
                            tls: TlsFiles | None = None, protect_metrics: bool = False) -> tuple[web.AppRunner, int]:
    """Serve on host:port (0 picks a free port), HTTPS with `tls`; api_keys, max_body_bytes, limits,
    protect_metrics: as `build_app`. Returns: (runner — `await runner.cleanup()` stops it, the bound
    port). Handlers are cancelled when their client disconnects, which aborts the request.
    Raises ValueError (naming the flag) for TLS files that do not load."""
    context = tls.http_context() if tls is not None else None
    app = build_app(router, max_body_bytes, api_keys=api_keys, limits=limits, protect_metrics=protect_metrics)
    runner = web.AppRunner(app, handler_cancellation=True, access_log_format=ACCESS_LOG_FORMAT)
    await runner.setup()
    await web.TCPSite(runner, host, port, ssl_context=context).start()
    return runner, runner.addresses[0][1]


# ---------------------------------------------------------------- routes


async def completions(request: web.Request) -> web.StreamResponse:
    parsed = parse_completion_request(await _read_json(request), limits=request.app[LIMITS_KEY])
    return await _generate(request, parsed, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    parsed = parse_chat_request(await _read_json(request), limits=request.app[LIMITS_KEY])
    return await _generate(request, parsed, chat=True)


async def models(request: web.Request) -> web.Response:
    cards = [{"id": c.id, "object": "model", "created": c.created, "owned_by": c.owned_by,
              "max_model_len": c.max_model_len,
              **({"pdserve_runtime": dataclasses.asdict(c.runtime)} if c.runtime else {})}  # how the workers run it
             for c in _router(request).models()]
    return web.json_response({"object": "list", "data": cards})


async def cost_model(request: web.Request) -> web.Response:
    """The cost model calibrated at start-up (pdserve's extension; `pdserve bench phases` reads it)."""
    return web.json_response(_router(request).cost_model())


async def get_split(request: web.Request) -> web.Response:
    """The role split now (pdserve's extension, `router.split`)."""
    return web.json_response(_router(request).split().to_json())


async def set_split(request: web.Request) -> web.Response:
    """Pin the role split, `{"prefill": N}` (null: automatic flips again); answers the split now."""
    prefill = parse_split_body(await _read_json(request))
    return web.json_response(_router(request).set_split(prefill).to_json())


async def release_split(request: web.Request) -> web.Response:
    """Automatic flips again; answers the split now."""
    return web.json_response(_router(request).set_split(None).to_json())


async def tokenize(request: web.Request) -> web.Response:
    """The token ids a prompt (or a chat, through the model's chat template) runs as."""
    parsed = parse_tokenize_request(await _read_json(request), limits=request.app[LIMITS_KEY])
    router = _router(request)
    tokens = router.tokenize(parsed)
    return web.json_response({"count": len(tokens), "max_model_len": router.max_model_len, "tokens": tokens})


async def detokenize(request: web.Request) -> web.Response:
    token_ids, model = parse_detokenize_request(await _read_json(request))
    return web.json_response({"prompt": _router(request).detokenize(token_ids, model)})


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": _VERSION})


async def health(request: web.Request) -> web.Response:
    if _router(request).healthy():
        return web.json_response({"status": "ok"})
    return web.json_response({"status": "unhealthy"}, status=503)


async def metrics(request: web.Request) -> web.Response:
    body, content_type = _router(request).metrics_text()
    return web.Response(body=body, headers={"Content-Type": content_type})


# ---------------------------------------------------------------- generation


async def _generate(request: web.Request, parsed: ParsedRequest, chat: bool) -> web.StreamResponse:
    router = _router(request)
    candidates = choices.plan(parsed, _client_request_id(request))
    streams = await choices.submit_all(router, candidates)
    try:
        request[_LOG_ID] = streams[0].request_id
        echo = _echo_texts(router, parsed) if parsed.echo else None
        first = parsed.request
        logprobs = LogprobsBuilder(chat, _token_text(router)) if first.sampling.logprobs is not None else None
        builder = ResponseBuilder(chat=chat, request_id=streams[0].request_id, model=first.model or router.model_name,
                                  created=int(time.time()), include_usage=parsed.include_usage, logprobs=logprobs,
                                  tools=parsed.tools, token_ids=parsed.return_token_ids)
        outputs = [choices.SequenceOutput(c, s.prompt_tokens) for c, s in zip(candidates, streams, strict=True)]
        if parsed.stream:
            return await _stream(request, streams, outputs, builder, parsed.n, echo)
        return await _collect(streams, outputs, builder, parsed, echo)
    finally:
        await choices.close_all(streams)


def _token_text(router: RouterAPI) -> Callable[[int], str]:
    """The string of one token id in logprobs: the tokenizer's decode of it alone; `token_id:<id>` for
    a model served without a tokenizer."""
    def text(token_id: int) -> str:
        try:
            return router.detokenize([token_id], None)
        except InvalidRequestError:
            return f"token_id:{token_id}"
    return text


def _echo_texts(router: RouterAPI, parsed: ParsedRequest) -> list[str]:
    """echo: each prompt's text as the client sent it (a prompt of token ids: their decoded text)."""
    texts = []
    for r in parsed.requests:
        if isinstance(r.prompt, str):
            texts.append(r.prompt)
            continue
        try:
            texts.append(router.detokenize(list(r.prompt or []), r.model))
        except InvalidRequestError as exc:
            raise InvalidRequestError("echo", f"cannot echo a prompt of token ids here ({exc})") from None
    return texts


async def _collect(streams: list[RequestStream], outputs: list[choices.SequenceOutput], builder: ResponseBuilder,
                   parsed: ParsedRequest, echo: list[str] | None) -> web.Response:
    async with contextlib.aclosing(choices.merge(streams)) as merged:
        async for k, chunk in merged:
            outputs[k].add(chunk)
            if chunk.finish_reason is not None:
                outputs[k].finish(openai_finish_reason(chunk, streams[k].request_id), chunk)
    chosen = choices.choose(outputs, parsed.n, parsed.ranked)
    prompts = {o.candidate.prompt_index: s.prompt_token_ids
               for o, s in zip(outputs, streams, strict=True)} if builder.token_ids else {}
    body = builder.full_choices(
        [ChoiceOutput(i, (echo[o.candidate.prompt_index] if echo else "") + o.text, o.finish_reason or "",
                      tuple(o.logprobs), tuple(o.token_ids), prompts.get(o.candidate.prompt_index, ()))
         for i, o in chosen],
        choices.total_usage(outputs), chosen[0][1].timings)
    return web.json_response(body, headers={"X-Request-Id": streams[0].request_id})


async def _stream(request: web.Request, streams: list[RequestStream], outputs: list[choices.SequenceOutput],
                  builder: ResponseBuilder, n: int, echo: list[str] | None) -> web.StreamResponse:
    rid = streams[0].request_id
    response = web.StreamResponse(headers={**_SSE_HEADERS, "X-Request-Id": rid})
    await response.prepare(request)
    try:
        try:
            await _relay(response, streams, outputs, builder, n, echo)
        except ConnectionResetError:
            raise
        except Exception as exc:  # noqa: BLE001 - reported in-band: the 200 status is already sent
            await _send(response, _error(exc, rid)[1])
        await response.write(_DONE)
        await response.write_eof()
    except ConnectionResetError:
        log.info("request %s: client disconnected mid-stream; aborting", rid)
    return response


async def _relay(response: web.StreamResponse, streams: list[RequestStream], outputs: list[choices.SequenceOutput],
                 builder: ResponseBuilder, n: int, echo: list[str] | None) -> None:
    """The choices' chunks as they come, each with its index; then, with include_usage, one usage chunk
    (every choice counted; the timings of choice 0). Streamed, best_of equals n: every sequence is a choice."""
    builders = [builder.for_choice(o.candidate.prompt_index * n + o.candidate.number) for o in outputs]
    for b in builders:
        for event in b.start_events():
            await _send(response, event)
    echoed = [echo is None] * len(streams)
    prompts: list[list[int] | None] = [list(s.prompt_token_ids) if builder.token_ids else None for s in streams]
    async with contextlib.aclosing(choices.merge(streams)) as merged:
        async for k, chunk in merged:
            out = outputs[k]
            out.add(chunk)
            if not echoed[k]:  # the prompt goes first, in the choice's first chunk
                chunk = dataclasses.replace(chunk, text=echo[out.candidate.prompt_index] + chunk.text)
                echoed[k] = True
            finish = None
            if chunk.finish_reason is not None:
                finish = openai_finish_reason(chunk, streams[k].request_id)
                out.finish(finish, chunk)
            events = builders[k].chunk_events(chunk, finish, None, prompts[k])
            if events:  # the prompt's ids ride the choice's first event
                prompts[k] = None
            for event in events:
                await _send(response, event)
    if builder.include_usage:
        await _send(response, builder.usage_event(choices.total_usage(outputs), outputs[0].timings))


async def _send(response: web.StreamResponse, event: dict) -> None:
    await response.write(b"data: " + json.dumps(event, ensure_ascii=False).encode() + b"\n\n")


# ---------------------------------------------------------------- input


async def _read_json(request: web.Request) -> Any:
    raw = await request.read()
    try:
        return json.loads(raw, parse_constant=_reject_constant, parse_float=_finite_float)
    except (ValueError, RecursionError) as exc:
        raise InvalidRequestError("body", f"is not valid JSON: {exc}") from None


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text} is out of range")
    return value


def _client_request_id(request: web.Request) -> str | None:
    value = request.headers.get("X-Request-Id", "")
    return value if CLIENT_REQUEST_ID.fullmatch(value) else None


def _router(request: web.Request) -> RouterAPI:
    return request.app[ROUTER_KEY]  # type: ignore[return-value]


# ---------------------------------------------------------------- errors


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Turns every exception into OpenAI's error shape; the traceback of unexpected ones goes to the log."""
    request[_LOG_ID] = _client_request_id(request) or uuid.uuid4().hex[:16]
    denied = _check_api_key(request)
    if denied is not None:
        return denied
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _http_error(request, exc)
    except Exception as exc:  # noqa: BLE001 - every error gets a JSON body; CancelledError passes
        status, body, headers = _error(exc, request[_LOG_ID])
        return web.json_response(body, status=status, headers=headers)


def _check_api_key(request: web.Request) -> web.Response | None:
    """None when the request may go on; else the 401 answer (it never echoes what the client sent)."""
    keys = request.app[API_KEYS_KEY]
    if not keys:
        return None
    resource = request.match_info.route.resource  # the matched route, not the raw path: no "/health/../x"
    if resource is not None and resource.canonical in request.app[OPEN_KEY]:
        return None
    header = request.headers.get("Authorization")
    if key_allowed(bearer_token(header), keys):
        return None
    if header is None:
        message = "missing API key: send it in the header 'Authorization: Bearer <key>'"
    elif bearer_token(header) is None:
        message = "malformed Authorization header: it must be 'Bearer <key>'"
    else:
        message = "invalid API key (the key sent is not shown); send a valid one as 'Authorization: Bearer <key>'"
    log.info("request %s: %s %s refused with 401 (%s)", request[_LOG_ID], request.method, request.path,
             "no key" if header is None else "wrong or malformed key")
    body = error_body(message, "invalid_request_error", None, "invalid_api_key")
    return web.json_response(body, status=401, headers={"WWW-Authenticate": 'Bearer realm="pdserve"'})


def _error(exc: Exception, log_id: str) -> tuple[int, dict, dict[str, str]]:
    """(status, error body, extra headers) for an exception raised while serving a request."""
    if isinstance(exc, ModelNotFoundError):
        return 404, error_body(str(exc), "invalid_request_error", exc.field, "model_not_found"), {}
    if isinstance(exc, InvalidRequestError):
        return 400, error_body(str(exc), "invalid_request_error", exc.field), {}
    if isinstance(exc, SplitUnavailable):
        return 409, error_body(str(exc), "invalid_request_error", None, "split_unavailable"), {}
    if isinstance(exc, CapacityError):
        retry_s = max(0.0, float(getattr(exc, "retry_after_s", 1.0)))
        headers = {"Retry-After": str(max(1, math.ceil(retry_s))), "retry-after-ms": str(int(retry_s * 1000))}
        return 429, error_body(str(exc), "server_overloaded", None, "rate_limit_exceeded"), headers
    if isinstance(exc, RequestFailed):  # DeadlineExceeded too: its kind is DEADLINE
        log.warning("request %s failed (%s): %s", log_id, exc.kind.value, exc)
        st = ERROR_STATUS[exc.kind]
        return st.http, error_body(str(exc), st.type, st.param, st.code), {}
    log.error("internal error (request id %s)", log_id, exc_info=exc)
    return 500, error_body(f"internal error (request id {log_id})", "server_error"), {}


def _http_error(request: web.Request, exc: web.HTTPException) -> web.Response:
    headers: dict[str, str] = {}
    if isinstance(exc, web.HTTPMethodNotAllowed):
        allowed = ", ".join(sorted(exc.allowed_methods))
        message = f"method {request.method} is not allowed on {request.path}; allowed: {allowed}"
        headers["Allow"] = allowed
    elif isinstance(exc, web.HTTPNotFound):
        served = ", ".join(f"{r.method} {r.resource.canonical}" for r in request.app.router.routes()
                           if r.method != "HEAD" and r.resource is not None)
        message = f"no route {request.method} {request.path}; this server serves {served}"
    elif isinstance(exc, web.HTTPRequestEntityTooLarge):
        message = f"the request body is larger than the limit of {request.app[MAX_BODY_KEY]} bytes"
    else:
        message = exc.reason
    type_ = "invalid_request_error" if exc.status < 500 else "server_error"
    return web.json_response(error_body(message, type_), status=exc.status, headers=headers)
