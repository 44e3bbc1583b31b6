"""One admitted request, run across the pools as its placement says, streamed back as `Chunk`s.

Request lifecycle at the router (after `Router.submit` validated, tokenized and placed it):
1. remote path: decode worker D reserves the prompt's blocks and posts the KV receive; prefill
   worker P prefills (batched with other prompts), ships KV layer by layer, returns the first
   token; D starts the sequence once every layer landed. Local path: D runs the whole request.
2. D streams tokens (with their text, stop strings already applied); each becomes a `Chunk`,
   timed for TTFT, inter-token latency and the phase split.
3. The last chunk carries usage and timings. A worker error ends the stream with `RequestFailed`.
4. `aclose()` before the end (client gone) aborts the request on P and D; the blocks return.
Whatever happens, the router's booking is released exactly once and metrics record the outcome.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable

import ray

from engine.sampling_params import SamplingParams
from router.metrics import Metrics
from router.policy import Placement
from router.pools import Pools
from router.types import Chunk, PhaseTimings, RequestFailed, Usage

log = logging.getLogger(__name__)
_END = object()


class RouterStream:
    """Runs one request on the workers in a task of its own and hands out its chunks.

    Args:
        pools: the live workers; placement: where it runs; prompt: token ids; sampling: its params;
        arrival: perf_counter() when it arrived; metrics: where timings go;
        on_prefilled / on_done: the router's booking callbacks (each called exactly once).
    """

    def __init__(self, request_id: str, pools: Pools, placement: Placement, prompt: list[int],
                 sampling: SamplingParams, arrival: float, metrics: Metrics,
                 on_prefilled: Callable[[], None], on_done: Callable[[int, str], None]) -> None:
        self.request_id = request_id
        self.prompt_tokens = len(prompt)
        self._pools, self._placement, self._prompt, self._sampling = pools, placement, prompt, sampling
        self._arrival, self._metrics = arrival, metrics
        self._on_prefilled, self._on_done = on_prefilled, on_done
        self._queue: asyncio.Queue = asyncio.Queue()
        self._prefill_pending = True
        self._finished = False
        path = placement.path
        self.timings = PhaseTimings(path, pools.prefill_peers[placement.prefill].worker_id if path == "remote"
                                    else None, pools.decode_peers[placement.decode].worker_id)
        self._task = asyncio.get_running_loop().create_task(self._run())

    # -- consumer side ----------------------------------------------------------------------------
    def __aiter__(self) -> AsyncIterator[Chunk]:
        return self._chunks()

    async def _chunks(self) -> AsyncIterator[Chunk]:
        while True:
            item = await self._queue.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    async def aclose(self) -> None:
        """Abort the request if it is still running; returns once the workers were told."""
        if not self._task.done():
            self._task.cancel()
        try:
            await self._task
        except (asyncio.CancelledError, Exception):  # noqa: S110 - the outcome is already recorded
            pass

    # -- the run ----------------------------------------------------------------------------------
    async def _run(self) -> None:
        outcome, completion = "error", 0
        try:
            completion, outcome = await self._drive()
        except asyncio.CancelledError:
            outcome = "cancelled"
            await asyncio.shield(self._abort())
        except RequestFailed as e:
            await asyncio.shield(self._abort())
            self._queue.put_nowait(e)
        except Exception as e:  # a worker died or refused: the client gets a clear message, logs the rest
            log.warning("request %s failed: %r", self.request_id, e)
            await asyncio.shield(self._abort())
            self._queue.put_nowait(RequestFailed(f"request {self.request_id} failed on a worker: "
                                                 f"{type(e).__name__}"))
        finally:
            self._prefill_done()
            self._on_done(completion, outcome)
            self._metrics.requests.labels(self._placement.path, outcome).inc()
            if outcome == "error":
                self._metrics.errors.labels("worker_failure").inc()
            self._queue.put_nowait(_END)

    async def _drive(self) -> tuple[int, str]:
        p_idx, d_idx = self._placement.prefill, self._placement.decode
        d = self._pools.decode[d_idx]
        rid, t = self.request_id, self.timings
        dispatched = time.perf_counter()
        t.queue_s = dispatched - self._arrival
        if self._placement.path == "remote":
            p = self._pools.prefill[p_idx]
            await d.reserve.remote(rid, self._prompt, self._sampling, self._pools.prefill_peers[p_idx])
            first = await p.prefill.remote(rid, self._prompt, self._sampling, self._pools.decode_peers[d_idx])
            self._prefill_done()
            t.prefill_s = first["prefill_s"]
            await d.start_remote.remote(rid, first["first_token"], first["handoff"])
        else:
            await d.submit_local.remote(rid, self._prompt, self._sampling)
        return await self._relay(d, dispatched)

    async def _relay(self, d: ray.actor.ActorHandle, dispatched: float) -> tuple[int, str]:
        t, m, path = self.timings, self._metrics, self._placement.path
        n_out, cached, first_at, last_at = 0, 0, None, None
        async for ref in d.stream.options(num_returns="streaming").remote(self.request_id):
            item = await ref
            now = time.perf_counter()
            if item["error"]:
                raise RequestFailed(f"request {self.request_id}: {item['error']}")
            cached = item.get("cached_tokens", cached)
            if "transfer_s" in item:
                t.transfer_s = item["transfer_s"]
                m.transfer.observe(t.transfer_s)
            if item["token_ids"]:
                if first_at is None:
                    first_at = now
                    t.ttft_s = now - self._arrival
                    if path == "local":
                        t.prefill_s = now - dispatched
                    self._prefill_done()
                    m.ttft.labels(path).observe(t.ttft_s)
                else:
                    m.itl.labels(path).observe(now - last_at)
                last_at = now
                n_out += len(item["token_ids"])
            if not item["finished"]:
                self._queue.put_nowait(Chunk(item["text"], item["token_ids"]))
                continue
            t.e2e_s = now - self._arrival
            t.decode_s = (last_at - first_at) if first_at is not None else 0.0
            self._observe(n_out)
            self._finished = True
            self._queue.put_nowait(Chunk(item["text"], item["token_ids"], item["finish_reason"],
                                         Usage(self.prompt_tokens, n_out, cached), t))
            return n_out, item["finish_reason"]
        raise RequestFailed(f"request {self.request_id}: the decode worker ended the stream early")

    def _observe(self, n_out: int) -> None:
        t, m, path = self.timings, self._metrics, self._placement.path
        m.e2e.labels(path).observe(t.e2e_s)
        m.queue.labels(path).observe(t.queue_s)
        m.prefill.labels(path).observe(t.prefill_s)
        m.decode.labels(path).observe(t.decode_s)
        if n_out > 1:
            m.tpot.labels(path).observe(t.decode_s / (n_out - 1))
        m.output_tokens.inc(n_out)

    def _prefill_done(self) -> None:
        if self._prefill_pending:
            self._prefill_pending = False
            self._on_prefilled()

    async def _abort(self) -> None:
        """Tell both workers to drop the request (idempotent on their side)."""
        calls = [self._pools.decode[self._placement.decode].abort.remote(self.request_id)]
        if self._placement.path == "remote":
            calls.append(self._pools.prefill[self._placement.prefill].abort.remote(self.request_id))
        for ref in calls:
            try:
                await asyncio.wait_for(ref, timeout=10)
            except Exception as e:  # a dead worker has nothing left to free
                log.warning("abort of %s: %r", self.request_id, e)
