"""loadtest against a real gRPC server speaking pdserve's GenerationService, with known delays and faults.

The servicer (grpc.aio, in a background thread, 127.0.0.1) streams the first token after TTFT_S, then one
every ITL_S, max_tokens in all; the last response carries usage and timings. Chosen requests fail the way
pdserve's do (INTERNAL mid-stream, RESOURCE_EXHAUSTED up front, finish_reason "abort").
"""
from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from typing import Self

import grpc
import pytest

from loadtest.clients import make_client
from loadtest.metrics import summarize
from loadtest.runner import run_closed_loop, run_open_loop
from loadtest.workload import build_workload
from protos.pdserve.v1 import pdserve_pb2, pdserve_pb2_grpc

TTFT_S, ITL_S = 0.05, 0.01
SLACK_S = 0.25  # upper bounds allow for a busy machine; lower bounds are exact


class Servicer(pdserve_pb2_grpc.GenerationServiceServicer):
    def __init__(self, fault: Callable[[int], str]) -> None:
        self.fault = fault
        self.requests: list[pdserve_pb2.GenerateRequest] = []

    async def Generate(self, request: pdserve_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        n = len(self.requests)
        self.requests.append(request)
        sp = request.sampling
        if not (request.HasField("token_ids") and sp.ignore_eos and sp.temperature == 0 and sp.max_tokens >= 1):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "expected greedy token-id request, ignore_eos")
        fault = self.fault(n)
        if fault == "exhausted":
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "no worker can take the request")
        await asyncio.sleep(TTFT_S)
        for i in range(sp.max_tokens):
            if i:
                await asyncio.sleep(ITL_S)
            if i == 2 and fault == "internal":
                await context.abort(grpc.StatusCode.INTERNAL, f"request {request.request_id} failed on d0")
            last = i == sp.max_tokens - 1
            resp = pdserve_pb2.GenerateResponse(request_id=request.request_id, text=f" t{i}", token_ids=[100 + i])
            if last:
                resp.finish_reason = "abort" if fault == "abort" else "length"
                resp.usage.CopyFrom(pdserve_pb2.Usage(prompt_tokens=len(request.token_ids.ids),
                                                      completion_tokens=sp.max_tokens))
                resp.timings.CopyFrom(pdserve_pb2.PhaseTimings(
                    path="remote", prefill_worker="p0", decode_worker="d0", queue_s=0.001, prefill_s=TTFT_S,
                    transfer_s=0.002, decode_s=ITL_S * (sp.max_tokens - 1), ttft_s=TTFT_S))
            yield resp


class GrpcServer:
    def __init__(self, fault: Callable[[int], str] = lambda n: "ok") -> None:
        self.servicer = Servicer(fault)
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        assert self._ready.wait(10), "server did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(0), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)

    def _serve(self) -> None:
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        self.server = grpc.aio.server()
        pdserve_pb2_grpc.add_GenerationServiceServicer_to_server(self.servicer, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.loop.run_until_complete(self.server.start())
        self._ready.set()
        self.loop.run_forever()

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"


@pytest.fixture(scope="module")
def server() -> Iterator[GrpcServer]:
    with GrpcServer() as s:
        yield s


def _run(coro_fn, target: str, *args, timeout_s: float = 10.0, **kw):
    async def main():
        client = make_client("grpc", target, timeout_s=timeout_s)
        try:
            return await coro_fn(client, *args, progress=False, **kw)
        finally:
            await client.aclose()

    return asyncio.run(main())


def test_grpc_closed_loop_times_tokens_and_reads_timings(server: GrpcServer) -> None:
    specs = build_workload("fixed:6:15", 8, seed=0, vocab_size=512)
    before = len(server.servicer.requests)
    result = _run(run_closed_loop, server.target, specs, 4)
    sent = server.servicer.requests[before:]
    assert sorted(tuple(r.token_ids.ids) for r in sent) == sorted(s.prompt_token_ids for s in specs)
    assert all(r.sampling.max_tokens == 15 for r in sent)
    recs = result.records
    assert all(r.ok for r in recs), [r.error for r in recs]
    assert all(r.output_tokens == 15 and r.output_tokens_source == "usage" and len(r.chunk_times_s) == 15
               for r in recs)
    assert all(r.timings["path"] == "remote" and r.timings["transfer_s"] == pytest.approx(0.002) for r in recs)
    s = summarize(recs, result.wall_time_s, ttft_target_s=1.0, tpot_target_s=0.1)
    assert TTFT_S <= s["ttft_s"]["min"] and s["ttft_s"]["p50"] < TTFT_S + SLACK_S
    assert ITL_S * 0.8 <= s["itl_s"]["mean"] < ITL_S + SLACK_S / 5
    assert s["goodput"]["good_requests"] == 8
    assert summarize(recs, result.wall_time_s, ttft_target_s=0.01)["goodput"]["good_requests"] == 0


def test_grpc_errors_are_recorded_and_the_run_completes() -> None:
    faults = ("ok", "internal", "exhausted", "abort")
    with GrpcServer(fault=lambda n: faults[n % len(faults)]) as bad:
        result = _run(run_open_loop, bad.target, build_workload("fixed:4:5", 8, vocab_size=512), 50.0)
    s = summarize(result.records, result.wall_time_s)
    assert s["requests"]["ok"] == 2
    assert s["errors_by_kind"] == {"aborted": 2, "grpc_internal": 2, "grpc_resource_exhausted": 2}
    internal = [r for r in result.records if r.error_kind == "grpc_internal"]
    assert all("failed on d0" in r.error and len(r.chunk_times_s) == 2 for r in internal)


def test_grpc_unreachable_and_deadline() -> None:
    with GrpcServer() as srv:
        target = srv.target
        slow = _run(run_closed_loop, target, build_workload("fixed:4:50", 1, vocab_size=512), 1, timeout_s=0.2)
    assert [r.error_kind for r in slow.records] == ["timeout"]
    gone = _run(run_closed_loop, target, build_workload("fixed:4:5", 2, vocab_size=512), 2, timeout_s=2.0)
    assert [r.error_kind for r in gone.records] == ["grpc_unavailable"] * 2
