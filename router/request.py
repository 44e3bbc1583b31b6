"""One admitted request, run across the pools as its placement says, streamed back as `Chunk`s.

Request lifecycle at the router (after `Router.submit` admitted and placed it):
1. remote path: decode worker D reserves the prompt's blocks (reusing the prefix its cache holds)
   and posts the KV receive; prefill worker P prefills (batched with other prompts), ships the KV of
   the blocks D lacks layer by layer, returns the first token; D starts the sequence once every
   layer landed (the first token's log-probabilities, when the request asked, go from P's answer to
   D, which puts them first on its stream). Local path: D runs the whole request.
2. D's tokens (with their text, stop strings already applied, and their log-probabilities when
   asked) come through D's feed (`router.feed`: one message per engine step for all of D's
   requests); each becomes a `Chunk`, timed for TTFT, inter-token latency and the phase split.
3. Failures before the first token (P died, KV transfer failed or timed out, D refused): both
   sides abort and the request is placed again (another P, or local prefill), bounded attempts.
   D died mid-stream: the prompt plus the tokens already sent are replayed on another decode
   worker, which continues the stream where it stopped (bounded migrations), the log-probabilities
   of the later tokens from that worker.
4. The last chunk carries usage and timings. `aclose()` before the end (client gone) aborts the
   request on P and D; the blocks return. The booking is released exactly once, whatever happens.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import replace
from typing import Protocol

import ray

from engine.command_loop import Stopped
from engine.errors import CapacityError
from engine.sampling_params import SamplingParams
from router.book import Booking
from router.config import RouterConfig
from router.feed import Feeds
from router.metrics import Metrics
from router.pools import Pools
from router.types import Chunk, DeadlineExceeded, PhaseTimings, RequestFailed, Usage
from worker_core.protocol import ErrorKind, PrefillResult, StreamItem, WorkerError

log = logging.getLogger(__name__)
_END = object()


class Planner(Protocol):
    """The router side a running request needs (`router.placer.Placer`): placing it again, and its
    booking's transfer, prefill and release."""

    config: RouterConfig

    async def replan(self, prompt: list[int], max_tokens: int, avoid: set[str], local: bool) -> Booking: ...

    def prefilled(self, booking: Booking) -> None: ...

    def shipping(self, booking: Booking, held_blocks: int) -> None: ...

    async def reservations_made(self, booking: Booking) -> None: ...

    def release(self, booking: Booking, output_tokens: int, outcome: str) -> None: ...

    def worker_failed(self, booking: Booking, pool: str) -> None: ...

    def observed(self, booking: Booking, ttft_s: float, tpot_s: float | None) -> None: ...


class _WorkerFailure(Exception):
    """A worker died or could not do its part: `pool` says which side, `dead` whether it is gone, and
    `kind` what failed (the request's error kind when the bounds on recovery are spent)."""

    def __init__(self, pool: str, cause: BaseException | str, dead: bool, kind: ErrorKind) -> None:
        super().__init__(f"{pool} worker: {cause!r}" if isinstance(cause, BaseException) else f"{pool} worker: {cause}")
        self.pool, self.dead, self.kind = pool, dead, kind


class RouterStream:
    """Runs one request on the workers in a task of its own and hands out its chunks.

    Args:
        request_id: the router's id; pools: the live workers; feeds: their token feeds; booking: where
        it runs (placed and booked); prompt: token ids; sampling: its params; arrival: perf_counter() at
        arrival; metrics: where timings go; planner: the router (re-placement after failures, booking
        release); deadline: time.monotonic() by which it must end, or None.
    """

    def __init__(self, request_id: str, pools: Pools, feeds: Feeds, booking: Booking, prompt: list[int],
                 sampling: SamplingParams, arrival: float, metrics: Metrics, planner: Planner,
                 deadline: float | None = None) -> None:
        self.request_id = request_id
        self._worker_rid = request_id  # the id workers know this attempt by: a fresh one per placement
        self.prompt_tokens = len(prompt)
        self._pools, self._feeds, self._booking, self._prompt, self._sampling = pools, feeds, booking, prompt, sampling
        self._arrival, self._metrics, self._planner = arrival, metrics, planner
        self._queue: asyncio.Queue = asyncio.Queue()
        self._sent: list[int] = []  # tokens handed to the client so far
        self._sent_chars = 0  # characters of their text handed out (the worker may hold some back)
        self._cached = 0
        self._first_at: float | None = None
        self._last_at: float | None = None
        self.timings = self._new_timings(booking)
        self._placed = booking  # its first placement (a later booking means it was placed again)
        self.migrations = 0
        self._deadline = deadline
        self._task = asyncio.get_running_loop().create_task(self._run())

    # -- consumer side ----------------------------------------------------------------------------
    @property
    def prompt_token_ids(self) -> tuple[int, ...]:
        """The prompt as the workers run it (asked only by a client that wants the ids back)."""
        return tuple(self._prompt)

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
        """Abort the request if it is still running; returns once the workers were told. Idempotent."""
        if not self._task.done():
            self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)

    # -- the run ----------------------------------------------------------------------------------
    async def _run(self) -> None:
        outcome, kind = "error", ErrorKind.INTERNAL.value  # kind: the error's, counted when outcome is "error"
        try:
            if self._deadline is None:
                outcome = await self._drive()
            else:
                loop = asyncio.get_running_loop()
                async with asyncio.timeout_at(loop.time() + self._deadline - time.monotonic()):
                    outcome = await self._drive()
        except TimeoutError:
            outcome = "deadline"
            await asyncio.shield(self._abort(self._booking))
            self._metrics.errors.labels("deadline").inc()
            self._queue.put_nowait(DeadlineExceeded(f"request {self.request_id}: its timeout passed after "
                                                    f"{len(self._sent)} tokens; it was aborted"))
        except asyncio.CancelledError:
            outcome = "cancelled"
            await asyncio.shield(self._abort(self._booking))
        except (RequestFailed, CapacityError) as e:
            kind = e.kind.value if isinstance(e, RequestFailed) else "overloaded"
            await asyncio.shield(self._abort(self._booking))
            self._queue.put_nowait(e)
        except Exception as e:  # unexpected: the client gets a clear message, the log the rest
            log.exception("request %s failed", self.request_id)
            await asyncio.shield(self._abort(self._booking))
            self._queue.put_nowait(RequestFailed(f"request {self.request_id} failed: {type(e).__name__}"))
        finally:
            self._planner.release(self._booking, len(self._sent), outcome)
            m = self._metrics
            m.requests.labels(self._booking.placement.path, outcome).inc()
            if outcome == "error":
                m.errors.labels(kind).inc()
            m.prompt_length.observe(self.prompt_tokens)
            m.generation_length.observe(len(self._sent))
            self._queue.put_nowait(_END)

    async def _drive(self) -> str:
        cfg = self._planner.config
        attempts = 0
        while True:
            b = self._booking
            try:
                prompt, sampling = self._resume_point()
                dispatched = time.perf_counter()
                if self._first_at is None:
                    self.timings.queue_s = dispatched - self._arrival
                decoder = self._pools.decoder(b.placement.decode)
                feed = self._feeds.get(b.decode.worker_id, decoder)
                items = feed.subscribe(self._worker_rid)
                try:
                    await self._start(b, prompt, sampling)
                    return await self._relay(b, dispatched, items)
                finally:
                    feed.unsubscribe(self._worker_rid)
            except _WorkerFailure as e:
                await asyncio.shield(self._abort(b))
                if e.dead:
                    self._planner.worker_failed(b, e.pool)
                self._planner.release(b, len(self._sent), "retried")
                self._booking = await self._recover(e, b, cfg, attempts := attempts + 1)

    async def _recover(self, e: _WorkerFailure, b: Booking, cfg: RouterConfig, attempts: int) -> Booking:
        """Place the request again after `e`, or raise RequestFailed when the bounds are spent."""
        log.warning("request %s: %s; %d tokens sent so far", self.request_id, e, len(self._sent))
        self._metrics.attempt_failures.labels(e.kind.value, e.pool).inc()
        migrating = e.pool == "decode" and self._sent
        if migrating:
            self.migrations += 1
            self._metrics.recoveries.labels("migrate").inc()
            if self.migrations > cfg.max_migrations:
                raise RequestFailed(f"request {self.request_id}: decode workers failed {self.migrations} times; "
                                    f"gave up after {len(self._sent)} tokens", e.kind) from None
        else:
            policy = cfg.on_prefill_failure if e.pool == "prefill" else "retry"
            if policy == "fail" or attempts >= cfg.max_attempts:
                raise RequestFailed(f"request {self.request_id}: could not start it ({e})", e.kind) from None
        avoid = {b.decode.worker_id} if e.pool == "decode" else ({b.prefill.worker_id} if b.prefill else set())
        prompt, sampling = self._resume_point()
        booking = await self._planner.replan(prompt, sampling.max_tokens, avoid,
                                             local=bool(migrating) or cfg.on_prefill_failure == "local")
        if not migrating:  # a prefill worker's failure placed local (configured, or no prefill worker left)
            fell_back = e.pool == "prefill" and booking.placement.path == "local"
            self._metrics.recoveries.labels("local" if fell_back else "retry").inc()
        self._worker_rid = f"{self.request_id}.{attempts + self.migrations}"  # no leftovers of the last attempt
        t = self.timings
        self.timings = replace(self._new_timings(booking), queue_s=t.queue_s, ttft_s=t.ttft_s, prefill_s=t.prefill_s,
                               transfer_s=t.transfer_s)
        return booking

    def _resume_point(self) -> tuple[list[int], SamplingParams]:
        """Prompt and params to (re)start from: the tokens already sent become part of the prompt, as
        output the new worker continues (its sampling draws, its text held back, its stop strings)."""
        if not self._sent:
            return self._prompt, self._sampling
        sp, n = self._sampling, len(self._sent)
        return self._prompt + self._sent, replace(sp, max_tokens=sp.max_tokens - n, prior_output_tokens=n,
                                                  prior_output_chars=self._sent_chars)

    async def _start(self, b: Booking, prompt: list[int], sampling: SamplingParams) -> None:
        rid, p_idx, d_idx = self._worker_rid, b.placement.prefill, b.placement.decode
        d = self._pools.decoder(d_idx)
        if b.placement.path == "local":
            await self._planner.reservations_made(b)
            await _call("decode", d.submit_local.remote(rid, prompt, sampling, feed=True),
                        ErrorKind.PREFILL_FAILED)
            return
        p = self._pools.prefill[p_idx]
        held = await _call("decode", d.reserve.remote(rid, prompt, sampling, self._pools.prefill_peers[p_idx],
                                                      feed=True, reuse=self._planner.config.prefix_aware),
                           ErrorKind.INTERNAL)
        self._planner.shipping(b, held)
        first: PrefillResult = await _call(  # only the blocks D lacks travel
            "prefill", p.prefill.remote(rid, prompt, sampling, self._pools.decode_peers[d_idx], skip_blocks=held),
            ErrorKind.PREFILL_FAILED)
        self._planner.prefilled(b)
        self.timings.prefill_s = first.prefill_s
        try:
            await d.start_remote.remote(rid, first.first_token, first.handoff, first.first_logprob)
        except ray.exceptions.RayActorError as e:
            raise _WorkerFailure("decode", e, dead=True, kind=ErrorKind.INTERNAL) from None
        except Stopped as e:  # the decode worker shut down (Ray raises the worker's own error type)
            raise _WorkerFailure("decode", e, dead=True, kind=ErrorKind.WORKER_STOPPING) from None
        except Exception as e:  # its reservation expired: the transfer never completed
            raise _WorkerFailure("prefill", e, dead=False, kind=ErrorKind.TRANSFER_FAILED) from None

    async def _relay(self, b: Booking, dispatched: float, items: asyncio.Queue[StreamItem | BaseException]) -> str:
        """Hand on the items of the decode worker's feed until the last one. Returns its finish reason."""
        got_any = False
        while True:
            item = await items.get()
            if isinstance(item, Stopped):  # the decode worker shut down
                raise _WorkerFailure("decode", item, dead=True, kind=ErrorKind.WORKER_STOPPING)
            if isinstance(item, BaseException):  # its feed failed: the worker died or was killed
                raise _WorkerFailure("decode", item, dead=True, kind=ErrorKind.INTERNAL)
            if item.error is not None:
                self._on_error(item.error, got_any)
            got_any = True
            if self._on_item(item, b, dispatched):
                return item.finish_reason

    def _on_error(self, error: WorkerError, got_any: bool) -> None:
        """A stream's error item: raises what the router does about it, by its kind."""
        if error.kind == ErrorKind.TRANSFER_FAILED and not got_any:  # the KV never landed: start again
            raise _WorkerFailure("prefill", error.message, dead=False, kind=error.kind)
        if error.kind == ErrorKind.WORKER_STOPPING:  # gone for new work: place it again; a started stream migrates
            raise _WorkerFailure("decode", error.message, dead=True, kind=error.kind)
        raise RequestFailed(f"request {self.request_id}: {error.message}", error.kind)

    def _on_item(self, item: StreamItem, b: Booking, dispatched: float) -> bool:
        """Record one stream item and hand it on. Returns whether it was the last."""
        now, t, m, path = time.perf_counter(), self.timings, self._metrics, b.placement.path
        if item.cached_tokens is not None:
            self._cached = item.cached_tokens
        if item.transfer_s is not None:
            t.transfer_s = item.transfer_s
            m.transfer.observe(t.transfer_s)
        if item.token_ids:
            if self._first_at is None:
                self._first_at = now
                t.ttft_s = now - self._arrival
                if path == "local":
                    t.prefill_s = now - dispatched
                m.ttft.labels(path).observe(t.ttft_s)
            elif self._last_at is not None:
                m.itl.labels(path).observe(now - self._last_at)
            self._planner.prefilled(b)
            self._last_at = now
            self._sent += item.token_ids
        self._sent_chars += len(item.text)
        if not item.finished:
            self._queue.put_nowait(Chunk(item.text, list(item.token_ids), logprobs=item.logprobs))
            return False
        t.e2e_s = now - self._arrival
        t.decode_s = (self._last_at - self._first_at) if self._first_at is not None else 0.0
        self._observe(len(self._sent), path)
        m.cached_tokens.labels(path, b.decode.worker_id).inc(self._cached)  # what its last placement reused
        if b is self._placed and self._first_at is not None:  # placed once: its estimates were the ones served
            n = len(self._sent)
            self._planner.observed(b, t.ttft_s - t.queue_s, t.decode_s / (n - 1) if n > 1 else None)
        self._queue.put_nowait(Chunk(item.text, list(item.token_ids), item.finish_reason,
                                     Usage(self.prompt_tokens, len(self._sent), self._cached), t, item.logprobs))
        return True

    def _observe(self, n_out: int, path: str) -> None:
        t, m = self.timings, self._metrics
        m.e2e.labels(path).observe(t.e2e_s)
        m.queue.labels(path).observe(t.queue_s)
        m.prefill.labels(path).observe(t.prefill_s)
        m.decode.labels(path).observe(t.decode_s)
        if n_out > 1:
            m.tpot.labels(path).observe(t.decode_s / (n_out - 1))
        m.output_tokens.inc(n_out)

    def _new_timings(self, b: Booking) -> PhaseTimings:
        return PhaseTimings(b.placement.path, b.prefill.worker_id if b.prefill else None, b.decode.worker_id)

    async def _abort(self, b: Booking) -> None:
        """Tell both workers to drop the request (idempotent on their side; dead ones are skipped)."""
        rid = self._worker_rid
        calls = [self._pools.decoder(b.placement.decode).abort.remote(rid)]
        if b.placement.path == "remote":
            calls.append(self._pools.prefill[b.placement.prefill].abort.remote(rid))
        for ref in calls:
            try:
                async with asyncio.timeout(10):
                    await ref
            except Exception as e:  # a dead worker has nothing left to free
                log.debug("abort of %s: %r", self.request_id, e)


async def _call(pool: str, ref: Awaitable, kind: ErrorKind) -> object:
    """Await a worker call; its failure becomes a `_WorkerFailure` of that pool, of error `kind` (a
    worker that shut down: WORKER_STOPPING, and it takes no more work)."""
    try:
        return await ref
    except ray.exceptions.RayActorError as e:
        raise _WorkerFailure(pool, e, dead=True, kind=kind) from None
    except Stopped as e:  # Ray raises the worker's own error type
        raise _WorkerFailure(pool, e, dead=True, kind=ErrorKind.WORKER_STOPPING) from None
    except (ray.exceptions.RayTaskError, CapacityError, RuntimeError) as e:
        raise _WorkerFailure(pool, e, dead=False, kind=kind) from None
