"""Streams one request from pdserve's gRPC API (GenerationService.Generate, grpc.aio) and times it.

A chunk carrying output is a response with token ids or text; the last response's usage gives the
output token count and its timings pdserve's phase split. A spec with `keep_output` keeps the output's
text and token ids on the record. gRPC errors fail the request, never the run.
"""
from __future__ import annotations

import asyncio
import time

import grpc

from loadtest import records as R
from loadtest.records import RequestRecord
from loadtest.workload import RequestSpec
from protos.pdserve.v1 import pdserve_pb2, pdserve_pb2_grpc


class GrpcClient:
    """Args: target (HOST:PORT), model (None: the served one), timeout_s (per request), ignore_eos,
    api_key (sent as metadata `authorization: Bearer <key>`; None: none)."""

    def __init__(self, target: str, model: str | None = None, timeout_s: float = 300.0,
                 ignore_eos: bool = True, api_key: str | None = None) -> None:
        self.target = target.removeprefix("grpc://")
        self.model, self.timeout_s, self.ignore_eos = model, timeout_s, ignore_eos
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None
        self._channel: grpc.aio.Channel | None = None
        self._stub: pdserve_pb2_grpc.GenerationServiceStub | None = None

    def request(self, spec: RequestSpec) -> pdserve_pb2.GenerateRequest:
        """The GenerateRequest for one spec (greedy, fixed output length)."""
        sampling = pdserve_pb2.SamplingParams(max_tokens=spec.output_tokens, temperature=0.0,
                                              ignore_eos=self.ignore_eos)
        req = pdserve_pb2.GenerateRequest(sampling=sampling, request_id=f"loadtest-{spec.index}",
                                          model=self.model or "")
        if spec.prompt_token_ids is not None:
            req.token_ids.ids.extend(spec.prompt_token_ids)
        else:
            req.text = spec.prompt_text or ""
        return req

    async def send(self, spec: RequestSpec) -> RequestRecord:
        """Streams one request. Returns: its record (error set on any failure). Raises: only CancelledError."""
        if self._stub is None:
            self._channel = grpc.aio.insecure_channel(self.target)
            self._stub = pdserve_pb2_grpc.GenerationServiceStub(self._channel)
        rec = RequestRecord(spec.index, spec.prompt_tokens, spec.output_tokens)
        t0 = time.perf_counter()
        token_ids = 0
        usage_tokens: int | None = None
        kept_ids: list[int] = []
        kept_text: list[str] = []
        try:
            async with asyncio.timeout(self.timeout_s):
                call = self._stub.Generate(self.request(spec), timeout=self.timeout_s, metadata=self._metadata)
                async for resp in call:
                    now = time.perf_counter() - t0
                    if resp.token_ids or resp.text:
                        token_ids += len(resp.token_ids)
                        if spec.keep_output:
                            kept_ids += resp.token_ids
                            kept_text.append(resp.text)
                        rec.chunk_times_s.append(now)
                        if rec.ttft_s is None:
                            rec.ttft_s = now
                    if resp.HasField("usage"):
                        usage_tokens = resp.usage.completion_tokens
                        rec.server_prompt_tokens = resp.usage.prompt_tokens
                        rec.cached_tokens = resp.usage.cached_tokens
                    if resp.HasField("timings"):
                        rec.timings = _timings(resp.timings)
                    if resp.finish_reason:
                        rec.finish_reason = resp.finish_reason
            if spec.keep_output:
                rec.output_text, rec.output_token_ids = "".join(kept_text), kept_ids
            if usage_tokens is not None:
                rec.output_tokens, rec.output_tokens_source = usage_tokens, "usage"
            else:
                rec.output_tokens, rec.output_tokens_source = token_ids or len(rec.chunk_times_s), "chunks"
            if rec.finish_reason is None:
                rec.fail(R.INCOMPLETE, "stream ended without a finish_reason")
            elif rec.finish_reason == "abort":
                rec.fail(R.ABORTED, "the server aborted the request")
        except grpc.aio.AioRpcError as e:
            code = e.code()
            kind = R.TIMEOUT if code == grpc.StatusCode.DEADLINE_EXCEEDED else f"grpc_{code.name.lower()}"
            rec.fail(kind, f"gRPC {code.name}: {e.details()}")
        except TimeoutError:
            rec.fail(R.TIMEOUT, f"no complete response within {self.timeout_s:g} s")
        except Exception as e:  # noqa: BLE001 - a broken response must never end the run
            rec.fail(R.CLIENT_EXCEPTION, f"{type(e).__name__}: {e}")
        rec.e2e_s = time.perf_counter() - t0
        return rec

    async def aclose(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel, self._stub = None, None


def _timings(t: pdserve_pb2.PhaseTimings) -> dict:
    return {"path": t.path, "prefill_worker": t.prefill_worker, "decode_worker": t.decode_worker,
            "queue_s": t.queue_s, "prefill_s": t.prefill_s, "transfer_s": t.transfer_s, "decode_s": t.decode_s,
            "ttft_s": t.ttft_s, "e2e_s": t.e2e_s}
