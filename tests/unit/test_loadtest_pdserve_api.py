"""loadtest against pdserve's own API servers (OpenAI HTTP and gRPC, over the deterministic FakeRouter):
the harness reads pdserve's real wire format — usage, `pdserve_timings`, in-band errors, 429s, API keys."""
from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator

import pytest

from loadtest.clients import make_client
from loadtest.metrics import summarize
from loadtest.runner import RunResult, run_closed_loop
from loadtest.workload import build_workload
from router.grpc_server import start_grpc_server
from router.http_server import start_http_server
from tests.unit.fake_router import FakeRouter

KEY = "sk-loadtest-0123456789"


class Served:
    """pdserve's HTTP and gRPC servers over one FakeRouter, on a background event loop."""

    def __init__(self, api_keys: frozenset[str] = frozenset()) -> None:
        self.router = FakeRouter(token_delay_ms=2)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.runner, self.http_port = self._call(start_http_server(self.router, "127.0.0.1", 0, api_keys=api_keys))
        self.grpc, self.grpc_port = self._call(start_grpc_server(self.router, "127.0.0.1", 0, api_keys=api_keys))

    def _call(self, coro: object) -> object:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)  # type: ignore[arg-type]

    def target(self, api: str) -> str:
        return f"http://127.0.0.1:{self.http_port}" if api == "openai" else f"127.0.0.1:{self.grpc_port}"

    def close(self) -> None:
        self._call(self.runner.cleanup())
        self._call(self.grpc.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    s = Served()
    yield s
    s.close()


def run(api: str, target: str, specs: list, concurrency: int = 3, api_key: str | None = None) -> RunResult:
    async def main() -> RunResult:
        client = make_client(api, target, timeout_s=10, api_key=api_key)
        try:
            return await run_closed_loop(client, specs, concurrency, progress=False)
        finally:
            await client.aclose()

    return asyncio.run(main())


@pytest.mark.parametrize("api", ["openai", "grpc"])
def test_token_id_prompts_usage_and_timings(served: Served, api: str) -> None:
    specs = build_workload("fixed:5:12", 6, seed=0, vocab_size=64)
    result = run(api, served.target(api), specs)
    recs = result.records
    assert all(r.ok for r in recs), [r.error for r in recs]
    assert all(r.output_tokens == 12 and r.output_tokens_source == "usage" and r.finish_reason == "length"
               for r in recs)
    assert all(r.server_prompt_tokens == 5 and len(r.chunk_times_s) == 12 for r in recs)
    assert all(r.timings["path"] == "remote" and r.timings["transfer_s"] == pytest.approx(0.002) for r in recs)
    sent = served.router.requests[-6:]
    assert all(q.sampling.ignore_eos and q.sampling.max_tokens == 12 and q.sampling.temperature == 0 for q in sent)
    assert sorted(tuple(q.prompt) for q in sent) == sorted(s.prompt_token_ids for s in specs)
    assert summarize(recs, result.wall_time_s, 5.0, 1.0)["goodput"]["good_requests"] == 6


@pytest.mark.parametrize("api,kinds", [
    ("openai", {"http_429": 1, "server_error": 1}),
    ("grpc", {"grpc_resource_exhausted": 1, "grpc_internal": 1}),
])
def test_text_prompts_overload_and_mid_stream_failure(served: Served, tmp_path, api: str, kinds: dict) -> None:
    f = tmp_path / "w.jsonl"
    f.write_text("\n".join(json.dumps({"prompt": p, "output_tokens": 4}) for p in ("one two", "overload", "explode")))
    result = run(api, served.target(api), build_workload(str(f), 3))
    s = summarize(result.records, result.wall_time_s)
    assert s["requests"]["ok"] == 1 and s["errors_by_kind"] == kinds
    assert "KV transfer failed" in next(r.error for r in result.records if r.index == 2)


@pytest.mark.parametrize("api", ["openai", "grpc"])
def test_api_key(api: str) -> None:
    s = Served(api_keys=frozenset({KEY}))
    try:
        specs = build_workload("fixed:3:2", 2, vocab_size=64)
        refused = run(api, s.target(api), specs)
        assert {r.error_kind for r in refused.records} == {"http_401" if api == "openai" else "grpc_unauthenticated"}
        assert all(r.ok for r in run(api, s.target(api), specs, api_key=KEY).records)
    finally:
        s.close()
