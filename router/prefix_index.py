"""Which worker holds which prefix: the router's copy of every worker's prefix-cache keys.

Lifecycle: the health poll asks each worker for its cache events after the last one it applied
(`acked`) and `apply`s them (a worker that was asked from 0, or whose log no longer reaches back
that far, sends all it holds and the copy is replaced). The placer `promise`s each booked prompt's
keys to the workers that will hold its KV (the one computing it and, on the remote path, the decode
worker receiving it), until the request ends (`Promise.withdraw`): a prompt that shares the prefix
and arrives before a worker has reported those blocks (concurrent first turns over one system
prompt, the `n` choices of one prompt) is placed where the prefix is being computed or received,
and the worker's engine waits for it there instead of computing it again. `matched` tells the
placer how many leading blocks of a prompt (`engine.block_manager.prefix_keys`) a worker holds or is
promised, and `arriving` whether a prompt placed there would wait for KV shipped to it. A replaced
worker starts empty (`reset`; promises made to the old one no longer count). A copy is at most one
poll behind its worker: the policy prices what it shows, and the decode worker's own reservation
decides what is really reused, so a stale entry costs a misjudged placement, never a wrong token.

Memory: one key per cached block of each worker, so bounded by the workers' KV pools (at most
`KEY_BYTES` per key, measured: 100k cached blocks take under 13 MB), whatever the number of
distinct prefixes served; promises: the prompt blocks of the requests in flight. Pure: no Ray, no
torch.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from engine.block_manager import CacheDelta

KEY_BYTES = 130  # a 128-bit int object and its slot in a set (measured ~128): the `approx_bytes` bound


@dataclass
class _Copy:
    keys: set[int] = field(default_factory=set)
    acked: int = 0


@dataclass(eq=False)
class Promise:
    """A booked prompt's keys counted as held by the workers that will hold its KV, until `withdraw`
    (idempotent)."""

    held: tuple[Counter[int], ...]  # each worker's promised keys (a replaced worker's go with its counter)
    keys: tuple[int, ...]
    open: bool = True

    def withdraw(self) -> None:
        if self.open:
            self.open = False
            for held in self.held:
                held.subtract(self.keys)
                for key in self.keys:
                    if held[key] <= 0:
                        del held[key]


class PrefixIndex:
    """Per worker (pool, index): the keys of the blocks its prefix cache holds, and those promised to it."""

    def __init__(self) -> None:
        self._copies: dict[tuple[str, int], _Copy] = {}
        self._promised: dict[tuple[str, int], Counter[int]] = {}
        self._receiving: dict[tuple[str, int], Counter[int]] = {}  # of those, the keys whose KV is shipped there

    def acked(self, pool: str, index: int) -> int:
        """The last event number applied for the worker (0: none; ask for everything)."""
        copy = self._copies.get((pool, index))
        return copy.acked if copy else 0

    def apply(self, pool: str, index: int, delta: CacheDelta) -> None:
        """Apply what the worker reported since `acked`."""
        copy = self._copies.setdefault((pool, index), _Copy())
        if delta.reset:
            copy.keys = set(delta.stored)
        else:
            copy.keys.difference_update(delta.evicted)
            copy.keys.update(delta.stored)
        copy.acked = delta.seq

    def reset(self, pool: str, index: int) -> None:
        """The worker was replaced: its successor's cache starts empty."""
        self._copies.pop((pool, index), None)
        self._promised.pop((pool, index), None)
        self._receiving.pop((pool, index), None)

    def promise(self, workers: Iterable[tuple[str, int]], keys: list[int]) -> Promise:
        """`keys` (a booked prompt's `prefix_keys`) count as held by `workers` (pool, index: those that
        compute or receive the prompt's KV) until the returned promise is withdrawn."""
        held = tuple(self._promised.setdefault(worker, Counter()) for worker in dict.fromkeys(workers))
        for counter in held:
            counter.update(keys)
        return Promise(held, tuple(keys))

    def promise_placed(self, prefill: int | None, decode: tuple[str, int], keys: list[int]) -> Promise:
        """A placed prompt's promise: to prefill worker `prefill` (remote; None: local) and to the engine
        `decode` names (pool, index), which computes the prompt (local) or receives its KV (remote: those
        keys are `arriving` there too)."""
        promise = self.promise(([("prefill", prefill)] if prefill is not None else []) + [decode], keys)
        if prefill is not None:
            receiving = self._receiving.setdefault(decode, Counter())
            receiving.update(keys)
            promise.held += (receiving,)
        return promise

    def matched(self, pool: str, index: int, keys: list[int], promises: bool = True) -> int:
        """How many leading blocks of `keys` (a prompt's `prefix_keys`) the worker holds or is promised
        (held only: not `promises`)."""
        copy = self._copies.get((pool, index))
        promised = self._promised.get((pool, index)) if promises else None
        held = copy.keys if copy is not None else frozenset()
        n = 0
        for key in keys:
            if key not in held and not (promised and key in promised):
                break
            n += 1
        return n

    def arriving(self, pool: str, index: int, keys: list[int]) -> bool:
        """Whether a prompt (its `prefix_keys`) placed on the worker would wait there for KV on its way: the
        first of its blocks the worker's cache lacks is one another request's remote prefill ships there."""
        return self.arriving_blocks(pool, index, keys) > 0

    def arriving_blocks(self, pool: str, index: int, keys: list[int]) -> int:
        """How many of a prompt's blocks, from the first the worker's cache lacks, other requests' remote
        prefills ship there (0: it would not wait for KV on its way)."""
        held, receiving = self.matched(pool, index, keys, promises=False), self._receiving.get((pool, index))
        if not receiving:
            return 0
        n = 0
        for key in keys[held:]:
            if key not in receiving:
                break
            n += 1
        return n

    def keys(self, pool: str, index: int) -> frozenset[int]:
        """The keys held for the worker (a copy)."""
        copy = self._copies.get((pool, index))
        return frozenset(copy.keys) if copy else frozenset()

    def size(self) -> int:
        """Keys held for all workers."""
        return sum(len(c.keys) for c in self._copies.values())

    def approx_bytes(self) -> int:
        return self.size() * KEY_BYTES
