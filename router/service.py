"""The router core: validates, tokenizes and places requests, then runs them (`router/request.py`).

Request lifecycle in `Router.submit`:
1. Mint the request id; check the model name.
2. Tokenize (the chat template for chat messages) and validate against the context length and
   the decode workers' KV budget: errors name the field.
3. Features: prompt tokens and expected output tokens (max_tokens, tightened by a running
   estimate of real output lengths).
4. The policy places it on the pools as the router's book sees them: remote prefill on P and
   decode on D, or local prefill on D. No decode worker with room: wait (bounded) or "overloaded".
5. Book the worst-case KV blocks on D, start the run, and return its stream.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import ray
from transformers import PreTrainedTokenizerBase

from engine.errors import InvalidRequestError
from engine.model_loader import encode_prompt
from engine.model_store import ModelError
from router.book import Booking, DecodeSlot, PoolBook, PrefillSlot
from router.config import RouterConfig
from router.cost_model import CostModel
from router.metrics import Metrics
from router.policy import NoCapacity, OutputLengthEstimator, Placement, Policy, PoolState, RequestFeatures, make_policy
from router.pools import Pools
from router.request import RouterStream
from router.types import DeadlineExceeded, GenerateRequest, ModelCard, ModelNotFoundError, OverloadedError, Runtime

log = logging.getLogger(__name__)


class Router:
    """Implements `router.types.RouterAPI` over live pools. Create and use it inside one event loop.

    Args:
        pools: the workers; infos: each worker's `info()` (prefill first, then decode, index-aligned);
        tokenizer: the model's tokenizer (None: token-id prompts only); model_dir: the served model;
        config: router settings; cost: the calibrated cost model; metrics: where to count;
        respawn: `respawn(pool, index)` replaces a dead worker and returns its `info()` (blocking;
            run in a thread); None: dead workers stay out of rotation.
    """

    def __init__(self, pools: Pools, prefill_infos: list[dict], decode_infos: list[dict],
                 tokenizer: PreTrainedTokenizerBase | None, model_dir: Path, config: RouterConfig,
                 cost: CostModel, metrics: Metrics | None = None,
                 respawn: Callable[[str, int], dict] | None = None) -> None:
        if not decode_infos:
            raise ValueError("the router needs at least one decode worker")
        self.pools, self.config, self.cost, self.tokenizer = pools, config, cost, tokenizer
        self.metrics = metrics or Metrics()
        self.model_name = config.served_model_name or Path(model_dir).name
        self.max_model_len = min(i["max_model_len"] for i in prefill_infos + decode_infos)
        self.vocab_size = decode_infos[0]["vocab_size"]
        chooser = (prefill_infos + decode_infos)[0]  # the first worker started chose the dtype
        self.runtime = Runtime.from_info(decode_infos[0], chooser["dtype_reason"])
        self._max_blocks = min(i["num_blocks"] for i in decode_infos)
        self._prefill_max_blocks = min((i["num_blocks"] for i in prefill_infos), default=None)
        self._block_size = decode_infos[0]["block_size"]
        self.book = PoolBook([PrefillSlot(i["worker_id"]) for i in prefill_infos],
                             [DecodeSlot(i["worker_id"], i["num_blocks"], i["block_size"], i["max_num_seqs"])
                              for i in decode_infos])
        self.policy = make_policy(config.policy, cost, config.ttft_target_s, config.tpot_target_s)
        self._local_policy = make_policy("always_local", cost)
        self.estimator = OutputLengthEstimator()
        self._room = asyncio.Condition()
        self._waiting = 0
        self._created = int(time.time())
        self._poller: asyncio.Task | None = None
        self._respawn = respawn
        self._respawning: set[tuple[str, int]] = set()

    # -- RouterAPI ---------------------------------------------------------------------------------
    async def submit(self, request: GenerateRequest) -> RouterStream:
        arrival = time.perf_counter()
        try:
            return await self._submit(request, arrival)
        except ModelNotFoundError:
            self.metrics.errors.labels("model_not_found").inc()
            raise
        except InvalidRequestError:
            self.metrics.errors.labels("invalid_request").inc()
            raise
        except OverloadedError:
            self.metrics.errors.labels("overloaded").inc()
            raise
        except DeadlineExceeded:
            self.metrics.errors.labels("deadline").inc()
            raise

    def models(self) -> list[ModelCard]:
        return [ModelCard(self.model_name, self._created, "pdserve", self.max_model_len, self.runtime)]

    def cost_model(self) -> dict:
        return self.cost.to_dict()

    def healthy(self) -> bool:
        return any(d.healthy for d in self.book.decode)

    def metrics_text(self) -> tuple[bytes, str]:
        return self.metrics.exposition()

    # -- steps -------------------------------------------------------------------------------------
    async def _submit(self, request: GenerateRequest, arrival: float) -> RouterStream:
        rid = f"{request.request_id or 'req'}-{uuid.uuid4().hex[:12]}"
        if request.model is not None and request.model != self.model_name:
            raise ModelNotFoundError(request.model, self.model_name)
        prompt = await self._tokenize_async(request)
        sp = request.sampling
        if request.max_tokens_default:
            room = min(self.max_model_len, self._max_blocks * self._block_size) - len(prompt)
            sp = replace(sp, max_tokens=max(1, min(self.config.default_max_tokens, room)))
        self._validate(prompt, sp.max_tokens, "messages" if request.messages is not None else "prompt")
        features = RequestFeatures(len(prompt), self.estimator.expected(sp.max_tokens, sp.ignore_eos), sp.max_tokens)
        deadline = None if request.timeout_s is None else time.monotonic() + request.timeout_s
        placement = await self._place(features, self.policy, deadline=deadline)
        log.debug("%s: %s on %s (%s) %s", rid, placement.path, placement.decode, placement.reason, placement.detail)
        self.metrics.decisions.labels(self.policy.name, placement.path, placement.reason).inc()
        self.metrics.prompt_tokens.inc(len(prompt))
        booking = self.book.admit(placement, len(prompt), sp.max_tokens)
        self.metrics.in_flight.inc()
        return RouterStream(rid, self.pools, booking, prompt, sp, arrival, self.metrics, self, deadline)

    # -- Planner (for running requests) --------------------------------------------------------------
    async def replan(self, prompt_tokens: int, max_tokens: int, avoid: set[str], local: bool) -> Booking:
        """Place a running request again, away from the workers in `avoid`; `local` forces local prefill."""
        features = RequestFeatures(prompt_tokens, max_tokens, max_tokens)
        policy = self._local_policy if local else self.policy
        placement = await self._place(features, policy, avoid)
        self.metrics.decisions.labels(policy.name, placement.path, "recovery").inc()
        booking = self.book.admit(placement, prompt_tokens, max_tokens)
        self.metrics.in_flight.inc()
        return booking

    def release(self, booking: Booking, output_tokens: int, outcome: str) -> None:
        if not booking.open:
            return
        self.book.finished(booking)
        self.metrics.in_flight.dec()
        if outcome in ("stop", "length"):
            self.estimator.observe(min(output_tokens, booking.max_tokens), booking.max_tokens, outcome)
        asyncio.get_running_loop().create_task(self._notify_room())

    def worker_failed(self, booking: Booking, pool: str) -> None:
        slot = booking.decode if pool == "decode" else booking.prefill
        if slot is not None and slot.healthy:
            log.warning("%s worker %s failed; no new requests go to it until it answers again", pool, slot.worker_id)
            slot.healthy = False
            self.metrics.worker_failures.labels(pool).inc()

    async def _tokenize_async(self, request: GenerateRequest) -> list[int]:
        """Tokenize; long texts in a thread, so streams keep flowing meanwhile."""
        size = len(request.prompt) if isinstance(request.prompt, str) else \
            sum(len(str(m.get("content", ""))) for m in request.messages or [])
        if size < 4096:
            return self._tokenize(request)
        return await asyncio.get_running_loop().run_in_executor(None, self._tokenize, request)

    def _tokenize(self, request: GenerateRequest) -> list[int]:
        if (request.prompt is None) == (request.messages is None):
            raise InvalidRequestError("prompt", "give exactly one of prompt (text or token ids) or messages")
        if isinstance(request.prompt, list):
            return list(request.prompt)
        if self.tokenizer is None:
            field = "prompt" if request.messages is None else "messages"
            raise InvalidRequestError(field, "this model has no tokenizer; send the prompt as token ids")
        try:
            if request.messages is not None:
                return encode_prompt(self.tokenizer, request.messages, chat=True)
            return encode_prompt(self.tokenizer, request.prompt, chat=False)
        except ModelError as e:  # no chat template
            raise InvalidRequestError("messages", str(e)) from None
        except Exception as e:  # the template rejected the messages, or the tokenizer the text
            if request.messages is not None:
                raise InvalidRequestError("messages", f"the chat template could not render them: {e}") from None
            raise InvalidRequestError("prompt", "the tokenizer could not encode it; send valid UTF-8 text") from None

    def _validate(self, prompt: list[int], max_tokens: int, field: str) -> None:
        n, limit = len(prompt), self.max_model_len
        if not n:
            raise InvalidRequestError(field, "must not be empty")
        bad = next((t for t in prompt if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(field, f"token id {bad} is outside [0, {self.vocab_size})")
        if n >= limit:
            raise InvalidRequestError(field, f"has {n} tokens; this model's context allows at most {limit - 1} "
                                             f"prompt tokens (max_model_len={limit})")
        if n + max_tokens > limit:
            raise InvalidRequestError("max_tokens", f"must be <= {limit - n} for this {n}-token prompt: prompt + "
                                                    f"max_tokens must fit the context of {limit} tokens")
        need = -(-(n + max_tokens) // self._block_size)
        if need > self._max_blocks:
            raise InvalidRequestError("max_tokens", f"prompt ({n} tokens) + max_tokens ({max_tokens}) needs "
                                                    f"{need} KV blocks; a decode worker holds {self._max_blocks}")

    async def _place(self, features: RequestFeatures, policy: Policy, avoid: set[str] = frozenset(),
                     deadline: float | None = None) -> Placement:
        """The policy's placement away from `avoid`; waits (bounded; until the request's own monotonic
        `deadline` at most) while no decode worker has room."""
        own = deadline
        deadline = time.monotonic() + self.config.queue_timeout_s
        if own is not None and own < deadline:
            deadline = own
        while True:
            try:
                placement = policy.place(features, self._state(avoid))
            except NoCapacity:
                placement = None
            if placement is not None:
                if placement.path == "remote" and self._prefill_max_blocks is not None and \
                        -(-features.prompt_tokens // self._block_size) > self._prefill_max_blocks:
                    raise InvalidRequestError("prompt", "is longer than a prefill worker's KV budget holds")
                return placement
            if self._waiting >= self.config.max_queued:
                raise OverloadedError(f"every decode worker is full and {self._waiting} requests are already "
                                      "waiting; retry later", retry_after_s=1.0)
            left = deadline - time.monotonic()
            if left <= 0 and own is not None and own <= deadline:
                raise DeadlineExceeded("the request's timeout passed while it waited for a decode worker with room")
            if left <= 0:
                raise OverloadedError(f"no decode worker had room within {self.config.queue_timeout_s:.0f} s; "
                                      "retry later", retry_after_s=2.0)
            self._waiting += 1
            self.metrics.queued.set(self._waiting)
            try:
                async with self._room, asyncio.timeout(left):  # not wait_for: it can swallow a cancel (3.11)
                    await self._room.wait()
            except TimeoutError:
                pass
            finally:
                self._waiting -= 1
                self.metrics.queued.set(self._waiting)

    def _state(self, avoid: set[str]) -> PoolState:
        state = self.book.state()
        if not avoid:
            return state
        return PoolState(tuple(replace(p, healthy=p.healthy and p.worker_id not in avoid) for p in state.prefill),
                         tuple(replace(d, healthy=d.healthy and d.worker_id not in avoid) for d in state.decode))

    async def _notify_room(self) -> None:
        async with self._room:
            self._room.notify_all()

    # -- worker load -------------------------------------------------------------------------------
    def start_polling(self) -> None:
        """Refresh per-worker gauges and health every `load_poll_s` (call inside the serving loop)."""
        self._poller = asyncio.get_running_loop().create_task(self._poll_loop())

    async def stop_polling(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            await asyncio.gather(self._poller, return_exceptions=True)

    async def poll_once(self) -> None:
        workers = [("prefill", i, w, s) for i, (w, s) in enumerate(zip(self.pools.prefill, self.book.prefill))] + \
                  [("decode", i, w, s) for i, (w, s) in enumerate(zip(self.pools.decode, self.book.decode))]
        for pool, i, actor, slot in workers:
            if (pool, i) in self._respawning:
                continue
            try:
                async with asyncio.timeout(max(5.0, self.config.load_poll_s)):
                    load = await actor.load.remote()
            except (TimeoutError, ray.exceptions.RayError) as e:
                if slot.healthy:
                    log.warning("%s worker %s failed its health check: %r", pool, slot.worker_id, e)
                    self.metrics.worker_failures.labels(pool).inc()
                slot.healthy = False
                if isinstance(e, ray.exceptions.RayActorError) and self._respawn is not None:
                    self._respawning.add((pool, i))
                    asyncio.get_running_loop().create_task(self._replace(pool, i))
                continue
            if not slot.healthy:
                log.info("%s worker %s is healthy again", pool, slot.worker_id)
            slot.healthy = True
            self.metrics.observe_worker(pool, slot.worker_id, load)

    async def _replace(self, pool: str, index: int) -> None:
        """Start a worker in place of a dead one; its fresh slot joins the book once it answers."""
        try:
            old = (self.book.prefill if pool == "prefill" else self.book.decode)[index].worker_id
            info = await _in_daemon_thread(self._respawn, pool, index)
            for peer in self.pools.decode if pool == "prefill" else self.pools.prefill:
                peer.drop_peer.remote(old)  # their pairs with the dead worker go away; fire and forget
            if pool == "prefill":
                self.book.prefill[index] = PrefillSlot(info["worker_id"])
            else:
                self.book.decode[index] = DecodeSlot(info["worker_id"], info["num_blocks"], info["block_size"],
                                                     info["max_num_seqs"])
            log.info("%s worker %d replaced by %s", pool, index, info["worker_id"])
            self.metrics.worker_replacements.labels(pool).inc()
            await self._notify_room()
        except Exception:
            log.exception("replacing %s worker %d failed; will try again", pool, index)
        finally:
            self._respawning.discard((pool, index))

    async def _poll_loop(self) -> None:
        while True:
            await self.poll_once()
            await asyncio.sleep(self.config.load_poll_s)


async def _in_daemon_thread(fn: Callable, *args: object) -> object:
    """`fn(*args)` in a daemon thread of its own. Unlike the loop's executor, a call stuck on a Ray
    cluster that went away (a respawn waiting for its actor) does not hold up the process's exit."""
    done: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        if not done.set_running_or_notify_cancel():  # running: a cancel from the awaiting side no longer lands
            return
        try:
            done.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting task
            done.set_exception(e)
    threading.Thread(target=run, daemon=True, name=f"pdserve-{getattr(fn, '__name__', 'call')}").start()
    return await asyncio.wrap_future(done)
