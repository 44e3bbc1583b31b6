"""Placement and booking: where each request runs, and the router's book of what each worker holds.

Request lifecycle here:
1. `place` (after admission): the policy places the request on the pools as the book sees them,
   each worker with the part of the prompt its prefix cache holds or is promised (`PrefixIndex`,
   which the health poll keeps up): remote prefill on P and decode on D, or local prefill on D.
   With no decode worker that has room it waits in the `WaitQueue` and tries again. The worst-case
   KV blocks are booked on D, and the prompt's prefix is promised to the worker computing it. A local
   prompt placed where another's KV is on its way starts once D has reserved that KV
   (`reservations_made`, then `shipping` of the remote one), so D knows to wait for it.
2. `prefilled`: the first token is known (or the request ended before): P's queue shrinks.
3. `release`: the request left D (finished, failed or moved): its blocks are unbooked, its promise
   withdrawn, and the waiters try again. `replan` places a running request again after a failure,
   away from the workers that failed it.
Health results (`set_healthy`) and replaced workers (`replace_worker`) land here too, and an
operator's role split (`pin_split`, `router.split`): while it is pinned no flip back is priced.
This is the only code that changes the book, with the `RoleFlipper` it owns (which opens and
closes flex slots); both run on the router's event loop.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from typing import NamedTuple

from engine.block_manager import prefix_keys
from engine.errors import InvalidRequestError
from router.admission import ModelLimits
from router.book import Booking, DecodeSlot, PoolBook, PrefillSlot
from router.config import RouterConfig
from router.cost_model import Correction, CostModel
from router.elastic import Elastic, RoleFlipper
from router.metrics import Metrics
from router.policy import NoCapacity, OutputLengthEstimator, Placement, Policy, PoolState, RequestFeatures, make_policy
from router.prefix_index import PrefixIndex
from router.split import Mechanism, RoleSplit
from router.wait_queue import WaitQueue
from worker_core.protocol import WorkerInfo

log = logging.getLogger(__name__)


class _Unreserved(NamedTuple):
    """A remote booking whose decode worker has not yet reserved blocks for its prompt."""

    engine: tuple[str, int]  # the engine receiving the KV (`Placer._engine`)
    keys: frozenset[int]  # its prompt's prefix keys
    made: asyncio.Event  # set once the reservation is made (or never will be)


def _decode_slot(info: WorkerInfo) -> DecodeSlot:
    return DecodeSlot(info.worker_id, info.num_blocks, info.block_size, info.max_num_seqs)


def _flex_slot(info: WorkerInfo) -> DecodeSlot:
    """A prefill worker's flex slot: half its KV pool (the other half stays for the prompts it
    prefills), closed until the worker is flipped to decode."""
    return DecodeSlot(info.worker_id, info.num_blocks // 2, info.block_size, info.max_num_seqs, flex=True,
                      accepting=False)


class Placer:
    """Implements `router.request.Planner`.

    Args: prefill / decode: the workers' `WorkerInfo`, index-aligned with the pools; limits; config;
    cost: the calibrated cost model; metrics; estimator: real output lengths (fed on release);
    lender: threads lent between roles on a node (`router.elastic.ThreadLender`), told when a prompt
    is booked on a prefill worker; None: no lending. With `config.flip_roles` the placer flips roles
    itself (`router.elastic.RoleFlipper`; not together with a lender).
    """

    def __init__(self, prefill: list[WorkerInfo], decode: list[WorkerInfo], limits: ModelLimits,
                 config: RouterConfig, cost: CostModel, metrics: Metrics, estimator: OutputLengthEstimator,
                 lender: Elastic | None = None) -> None:
        if lender is not None and config.flip_roles:
            raise ValueError("flip_roles and lent threads are two ways to use an idle prefill worker; choose one")
        self.config, self._limits, self._metrics, self._estimator = config, limits, metrics, estimator
        self.book = PoolBook([PrefillSlot(i.worker_id) for i in prefill], [_decode_slot(i) for i in decode],
                             [_flex_slot(i) for i in prefill] if config.flip_roles else None)
        self.correction = Correction()  # what serving shows the cost model to miss; every policy applies it
        self.policy = make_policy(config.policy, cost, config.ttft_target_s, config.tpot_target_s, self.correction)
        self._local_policy = make_policy("always_local", cost, correction=self.correction)
        self.queue = WaitQueue(config.max_queued, config.queue_timeout_s, metrics)
        self.elastic: Elastic | None = RoleFlipper(self.book) if config.flip_roles else lender
        self.prefix = PrefixIndex()  # what each worker's prefix cache holds (the health poll keeps it)
        # Remote bookings not yet reserved on their decode worker, and the local bookings that wait for such a
        # reservation before they start (`reservations_made`).
        self._unreserved: dict[Booking, _Unreserved] = {}
        self._waits: dict[Booking, list[asyncio.Event]] = {}
        self._block_size, self._kv_bytes_per_token = decode[0].block_size, decode[0].kv_bytes_per_token

    # -- placing ---------------------------------------------------------------------------------
    async def place(self, features: RequestFeatures, deadline: float | None, prompt: list[int]) -> Booking:
        """Place and book a new request (`prompt`: its token ids); waits (bounded; until its own monotonic
        `deadline` at most) while no decode worker has room. Raises OverloadedError, DeadlineExceeded,
        InvalidRequestError."""
        keys = self._keys(prompt)
        placement = await self._place(features, keys, self.policy, frozenset(), deadline)
        self._metrics.decisions.labels(self.policy.name, placement.path, placement.reason).inc()
        self._metrics.prompt_tokens.inc(features.prompt_tokens)
        return self._admit(placement, features.prompt_tokens, features.max_tokens, keys)

    async def replan(self, prompt: list[int], max_tokens: int, avoid: set[str], local: bool) -> Booking:
        """Place a running request again, away from the workers in `avoid`; `local` forces local prefill."""
        policy = self._local_policy if local else self.policy
        features, keys = RequestFeatures(len(prompt), max_tokens, max_tokens), self._keys(prompt)
        placement = await self._place(features, keys, policy, avoid, None)
        self._metrics.decisions.labels(policy.name, placement.path, "recovery").inc()
        return self._admit(placement, len(prompt), max_tokens, keys)

    def _keys(self, prompt: list[int]) -> list[int]:
        """The prompt's prefix keys when placement is prefix-aware (none otherwise)."""
        return prefix_keys(prompt, self._block_size) if self.config.prefix_aware else []

    async def _place(self, features: RequestFeatures, keys: list[int], policy: Policy,
                     avoid: frozenset[str] | set[str], deadline: float | None) -> Placement:
        limit = self.queue.limit(deadline)
        while True:
            placement = self._priced_place(policy, features, self._state(avoid, keys))
            if isinstance(self.elastic, RoleFlipper) and self.elastic.moved and self.elastic.pinned is None:
                alt = self._priced_place(policy, features, self._state(avoid, keys, unflipped=True))
                if alt is not None and alt.path == "remote" and self.elastic.flipped(alt.prefill) and (
                        placement is None or alt.cost + RoleFlipper.FLIP_BACK_GAIN < placement.cost):
                    placement = replace(alt, reason="flip_back")  # worth its prefill worker back (`_admit` flips it)
            if placement is not None:
                if placement.path == "remote" and self._limits.prefill_blocks is not None and \
                        self._limits.blocks(features.prompt_tokens) > self._limits.prefill_blocks:
                    raise InvalidRequestError("prompt", "is longer than a prefill worker's KV budget holds")
                log.debug("%s on %s (%s) %s", placement.path, placement.decode, placement.reason, placement.detail)
                return placement
            await self.queue.wait(limit, deadline)

    @staticmethod
    def _priced_place(policy: Policy, features: RequestFeatures, state: PoolState) -> Placement | None:
        try:
            return policy.place(features, state)
        except NoCapacity:
            return None

    def _state(self, avoid: frozenset[str] | set[str], keys: list[int], unflipped: bool = False) -> PoolState:
        """The book's view for one request: workers in `avoid` unhealthy, the tokens of the prompt
        (`keys`: its `prefix_keys`) each worker's cache holds, and the threads lent now (or, where no loan
        stands, those an idle prefill worker would lend a local prompt at once). A flex slot is its prefill
        worker's engine."""
        state, bs = self.book.state(unflipped), self._block_size
        loans = {}
        if self.elastic is not None:
            loans = {**self.elastic.offers(self.computing()[0]), **self.elastic.loans()}

        def held(pool: str, index: int) -> int:
            return self.prefix.matched(pool, index, keys) * bs if keys else 0
        return PoolState(
            tuple(replace(p, healthy=p.healthy and p.worker_id not in avoid, cached_tokens=held("prefill", i),
                          loan=loans.get(i)) for i, p in enumerate(state.prefill)),
            tuple(replace(d, healthy=d.healthy and d.worker_id not in avoid, cached_tokens=held(*self._engine(i)),
                          arriving_tokens=self.prefix.arriving_blocks(*self._engine(i), keys) * bs)
                  for i, d in enumerate(state.decode)))

    def _engine(self, decode: int) -> tuple[str, int]:
        """The worker whose engine serves a policy's decode index: a decode worker, or past them a
        prefill worker's flex slot."""
        n = len(self.book.decode)
        return ("decode", decode) if decode < n else ("prefill", decode - n)

    def _admit(self, placement: Placement, prompt_tokens: int, max_tokens: int, keys: list[int]) -> Booking:
        # A local prompt whose prefix is on its way to D (the `n` choices of one prompt) computes nothing until
        # that KV lands: it awaits KV like a remote one, and D's threads come back then (`prefilled`), not now.
        arriving = placement.prefill is None and self.prefix.arriving(*self._engine(placement.decode), keys)
        if self.elastic is not None:
            if placement.prefill is not None:
                self.elastic.reclaim(placement.prefill)  # back to prefill (its threads, its role) before its prompt
            elif not arriving:
                self.elastic.occupy(placement.decode)  # D prefills it: its threads come back first
        booking = self.book.admit(placement, prompt_tokens, max_tokens, arriving)
        if self.elastic is not None and placement.prefill is not None:
            self.elastic.nudge(*self.computing())
        elif self.elastic is not None and not arriving:  # what an idle prefill worker offered it (`_state`)
            self.elastic.lend_for(placement.decode, self.computing()[0])
        if keys:  # the workers computing and receiving the prompt hold its prefix from now on, as the next prompt sees it
            engine = self._engine(placement.decode)
            if placement.prefill is not None:
                self._unreserved[booking] = _Unreserved(engine, frozenset(keys), asyncio.Event())
            elif arriving:  # it waits on D for the first block D lacks: D must know that block is coming first
                first = keys[self.prefix.matched(*engine, keys, promises=False)]
                self._waits[booking] = [u.made for u in self._unreserved.values()
                                        if u.engine == engine and first in u.keys]
            booking.promise = self.prefix.promise_placed(placement.prefill, engine, keys)
        self._metrics.in_flight.inc()
        return booking

    # -- a running request -----------------------------------------------------------------------
    async def reservations_made(self, booking: Booking) -> None:
        """Returns once the decode worker has reserved the blocks of every remote prompt whose KV this local
        booking waits for (placed `arriving`; at once for any other). Sent before that reservation, a local
        prompt would find nothing pending there and compute the prefix on its way to it again."""
        for made in self._waits.pop(booking, ()):
            await made.wait()

    def _reserved(self, booking: Booking) -> None:
        """D reserved the booking's prompt blocks (or never will): the local prompts waiting for that start."""
        if (entry := self._unreserved.pop(booking, None)) is not None:
            entry.made.set()

    def shipping(self, booking: Booking, held_blocks: int) -> None:
        """D reserved blocks for the prompt: its remote prefill ships the prompt's KV but the `held_blocks`
        leading blocks D's cache holds."""
        self._reserved(booking)
        blocks = booking.decode.blocks_for(booking.prompt_tokens) - held_blocks
        self._metrics.kv_transfer_bytes.observe(blocks * booking.decode.block_size * self._kv_bytes_per_token)

    def prefilled(self, booking: Booking) -> None:
        """Its prefill is over (first token known, or it ended before). Idempotent."""
        if booking.prefill_open and booking.awaits_kv and booking.open and self.elastic is not None:
            self.elastic.occupy(booking.placement.decode)  # it decodes on D now: D's threads come back
        self.book.prefilled(booking)

    def release(self, booking: Booking, output_tokens: int, outcome: str) -> None:
        """It left its decode worker with `outcome`. Idempotent."""
        self._reserved(booking)
        self._waits.pop(booking, None)
        if not booking.open:
            return
        if booking.promise is not None:
            booking.promise.withdraw()
        self.book.finished(booking)
        if self.elastic is not None:
            self.elastic.nudge(*self.computing())
        self._metrics.in_flight.dec()
        if outcome in ("stop", "length"):
            self._estimator.observe(min(output_tokens, booking.max_tokens), booking.max_tokens, outcome)
        asyncio.get_running_loop().create_task(self.queue.notify())

    def observed(self, booking: Booking, ttft_s: float, tpot_s: float | None) -> None:
        """A request placed once and served to its end: its TTFT from placement and its TPOT (None
        with one output token) against what its placement estimated; the correction learns from
        them and the prediction error is a metric."""
        pl, m = booking.placement, self._metrics
        for quantity, actual, predicted in (("ttft", ttft_s, pl.est_ttft_s), ("tpot", tpot_s, pl.est_tpot_s)):
            if actual is None or (quantity == "ttft" and not booking.own_ttft):
                continue
            ratio = self.correction.observe(quantity, pl.path, actual, predicted)
            if ratio is not None:
                m.cost_error.labels(quantity, pl.path).observe(ratio)
                m.cost_correction.labels(quantity, pl.path).set(self.correction.factor(quantity, pl.path))

    def worker_failed(self, booking: Booking, pool: str) -> None:
        """A worker of the booking failed its part: no new requests go to it until it answers again."""
        slot = booking.decode if pool == "decode" else booking.prefill
        if slot is not None and slot.healthy:
            log.warning("%s worker %s failed; no new requests go to it until it answers again", pool, slot.worker_id)
            slot.healthy = False
            self._metrics.worker_failures.labels(pool).inc()

    # -- the role split --------------------------------------------------------------------------
    def split(self) -> RoleSplit:
        """The role split now: prefill workers in the prefill role, pinned or not, and the mechanism."""
        n = len(self.book.prefill)
        if isinstance(self.elastic, RoleFlipper):
            return RoleSplit(n, len(self.book.decode), n - self.elastic.moved, self.elastic.pinned,
                             Mechanism.FLIP_ROLES)
        mechanism = Mechanism.NONE if self.elastic is None else Mechanism.LEND_THREADS
        return RoleSplit(n, len(self.book.decode), n, None, mechanism)  # lent threads move no role

    def pin_split(self, prefill: int | None) -> RoleSplit:
        """Hold `prefill` prefill workers in the prefill role, the others flipped to decode (None: automatic
        flips again); requests in flight stay where they are, waiters try again. Returns the split now.
        Raises SplitUnavailable (no role flips), InvalidRequestError naming `prefill` (out of range)."""
        before = self.split()
        before.require_flips()
        if prefill is not None:
            before.check(prefill)
        assert isinstance(self.elastic, RoleFlipper)
        self.elastic.pin(prefill)
        after = self.split()
        self._metrics.observe_split(after)
        log.info("role split %s by the operator: %s", "pinned" if prefill is not None else "released",
                 after.describe())
        asyncio.get_running_loop().create_task(self.queue.notify())  # a flipped worker may have room
        return after

    # -- workers ---------------------------------------------------------------------------------
    def computing(self) -> tuple[list[int], list[int]]:
        """What the elastic mechanism acts on: the prompt tokens queued on each prefill worker, and
        the requests each decode worker computes (decoding or prefilling there; not those waiting
        for their KV)."""
        return ([s.queued_tokens for s in self.book.prefill],
                [s.running - s.awaiting_kv for s in self.book.decode])

    def slots(self, pool: str) -> list[PrefillSlot] | list[DecodeSlot]:
        """The book's slots of `pool` ("prefill" | "decode"), index-aligned with its workers (read only)."""
        return self.book.prefill if pool == "prefill" else self.book.decode

    def set_healthy(self, pool: str, index: int, healthy: bool) -> None:
        self.slots(pool)[index].healthy = healthy
        if pool == "prefill" and self.book.flex:
            self.book.flex[index].healthy = healthy  # one worker: its flex slot is as healthy as it is

    async def replace_worker(self, pool: str, index: int, info: WorkerInfo) -> None:
        """Worker `index` of `pool` was replaced by the one `info` describes: a fresh slot (bookings
        of the old worker keep charging the old slot), and the waiters try again."""
        self.prefix.reset(pool, index)
        if pool == "prefill":
            self.book.prefill[index] = PrefillSlot(info.worker_id)
            if self.book.flex:
                self.book.flex[index] = _flex_slot(info)
        else:
            self.book.decode[index] = _decode_slot(info)
        await self.queue.notify()

    def healthy(self) -> bool:
        return any(d.healthy for d in self.book.decode)
