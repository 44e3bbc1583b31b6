"""Clients that stream one request and time it: the interface and the factory.

Backends: `openai` (`loadtest.openai_client.OpenAIClient`, any OpenAI-compatible HTTP server) and `grpc`
(`loadtest.grpc_client.GrpcClient`, pdserve's gRPC API). The openai backend sends to one of ENDPOINTS:
`completions` (POST /v1/completions, the prompt as is) or `chat` (POST /v1/chat/completions, text prompts
as messages).
"""
from __future__ import annotations

from typing import Protocol

from loadtest.records import RequestRecord
from loadtest.workload import RequestSpec

APIS = ("openai", "grpc")
ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}  # name → path


class Client(Protocol):
    async def send(self, spec: RequestSpec) -> RequestRecord:
        """Streams one request. Returns: its record; failures are recorded in it (error, error_kind), never
        raised. Raises: only asyncio.CancelledError."""
        ...

    async def aclose(self) -> None:
        """Releases connections."""
        ...


def make_client(api: str, target: str, model: str | None = None, timeout_s: float = 300.0,
                ignore_eos: bool = True, api_key: str | None = None, endpoint: str = "completions") -> Client:
    """Args: api ("openai" or "grpc"), target (base URL or HOST:PORT), model (None: the server's default),
    timeout_s (per request), ignore_eos (ask for exactly max_tokens), api_key (sent as a Bearer token),
    endpoint (openai only: a name in ENDPOINTS).
    Returns: a client.
    Raises: ValueError for an unknown api or endpoint, or an endpoint other than completions for grpc."""
    if endpoint not in ENDPOINTS:
        raise ValueError(f"unknown endpoint {endpoint!r}; allowed: {', '.join(ENDPOINTS)}")
    if api == "openai":
        from loadtest.openai_client import OpenAIClient

        return OpenAIClient(target, model, timeout_s, ignore_eos, api_key, endpoint)
    if api == "grpc" and endpoint != "completions":
        raise ValueError(f"endpoint {endpoint!r} is an OpenAI HTTP endpoint; the grpc api has none")
    if api == "grpc":
        from loadtest.grpc_client import GrpcClient

        return GrpcClient(target, model, timeout_s, ignore_eos, api_key)
    raise ValueError(f"unknown api {api!r}; allowed: {', '.join(APIS)}")
