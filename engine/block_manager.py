"""Fixed-size KV blocks with reference counts and automatic prefix caching. No torch.

A full block is keyed by the hash chain of its tokens (its own tokens and the key of the
block before it). A new sequence reuses the cached blocks of its longest cached prefix.
Freed blocks keep their key until they are reused: the free list is ordered least recently
freed first, so the prefix cache evicts least-recently-used blocks when free blocks run out.

A block is keyed by `commit` once the KV of all its tokens has been computed (or has landed
from a prefill worker), never before: a prompt prefilled in chunks over several steps offers
only what it has finished. Until then a block this engine is computing, or is receiving from a
prefill worker, is *pending* under the key it will get (`computing`): a prompt whose next uncached
block another sequence is computing or receiving waits for it (`computing_prefix`) rather than
computing the same KV again, so concurrent prompts that share a prefix (one system prompt, many
first turns, the `n` choices of one prompt) compute it once and, on a decode worker, receive it
once.

Every key that enters the cache (stored) or leaves it (evicted) goes to a `CacheEventLog`, which
other threads read: the router learns from it which worker holds which prefix (`prefix_keys`
gives a prompt's keys the same way).
"""
from __future__ import annotations

import hashlib
import threading
from array import array
from collections import OrderedDict, deque
from collections.abc import Iterator
from dataclasses import dataclass

from engine.sequence import Sequence


class Block:
    __slots__ = ("block_id", "key", "pending", "ref_count", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.key: int | None = None
        self.token_ids: tuple[int, ...] = ()
        self.pending: int | None = None  # the key it gets once its KV is computed (`computing`)


def chain_key(prev_key: int | None, token_ids: tuple[int, ...]) -> int:
    """Key of a full block: depends on its tokens and on every token before it.

    A cryptographic hash (blake2b), so crafted prompts cannot collide with another prefix."""
    h = hashlib.blake2b(digest_size=16)
    h.update((prev_key or 0).to_bytes(16, "little"))
    h.update(array("q", token_ids).tobytes())
    return int.from_bytes(h.digest(), "little")


def iter_prefix_keys(token_ids: list[int], block_size: int) -> Iterator[int]:
    """The keys of the full blocks of a prompt that a cache can serve, first block first, each hashed
    only when asked for: every full block before the one holding the prompt's last token (whose
    logits must be computed)."""
    key = None
    for start in range(0, len(token_ids) - block_size, block_size):
        key = chain_key(key, tuple(token_ids[start:start + block_size]))
        yield key


def prefix_keys(token_ids: list[int], block_size: int) -> list[int]:
    """Every key of `iter_prefix_keys`, as a list."""
    return list(iter_prefix_keys(token_ids, block_size))


@dataclass(frozen=True)
class CacheDelta:
    """What entered (`stored`) and left (`evicted`) a prefix cache after the event number its reader
    gave, up to event `seq`; with `reset`, `stored` is every key it holds now (the reader fell too far
    behind, or asked from 0) and `evicted` is empty."""

    seq: int
    stored: tuple[int, ...]
    evicted: tuple[int, ...]
    reset: bool


class CacheEventLog:
    """The keys a prefix cache stores and evicts, numbered, the last `limit` of them kept. Written by the
    engine thread, read by any (one lock; neither side waits on the other's work)."""

    def __init__(self, limit: int) -> None:
        assert limit > 0
        self._lock = threading.Lock()
        self._events: deque[tuple[int, bool, int]] = deque(maxlen=limit)  # (number, stored, key)
        self._live: set[int] = set()
        self._seq = 0

    def record(self, stored: bool, key: int) -> None:
        with self._lock:
            self._seq += 1
            self._events.append((self._seq, stored, key))
            (self._live.add if stored else self._live.discard)(key)

    def since(self, acked: int) -> CacheDelta:
        """Args: the last event number the reader has (0: none). Returns: what came after it."""
        with self._lock:
            oldest = self._events[0][0] if self._events else self._seq + 1
            if acked <= 0 or acked < oldest - 1 or acked > self._seq:  # behind the kept events, or another log's
                return CacheDelta(self._seq, tuple(self._live), (), True)
            new = [(stored, key) for n, stored, key in self._events if n > acked]
        return CacheDelta(self._seq, tuple(k for st, k in new if st), tuple(k for st, k in new if not st), False)


class BlockManager:
    """Allocates KV blocks to sequences.

    Args:
        num_blocks: blocks in the pool.
        block_size: tokens per block.
        enable_prefix_caching: keep and reuse full blocks by their key.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        assert num_blocks > 0 and block_size > 0
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.events = CacheEventLog(2 * num_blocks)
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # key -> block id
        self.pending: dict[int, int] = {}  # key -> the block being computed for it (`computing`)
        self.num_prefix_hits = 0  # tokens served from the cache, for stats

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def blocks_needed(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    # -- prefix lookup -----------------------------------------------------------------
    def _cached_prefix(self, token_ids: list[int]) -> list[int]:
        """Block ids holding the longest cached prefix; never the prompt's last token,
        whose logits must be computed."""
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        bs = self.block_size
        for i, key in enumerate(iter_prefix_keys(token_ids, bs)):  # lazily: a miss ends the hashing
            block_id = self.cached.get(key)
            if block_id is None or self.blocks[block_id].token_ids != tuple(token_ids[i * bs:(i + 1) * bs]):
                break
            hits.append(block_id)
        return hits

    def computing_prefix(self, token_ids: list[int]) -> bool:
        """Whether the first block of `token_ids` past its cached prefix is being computed by another
        sequence: waiting for it costs less than computing it again (its keys then reach further)."""
        if not self.enable_prefix_caching or not self.pending:
            return False
        bs = self.block_size
        for i, key in enumerate(iter_prefix_keys(token_ids, bs)):
            block_id = self.cached.get(key)
            if block_id is None or self.blocks[block_id].token_ids != tuple(token_ids[i * bs:(i + 1) * bs]):
                return key in self.pending
        return False

    def computing(self, seq: Sequence) -> None:
        """`seq`'s prompt blocks past its cached prefix are computed here, or received here, from now on:
        each is pending under its key until `commit` keys it, or it is freed."""
        if not self.enable_prefix_caching:
            return
        first = seq.num_cached_tokens // self.block_size
        for i, key in enumerate(iter_prefix_keys(seq.token_ids, self.block_size)):
            if i >= first and self.pending.setdefault(key, seq.block_table[i]) == seq.block_table[i]:
                self.blocks[seq.block_table[i]].pending = key

    def cached_prefix_len(self, token_ids: list[int]) -> int:
        """Tokens of `token_ids` whose KV the prefix cache holds now."""
        return len(self._cached_prefix(token_ids)) * self.block_size

    def can_allocate(self, seq: Sequence) -> bool:
        return self._fits(seq, self._cached_prefix(seq.token_ids))

    def _fits(self, seq: Sequence, hits: list[int]) -> bool:
        reusable_free = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        new = self.blocks_needed(seq.num_tokens) - len(hits)
        return new + reusable_free <= self.num_free_blocks

    def allocate(self, seq: Sequence, use_cache: bool = True) -> None:
        """Give `seq` blocks for all its tokens, reusing cached prefix blocks (not with
        `use_cache=False`: KV that will arrive from elsewhere). New blocks are keyed by `commit`."""
        assert not seq.block_table, f"{seq.request_id} already holds blocks"
        hits = self._cached_prefix(seq.token_ids)
        assert self._fits(seq, hits), f"{seq.request_id}: not enough free blocks"
        if not use_cache:
            hits = []
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
        seq.num_cached_tokens = len(hits) * self.block_size
        self.num_prefix_hits += seq.num_cached_tokens
        for _ in range(self.blocks_needed(seq.num_tokens) - len(hits)):
            seq.block_table.append(self._take_free())

    def commit(self, seq: Sequence, start: int, end: int) -> None:
        """The KV of `seq`'s tokens [start, end) is in the pool: key the blocks it fills for reuse."""
        self._register_full_blocks(seq, start // self.block_size, end // self.block_size)

    def can_append(self, seq: Sequence) -> bool:
        """Whether the token appended last (whose KV the next step writes) has a slot."""
        return len(seq.block_table) >= self.blocks_needed(seq.num_tokens) or self.num_free_blocks > 0

    def append_slot(self, seq: Sequence) -> None:
        """Make room for the KV of `seq`'s last token."""
        if len(seq.block_table) < self.blocks_needed(seq.num_tokens):
            seq.block_table.append(self._take_free())

    def free_seq(self, seq: Sequence) -> None:
        """Release `seq`'s blocks; cached ones stay reusable until evicted."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0
            if block.ref_count == 0:
                self._settle(block)
                self.free[block_id] = None
                if block.key is None or self.cached.get(block.key) != block_id:
                    self.free.move_to_end(block_id, last=False)  # uncached: reuse before evicting
        seq.block_table = []  # num_cached_tokens stays for reporting; allocate() sets it anew

    # -- internals -----------------------------------------------------------------------
    def _settle(self, block: Block) -> None:
        """`block` is no longer being computed (keyed, or freed before it was)."""
        if block.pending is not None:
            if self.pending.get(block.pending) == block.block_id:
                del self.pending[block.pending]
            block.pending = None

    def _take_free(self) -> int:
        block_id, _ = self.free.popitem(last=False)  # least recently freed first
        block = self.blocks[block_id]
        if block.key is not None and self.cached.get(block.key) == block_id:
            del self.cached[block.key]  # evict
            self.events.record(False, block.key)
        block.key, block.token_ids, block.ref_count = None, (), 1
        return block_id

    def _register_full_blocks(self, seq: Sequence, start: int, end: int) -> None:
        """Key blocks [start, end) of `seq`'s table (the blocks before them are keyed)."""
        if not self.enable_prefix_caching or start >= end:
            return
        bs = self.block_size
        key = self.blocks[seq.block_table[start - 1]].key if start > 0 else None
        for i in range(start, end):
            block = self.blocks[seq.block_table[i]]
            chunk = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            key = chain_key(key, chunk)
            self._settle(block)
            if block.key is None:
                block.key, block.token_ids = key, chunk
                if self.cached.setdefault(key, block.block_id) == block.block_id:
                    self.events.record(True, key)
