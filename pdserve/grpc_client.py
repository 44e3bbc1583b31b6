"""A small gRPC client of a running pdserve: streams one generation to a text sink."""
from __future__ import annotations

from collections.abc import Iterator

import grpc

from protos.pdserve.v1 import pdserve_pb2, pdserve_pb2_grpc


def generate_stream(target: str, prompt: str, chat: bool, max_tokens: int, temperature: float, top_p: float,
                    top_k: int, seed: int | None, stop: list[str], timeout_s: float = 600.0,
                    metadata: list[tuple[str, str]] | None = None,
                    root_certificates: bytes | None = None) -> Iterator[pdserve_pb2.GenerateResponse]:
    """Yield the server's responses for one prompt (as chat messages when `chat`); over TLS when
    `root_certificates` (PEM: the CA, or the server's own self-signed certificate) is given.

    Raises:
        grpc.RpcError: the server refused the request (its status and message say why) or is unreachable.
    """
    sampling = pdserve_pb2.SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                          stop=stop)
    if seed is not None:
        sampling.seed = seed
    if chat:
        req = pdserve_pb2.GenerateRequest(chat=pdserve_pb2.ChatMessages(
            messages=[pdserve_pb2.ChatMessage(role="user", content=prompt)]), sampling=sampling)
    else:
        req = pdserve_pb2.GenerateRequest(text=prompt, sampling=sampling)
    channel = grpc.insecure_channel(target) if root_certificates is None else \
        grpc.secure_channel(target, grpc.ssl_channel_credentials(root_certificates))
    with channel:
        stub = pdserve_pb2_grpc.GenerationServiceStub(channel)
        yield from stub.Generate(req, timeout=timeout_s, metadata=metadata)
