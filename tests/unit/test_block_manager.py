"""Unit tests for engine.block_manager: pure Python, no torch, no model."""
from __future__ import annotations

import itertools

import pytest

from engine.block_manager import BlockManager
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

BS = 4
_ids = itertools.count()


def seq(tokens: list[int]) -> Sequence:
    return Sequence(f"r{next(_ids)}", list(tokens), SamplingParams(max_tokens=8))


def prefill(bm: BlockManager, s: Sequence) -> None:
    """Allocate `s` and compute its prompt: its full blocks are offered for reuse."""
    bm.allocate(s)
    bm.commit(s, s.num_cached_tokens, s.num_tokens)


def toks(n: int, base: int = 100) -> list[int]:
    return list(range(base, base + n))


def check_invariants(bm: BlockManager, live: list[Sequence]) -> None:
    """Each block's ref count equals the number of live tables holding it; free == unreferenced."""
    held: dict[int, int] = {}
    for s in live:
        assert len(set(s.block_table)) == len(s.block_table), "a table holds a block twice"
        for b in s.block_table:
            held[b] = held.get(b, 0) + 1
    for block in bm.blocks:
        assert block.ref_count == held.get(block.block_id, 0)
        assert (block.ref_count == 0) == (block.block_id in bm.free)
    for key, block_id in bm.cached.items():
        assert bm.blocks[block_id].key == key


def test_blocks_needed() -> None:
    bm = BlockManager(8, BS)
    assert [bm.blocks_needed(n) for n in (0, 1, 3, 4, 5, 8, 9)] == [0, 1, 1, 1, 2, 2, 3]


def test_allocate_and_free_ref_counts() -> None:
    bm = BlockManager(8, BS)
    a = seq(toks(9))
    assert bm.can_allocate(a)
    prefill(bm, a)
    assert len(a.block_table) == 3
    assert all(bm.blocks[b].ref_count == 1 for b in a.block_table)
    assert bm.num_free_blocks == 5
    check_invariants(bm, [a])
    with pytest.raises(AssertionError):
        prefill(bm, a)  # already holds blocks
    bm.free_seq(a)
    assert a.block_table == []
    assert bm.num_free_blocks == bm.num_blocks == 8
    check_invariants(bm, [])


def test_can_allocate_false_when_pool_short() -> None:
    bm = BlockManager(3, BS, enable_prefix_caching=False)
    assert not bm.can_allocate(seq(toks(13)))  # needs 4 blocks of 3
    a = seq(toks(8, base=1))
    prefill(bm, a)  # 2 blocks, 1 left
    assert bm.can_allocate(seq(toks(4, base=50)))
    assert not bm.can_allocate(seq(toks(5, base=50)))
    with pytest.raises(AssertionError):
        prefill(bm, seq(toks(5, base=50)))
    assert bm.num_free_blocks == 1  # a refused allocation takes nothing


def test_append_slot_grows_exactly_at_block_boundaries() -> None:
    bm = BlockManager(8, BS)
    s = seq(toks(3))
    prefill(bm, s)
    sizes = []
    for t in range(10):
        s.token_ids.append(500 + t)  # the sampled token; its KV is written by the next step
        assert bm.can_append(s)
        bm.append_slot(s)
        sizes.append(len(s.block_table))
        assert len(s.block_table) == bm.blocks_needed(s.num_tokens)
    # num_tokens goes 4..13: a new block exactly when the token count passes 4, 8, 12
    assert sizes == [1, 2, 2, 2, 2, 3, 3, 3, 3, 4]
    check_invariants(bm, [s])


def test_can_append_false_only_when_a_new_block_is_needed_and_none_free() -> None:
    bm = BlockManager(1, BS)
    s = seq(toks(2))
    prefill(bm, s)
    for t in range(2):  # 3, 4 tokens: still in block 0
        s.token_ids.append(t)
        assert bm.can_append(s)
        bm.append_slot(s)
    s.token_ids.append(9)  # 5th token needs a 2nd block
    assert not bm.can_append(s)


def test_prefix_reuse_of_full_blocks() -> None:
    bm = BlockManager(16, BS)
    shared = toks(2 * BS)
    a = seq(shared + [1, 2, 3])
    prefill(bm, a)
    b = seq(shared + [7, 8])
    assert bm.cached_prefix_len(b.token_ids) == 2 * BS
    prefill(bm, b)
    assert b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] != a.block_table[2]
    assert b.num_cached_tokens == 2 * BS
    assert bm.num_prefix_hits == 2 * BS
    assert [bm.blocks[x].ref_count for x in b.block_table] == [2, 2, 1]
    check_invariants(bm, [a, b])


def test_prefix_never_covers_the_last_prompt_token() -> None:
    bm = BlockManager(16, BS)
    prompt = toks(3 * BS)  # exactly 3 full blocks
    a = seq(prompt)
    prefill(bm, a)
    b = seq(prompt)
    prefill(bm, b)
    # the third block holds the last token, whose logits must be computed: not reused
    assert b.num_cached_tokens == 2 * BS
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    c = seq(prompt + [1])  # one more token: all three full blocks are reusable
    prefill(bm, c)
    assert c.num_cached_tokens == 3 * BS
    assert c.block_table[:3] == a.block_table
    check_invariants(bm, [a, b, c])


def test_blocks_are_offered_for_reuse_only_once_their_kv_is_computed() -> None:
    bm = BlockManager(16, BS)
    shared = toks(3 * BS)
    a = seq(shared + [1])
    bm.allocate(a)
    assert bm.cached_prefix_len(shared + [2]) == 0, "nothing is computed yet"
    bm.commit(a, 0, BS + 2)  # a first chunk: one full block and half of the next
    assert bm.cached_prefix_len(shared + [2]) == BS
    bm.commit(a, BS + 2, 3 * BS)
    b = seq(shared + [2])
    bm.allocate(b)
    assert b.block_table[:3] == a.block_table[:3] and b.num_cached_tokens == 3 * BS
    check_invariants(bm, [a, b])


def test_hash_chain_mismatch_is_not_reused() -> None:
    bm = BlockManager(16, BS)
    a = seq([1, 1, 1, 1] + [5, 6, 7, 8] + [9])
    prefill(bm, a)
    b = seq([2, 2, 2, 2] + [5, 6, 7, 8] + [9])  # same second block, different first block
    assert bm.cached_prefix_len(b.token_ids) == 0
    prefill(bm, b)
    assert b.num_cached_tokens == 0
    assert not set(a.block_table) & set(b.block_table)
    check_invariants(bm, [a, b])


def test_shared_blocks_stay_allocated_until_both_free() -> None:
    bm = BlockManager(8, BS)
    a, b = seq(toks(BS + 2)), seq(toks(BS + 3))
    prefill(bm, a)
    prefill(bm, b)
    shared = a.block_table[0]
    assert b.block_table[0] == shared and bm.blocks[shared].ref_count == 2
    bm.free_seq(a)
    assert bm.blocks[shared].ref_count == 1 and shared not in bm.free
    assert bm.num_free_blocks == 8 - 2
    bm.free_seq(b)
    assert bm.blocks[shared].ref_count == 0 and shared in bm.free
    assert bm.num_free_blocks == bm.num_blocks
    check_invariants(bm, [])


def test_freed_cached_blocks_are_reused_after_free() -> None:
    bm = BlockManager(8, BS)
    a = seq(toks(2 * BS + 1))
    prefill(bm, a)
    first_two = a.block_table[:2]
    bm.free_seq(a)
    b = seq(toks(2 * BS + 1))  # same prompt, after `a` finished
    assert bm.can_allocate(b)
    prefill(bm, b)
    assert b.block_table[:2] == first_two and b.num_cached_tokens == 2 * BS
    check_invariants(bm, [b])


def test_can_allocate_counts_free_cached_hits() -> None:
    """A cached hit sitting in the free list is not a spare block as well."""
    bm = BlockManager(3, BS)
    a = seq(toks(BS + 1))
    prefill(bm, a)
    bm.free_seq(a)  # block of toks(4) cached, all 3 free
    b = seq(toks(BS) + toks(2 * BS, base=900))  # hit 1 block, needs 2 new: 3 in all -> fits
    assert bm.can_allocate(b)
    c = seq(toks(BS) + toks(2 * BS + 1, base=900))  # hit 1, needs 3 new: 4 > 3
    assert not bm.can_allocate(c)


def test_decode_filled_blocks_become_cached() -> None:
    bm = BlockManager(8, BS)
    a = seq(toks(3))
    prefill(bm, a)
    for t in range(6):  # 9 tokens: 2 full blocks
        a.token_ids.append(700 + t)
        bm.append_slot(a)
        bm.commit(a, a.num_tokens - 1, a.num_tokens)
    b = seq(list(a.token_ids))
    prefill(bm, b)
    assert b.num_cached_tokens == 2 * BS
    assert b.block_table[:2] == a.block_table[:2]


def test_lru_evicts_least_recently_freed_cached_blocks_first() -> None:
    bm = BlockManager(4, BS)
    old, new = toks(BS + 1, base=100), toks(BS + 1, base=200)
    a = seq(old)
    prefill(bm, a)
    bm.free_seq(a)  # `old`'s first block cached, freed first
    b = seq(new)
    prefill(bm, b)
    bm.free_seq(b)  # `new`'s first block cached, freed later
    old_block, new_block = bm._cached_prefix(old)[0], bm._cached_prefix(new)[0]
    old_key = bm.blocks[old_block].key
    assert bm.cached[old_key] == old_block
    c = seq(toks(2 * BS + 1, base=300))  # 3 blocks: the 2 uncached ones, then one eviction
    prefill(bm, c)
    assert old_block in c.block_table and new_block not in c.block_table
    assert old_key not in bm.cached, "the evicted block's key must leave the cache"
    assert bm.cached_prefix_len(old) == 0
    assert bm.cached_prefix_len(new) == BS  # the more recently freed one survives
    check_invariants(bm, [c])


def test_uncached_free_blocks_are_taken_before_cached_ones() -> None:
    bm = BlockManager(6, BS)
    a = seq(toks(2 * BS + 1, base=100))  # 2 cached full blocks + 1 partial
    prefill(bm, a)
    bm.free_seq(a)
    b = seq(toks(2 * BS + 1, base=200))
    prefill(bm, b)
    bm.free_seq(b)  # free now: 2 partial blocks, 1 never used (all uncached), 4 cached
    c = seq(toks(BS, base=300))  # one new block: must not evict while an uncached block is free
    prefill(bm, c)
    assert bm.cached_prefix_len(toks(2 * BS + 1, base=100)) == 2 * BS
    assert bm.cached_prefix_len(toks(2 * BS + 1, base=200)) == 2 * BS
    d = seq(toks(BS, base=400))
    prefill(bm, d)  # another uncached block; still nothing evicted
    assert len(bm.cached) == 4 + 1 + 1  # a's 2, b's 2, c's and d's full single blocks
    e = seq(toks(BS, base=500))
    prefill(bm, e)  # only cached blocks are left: `a`'s tail block, freed least recently, goes
    assert bm.cached_prefix_len(toks(2 * BS + 1, base=100)) == BS
    assert bm.cached_prefix_len(toks(2 * BS + 1, base=200)) == 2 * BS
    check_invariants(bm, [c, d, e])


def test_prefix_caching_disabled_means_no_reuse() -> None:
    bm = BlockManager(16, BS, enable_prefix_caching=False)
    a = seq(toks(3 * BS + 1))
    prefill(bm, a)
    b = seq(toks(3 * BS + 1))
    assert bm.cached_prefix_len(b.token_ids) == 0
    prefill(bm, b)
    assert b.num_cached_tokens == 0 and not set(a.block_table) & set(b.block_table)
    assert bm.cached == {} and bm.num_prefix_hits == 0
    bm.free_seq(a)
    c = seq(toks(3 * BS + 1))
    prefill(bm, c)
    assert c.num_cached_tokens == 0
    check_invariants(bm, [b, c])


def test_prefix_keys_are_hashed_one_block_at_a_time():
    from engine.block_manager import iter_prefix_keys, prefix_keys

    tokens = list(range(1, 40))
    keys = iter_prefix_keys(tokens, 8)
    first = next(keys)  # the rest are not hashed until asked for: a cache miss ends the hashing
    assert [first, *keys] == prefix_keys(tokens, 8) and len(prefix_keys(tokens, 8)) == 4
    assert prefix_keys(tokens[:8], 8) == []  # the block holding the last token is never served
