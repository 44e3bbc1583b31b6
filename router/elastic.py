"""Compute moved between roles, two ways: the prefill and decode worker of a node lend each other
their threads whenever one has nothing to compute (`ThreadLender`), or a prefill worker with nothing
to prefill serves decode itself (`RoleFlipper`); either way the lender has its compute back the
moment it gets work.

`ThreadLender` lifecycle (both ways: whichever worker of a pair has nothing to compute lends its
threads to the other):
1. At start the router pairs each prefill worker with a decode worker on the same Ray node (one
   each; workers on nodes of their own stay unpaired); each paired decode worker compiles its decode
   step for the lent thread count then (a compiled step is specialised to its thread count) and
   measures how much faster it decodes and prefills with it (`WorkerBase.profile_threads`), which the
   policy prices loans with. Threads are CPU compute: `pdserve serve` lends only between CPU workers (a GPU
   worker's compute is its device; flipping roles moves that).
2. After every load poll, `rebalance` looks at the router's book: a decode worker that has computed
   nothing (no request decoding or prefilling there; those waiting for their KV do not count) for
   two polls in a row lends its threads to the prefill worker, where prompts come first (a prompt-
   heavy load prefills with both workers' threads); otherwise a prefill worker with no prompt
   tokens queued for two polls lends its threads to the decode worker (decode-heavy load decodes
   with both). A decode worker that runs out of work while its prefill worker has prompts queued
   lends at once, without waiting for polls (`nudge`, as the book changes): under prompt-heavy load
   each prompt's short decode would otherwise leave the next prompt prefilling on half the threads
   for two polls. The other way, a prefill worker with nothing queued offers its threads to its decode
   worker's next local prompt (`offers`: the policy prices that prompt with them) and lends them the
   moment one is booked there (`lend_for`), not two polls later: otherwise, while turns keep reaching
   the prefill worker within two polls of each other, it never lends, a local prompt is priced on the
   decode worker's own threads, and the placements settle remote although both paths would serve
   better local with the loan (BENCHMARKS.md, "conversations that arrive over time").
3. The lender takes them back the moment it has work: `reclaim` (the placer books a prompt on the
   prefill worker) and `occupy` (a request starts computing on the decode worker: its local
   prefill is booked, or its remote prefill is done). The borrower returns to its own threads at
   its next step (for at most that one step both share the cores). While a loan lasts the placer
   shows it to the policy (`loans`): the borrower computes faster, and a request that takes the
   threads back is charged what the borrower's work loses (until they are lent again, `relend_s`
   after the lender runs out of work).
4. A replaced worker starts with its own threads: `reset` ends the pair's loans; a replaced decode
   worker borrows again once its step is compiled for the lent count.
Threads change between engine steps only (a worker command), never inside one.

`RoleFlipper` lifecycle (a prefill worker is a decode worker too, see `prefill_worker`):
1. After every load poll, `rebalance` flips a prefill worker to decode once the book has shown it
   with no prompt tokens queued for two polls in a row: its flex slot accepts requests, which the
   policy may place on it like on any decode worker, local path only, and it is no prefill
   candidate (decode-heavy load spreads over both batches with local prefill).
2. For each request the placer also prices the placement it would get were the flipped workers
   prefill workers again; only when that one sends the prompt to a flipped worker and is cheaper
   by `FLIP_BACK_GAIN` (a long prompt that would stall a batch, say) does it take it, and `reclaim`
   flips that worker back: its flex slot takes no new requests; those it runs keep decoding
   there, in the same steps as the prompt's chunks, until they end (the policy priced that ride
   and the stall it puts on them). Nothing moves and nothing is dropped.
3. A replaced prefill worker starts as a prefill worker (`reset`).
An operator may pin the split instead (`pin`, from `POST /pdserve/split`, `router.split`): N prefill
workers hold the prefill role, the others are flipped to decode at once and stay so (idle polls
flip none, no prompt flips one back: the placer then prefills on the remaining prefill workers or
locally); a replaced worker takes its pinned role. Those flipped first are the unhealthy ones
(the healthy keep prefilling), then the ones flipped already, then those with the fewest prompt
tokens queued (what they queued is still prefilled there; only new prompts go elsewhere).
`pin(None)` makes flips automatic again from the roles as they stand.
A flip is a change in the router's book only: instant, no worker call, no process started. On GPU
pools it is the same mechanism (a device changes role), which threads cannot be.

Both implement `Elastic`. Only the event loop touches them. No engine, no torch.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import ray

if TYPE_CHECKING:
    from router.book import PoolBook
    from router.pools import Pools

from router.policy import Loan
from worker_core.protocol import ThreadSpeedup

log = logging.getLogger(__name__)


IDLE_POLLS = 2  # polls of a worker with nothing to compute before its compute goes to the other role


class Elastic(Protocol):
    """What the router tells a mechanism that moves compute between roles."""

    def rebalance(self, queued_tokens: list[int], decoding: list[int]) -> None:
        """After a load poll, with the book's prompt tokens queued on each prefill worker and the
        requests each decode worker decodes or prefills itself (not those waiting for their KV)."""

    def reclaim(self, prefill: int) -> None:
        """A prompt is being booked on prefill worker `prefill`: it is a prefill worker again, now."""

    def occupy(self, decode: int) -> None:
        """A request starts computing on decode worker `decode` (a local prefill booked, or a remote
        one done): it computes with its own threads again, now."""

    def nudge(self, queued_tokens: list[int], decoding: list[int]) -> None:
        """Between polls, as the book changes (a prompt booked, a request gone): as `rebalance`'s
        lists; a decode worker computing nothing lends now if its prefill worker has prompts queued."""

    def reset(self, pool: str, index: int) -> None:
        """Worker `index` of `pool` was replaced: it starts in its own role."""

    def loans(self) -> dict[int, Loan]:
        """The loans standing now, by prefill worker index (for the policy's view)."""

    def offers(self, queued_tokens: list[int]) -> dict[int, Loan]:
        """The loans a prefill worker would make at once for a local prompt on its decode worker
        (`lend_for`), by prefill worker index, with the book's prompt tokens queued on each (for the
        policy's view, where no loan stands)."""

    def lend_for(self, decode: int, queued_tokens: list[int]) -> None:
        """A local prompt was booked on decode worker `decode` (after `occupy`): what `offers` showed for
        it is lent now."""

    @property
    def moved(self) -> int:
        """Prefill workers whose compute serves decode now."""

    @property
    def moved_to_prefill(self) -> int:
        """Decode workers whose compute serves prefill now."""


@dataclass
class _Pair:
    prefill: int  # index into the pools
    decode: int
    speedup: ThreadSpeedup  # how much faster a worker of the pair computes with both workers' threads
    idle_polls: int = 0  # consecutive polls with nothing queued on the prefill worker
    quiet_polls: int = 0  # consecutive polls with nothing computing on the decode worker
    lent: bool = False  # the decode worker computes with both workers' threads
    borrowed: bool = False  # the prefill worker does
    ready: bool = True  # the decode worker's step is compiled for the lent thread count


class ThreadLender:
    """Args: pools: the live workers; pairs: (prefill index, decode index, how much faster either
    decodes and prefills with both workers' threads) of workers sharing a node; threads: each worker's
    own thread count; poll_s: seconds between the router's load polls (a loan comes `IDLE_POLLS` polls
    after the lender runs out of work)."""

    def __init__(self, pools: Pools, pairs: list[tuple[int, int, ThreadSpeedup]], threads: int,
                 poll_s: float) -> None:
        self._pools, self._threads = pools, threads
        self._pairs = [_Pair(p, d, speedup) for p, d, speedup in pairs]
        self.relend_s = IDLE_POLLS * poll_s
        self.lent_count = 0  # times a prefill worker's threads were lent, for tests and logs
        self.borrowed_count = 0  # times a decode worker's were

    @classmethod
    def on_same_nodes(cls, pools: Pools, threads: int, poll_s: float) -> ThreadLender:
        """Pair the workers by the Ray node they run on; each paired decode worker compiles its decode
        step for the lent thread count now rather than at its first loan, and measures what the loan
        buys it, decode steps and prefills apart (the same engine on the same node, so the prefill
        worker is taken to gain as much; at least 1: a noisy measurement never makes a loan look
        harmful) (blocking, seconds)."""
        nodes = ray.get([w.node_id.remote() for w in pools.prefill + pools.decode])
        prefill_nodes, decode_nodes = nodes[:len(pools.prefill)], nodes[len(pools.prefill):]
        free = list(range(len(decode_nodes)))
        pairs = []
        for p, node in enumerate(prefill_nodes):
            d = next((d for d in free if decode_nodes[d] == node), None)
            if d is not None:
                free.remove(d)
                pairs.append((p, d))
        ray.get([pools.decode[d].prepare_threads.remote(2 * threads) for _, d in pairs])
        measured: list[ThreadSpeedup] = ray.get([pools.decode[d].profile_threads.remote(2 * threads)
                                                 for _, d in pairs])
        speedups = [ThreadSpeedup(max(1.0, s.decode), max(1.0, s.prefill)) for s in measured]
        for (p, d), s in zip(pairs, speedups):
            log.info("decode worker %d decodes %.2fx and prefills %.2fx as fast with prefill worker %d's threads",
                     d, s.decode, s.prefill, p)
        return cls(pools, [(p, d, s) for (p, d), s in zip(pairs, speedups)], threads, poll_s)

    @property
    def pairs(self) -> list[tuple[int, int]]:
        return [(x.prefill, x.decode) for x in self._pairs]

    def describe(self) -> str:
        """The pairs for a start-up line, e.g. "prefill worker 0 and decode worker 0 (decode 1.25x, prefill
        1.85x faster with both's)"."""
        return "; ".join(f"prefill worker {x.prefill} and decode worker {x.decode} (decode {x.speedup.decode:.2f}x, "
                         f"prefill {x.speedup.prefill:.2f}x faster with both's)"
                         for x in self._pairs) or "none (no prefill and decode worker share a node)"

    @property
    def moved(self) -> int:
        return sum(x.lent for x in self._pairs)

    @property
    def moved_to_prefill(self) -> int:
        return sum(x.borrowed for x in self._pairs)

    def lent_to(self, decode: int) -> bool:
        """Whether decode worker `decode` runs with a prefill worker's threads now."""
        return any(x.lent and x.decode == decode for x in self._pairs)

    def borrowing(self, prefill: int) -> bool:
        """Whether prefill worker `prefill` runs with a decode worker's threads now."""
        return any(x.borrowed and x.prefill == prefill for x in self._pairs)

    def loans(self) -> dict[int, Loan]:
        return {x.prefill: self._loan(x, to_decode=x.lent) for x in self._pairs if x.lent or x.borrowed}

    def offers(self, queued_tokens: list[int]) -> dict[int, Loan]:
        """Pairs with no loan either way, a step compiled for the lent count, and nothing queued on the
        prefill worker: its threads, for the decode worker's next local prompt. A prompt sent to the prefill
        worker instead has nothing to reclaim, but the policy prices it as for a standing loan: what the
        decode worker's streams go without, for its prefill and until the threads are lent again."""
        return {x.prefill: self._loan(x, to_decode=True) for x in self._pairs
                if x.ready and not (x.lent or x.borrowed) and queued_tokens[x.prefill] == 0}

    def lend_for(self, decode: int, queued_tokens: list[int]) -> None:
        """A local prompt was booked on decode worker `decode`: the prefill worker paired with it lends its
        threads now if it has nothing queued (the prompt prefills with them from the decode worker's next
        step, as `offers` priced it)."""
        for x in self._pairs:
            if x.decode == decode and x.ready and not x.lent and queued_tokens[x.prefill] == 0:
                self._lend(x)

    def _loan(self, x: _Pair, to_decode: bool) -> Loan:
        return Loan(x.decode, x.speedup.decode, x.speedup.prefill, self.relend_s, to_decode=to_decode)

    def rebalance(self, queued_tokens: list[int], decoding: list[int]) -> None:
        """After a poll: a pair whose decode worker has computed nothing for `IDLE_POLLS` polls lends its
        threads to the prefill worker (prompts come there first); otherwise one whose prefill worker has
        had nothing queued that long lends them to the decode worker."""
        for x in self._pairs:
            x.idle_polls = x.idle_polls + 1 if queued_tokens[x.prefill] == 0 else 0
            x.quiet_polls = x.quiet_polls + 1 if decoding[x.decode] == 0 else 0
            if x.quiet_polls >= IDLE_POLLS or (x.quiet_polls and queued_tokens[x.prefill]):
                self._borrow(x)
            elif x.idle_polls >= IDLE_POLLS and x.ready and not x.lent:
                self._lend(x)

    def reclaim(self, prefill: int) -> None:
        """A prompt is being sent to prefill worker `prefill`: threads it lent come back now."""
        for x in self._pairs:
            if x.prefill == prefill:
                x.idle_polls = 0
                self._end_loan(x)

    def occupy(self, decode: int) -> None:
        """A request starts computing on decode worker `decode`: threads it lent come back now (the
        prefill worker computes with its own from its next step)."""
        for x in self._pairs:
            if x.decode == decode:
                x.quiet_polls = 0
                self._end_borrow(x)

    def nudge(self, queued_tokens: list[int], decoding: list[int]) -> None:
        """A decode worker computing nothing lends at once while its prefill worker has prompts queued
        (they are prefilled with both workers' threads from its next step)."""
        for x in self._pairs:
            if decoding[x.decode] == 0 and queued_tokens[x.prefill]:
                x.quiet_polls = max(x.quiet_polls, 1)
                self._borrow(x)

    def _lend(self, x: _Pair) -> None:
        self._end_borrow(x)
        x.lent = True
        self.lent_count += 1
        self._set("decode", x.decode, 2 * self._threads)

    def _borrow(self, x: _Pair) -> None:
        if not x.borrowed:
            self._end_loan(x)
            x.borrowed = True
            self.borrowed_count += 1
            self._set("prefill", x.prefill, 2 * self._threads)

    def reset(self, pool: str, index: int) -> None:
        """Worker `index` of `pool` was replaced: it (and its partner) start over from their own threads.
        A new decode worker borrows again once its step is compiled for the lent count (in the background)."""
        for x in self._pairs:
            if (pool == "prefill" and x.prefill == index) or (pool == "decode" and x.decode == index):
                if pool == "prefill":  # the survivor gives back what it holds; a new worker has its own
                    self._end_loan(x)
                    x.borrowed = False
                else:
                    self._end_borrow(x)
                    x.lent, x.ready = False, False
                    asyncio.get_running_loop().create_task(self._prepare(x))
                x.idle_polls = x.quiet_polls = 0

    def _end_loan(self, x: _Pair) -> None:
        if x.lent:
            x.lent = False
            self._set("decode", x.decode, self._threads)

    def _end_borrow(self, x: _Pair) -> None:
        if x.borrowed:
            x.borrowed = False
            self._set("prefill", x.prefill, self._threads)

    async def _prepare(self, pair: _Pair) -> None:
        try:
            await self._pools.decode[pair.decode].prepare_threads.remote(2 * self._threads)
        except ray.exceptions.RayError as e:  # it died too: its own replacement prepares again
            log.debug("decode worker %d did not prepare for lent threads: %r", pair.decode, e)
        else:
            pair.ready = True

    def _set(self, pool: str, index: int, threads: int) -> None:
        workers = self._pools.decode if pool == "decode" else self._pools.prefill
        ref = workers[index].set_threads.remote(threads)  # applied between its steps
        asyncio.get_running_loop().create_task(_quietly(ref, pool, index, threads))


async def _quietly(ref: ray.ObjectRef, pool: str, index: int, threads: int) -> None:
    try:
        await ref
    except ray.exceptions.RayError as e:  # a dead worker: its replacement starts with its own threads
        log.debug("%s worker %d did not take %d threads: %r", pool, index, threads, e)


class RoleFlipper:
    """Flips idle prefill workers to serve decode through their flex slots in `book` (`router.book`)."""

    FLIP_BACK_GAIN = 1.0  # how much cheaper (in the ratio policy's units: a missed target's worth) a
    # placement that needs a flipped worker's prefill must be than the best one without it

    def __init__(self, book: PoolBook) -> None:
        assert len(book.flex) == len(book.prefill), "role flips need a flex slot per prefill worker"
        self._book = book
        self._idle = [0] * len(book.prefill)  # consecutive polls with nothing queued, per prefill worker
        self._held: list[bool] | None = None  # pinned: per prefill worker, whether it is held flipped
        self.flips = 0  # times a prefill worker was flipped to decode, for tests and logs

    @property
    def pinned(self) -> int | None:
        """The prefill workers an operator holds in the prefill role; None: flips are automatic."""
        return None if self._held is None else self._held.count(False)

    def pin(self, prefill: int | None) -> None:
        """Hold `prefill` prefill workers in the prefill role and flip the others to decode, now and until
        pinned again; None: automatic flips from the roles as they stand. Requests in flight stay where
        they are. Raises ValueError for a count outside 0..prefill workers."""
        if prefill is None:
            self._held = None
            return
        n = len(self._book.prefill)
        if not 0 <= prefill <= n:
            raise ValueError(f"prefill: must be between 0 and {n} prefill workers, got {prefill}")
        flex, queued = self._book.flex, self._book.prefill
        order = sorted(range(n), key=lambda i: (queued[i].healthy, not flex[i].accepting, queued[i].queued_tokens,
                                                -i))
        self._held = [False] * n
        for i in order[:n - prefill]:
            self._held[i] = True
        for i in range(n):
            self._hold(i)

    def _hold(self, i: int) -> None:
        """Prefill worker `i` takes its pinned role."""
        slot, flipped = self._book.flex[i], self._held[i]
        if flipped and not slot.accepting:
            self.flips += 1
            log.info("prefill worker %s flipped to decode (pinned)", slot.worker_id)
        elif slot.accepting and not flipped:
            log.info("prefill worker %s back to prefill (pinned)", slot.worker_id)
        slot.accepting = flipped

    @property
    def moved(self) -> int:
        return sum(slot.accepting for slot in self._book.flex)

    @property
    def moved_to_prefill(self) -> int:
        return 0  # a decode worker keeps its role

    def loans(self) -> dict[int, Loan]:
        return {}  # a flipped worker's compute shows as its flex slot instead

    def offers(self, queued_tokens: list[int]) -> dict[int, Loan]:
        return {}  # a flipped worker computes for decode through its flex slot: no threads move

    def lend_for(self, decode: int, queued_tokens: list[int]) -> None:
        pass

    def flipped(self, prefill: int) -> bool:
        """Whether prefill worker `prefill` takes decode requests now."""
        return self._book.flex[prefill].accepting

    def rebalance(self, queued_tokens: list[int], decoding: list[int]) -> None:
        for i, queued in enumerate(queued_tokens):
            self._idle[i] = self._idle[i] + 1 if queued == 0 else 0
            if self._held is not None:
                continue  # pinned: roles change only when pinned again
            slot = self._book.flex[i]
            if self._idle[i] >= IDLE_POLLS and not slot.accepting:
                slot.accepting = True
                self.flips += 1
                log.debug("prefill worker %s flipped to decode", slot.worker_id)

    def reclaim(self, prefill: int) -> None:
        """Pinned, the placer books prompts on prefill workers that hold the prefill role only (a
        flipped worker is no prefill candidate, and no flip back is priced)."""
        self._idle[prefill] = 0
        assert not (self._held and self._held[prefill]), "a prompt booked on a prefill worker pinned to decode"
        self._book.flex[prefill].accepting = False

    def occupy(self, decode: int) -> None:
        pass  # a decode worker's compute stays its own

    def nudge(self, queued_tokens: list[int], decoding: list[int]) -> None:
        pass  # a prefill worker flips after idle polls only

    def reset(self, pool: str, index: int) -> None:
        if pool == "prefill":
            self._idle[index] = 0  # its fresh flex slot does not accept yet
            if self._held is not None:
                self._hold(index)  # pinned: the new worker takes the role the old one held
