"""Which worker holds which prefix: the block manager's cache events, the router's index built from them,
and the policy pricing only what a worker's cache does not hold. Pure."""
from __future__ import annotations

import pytest

from engine.block_manager import BlockManager, CacheDelta, CacheEventLog, prefix_keys
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from router.policy import DecodeLoad, PoolState, PrefillLoad, RatioPolicy, RequestFeatures
from router.prefix_index import PrefixIndex
from tests.unit.test_policy import COST, TARGETS


def test_the_event_log_hands_out_what_came_after_the_reader_s_last_event() -> None:
    log = CacheEventLog(limit=4)
    assert log.since(0) == log.since(0) and log.since(0).reset and log.since(0).stored == ()
    log.record(True, 1)
    log.record(True, 2)
    first = log.since(0)  # from nothing: all it holds
    assert first.reset and set(first.stored) == {1, 2} and first.seq == 2
    log.record(False, 1)
    log.record(True, 3)
    delta = log.since(first.seq)
    assert (delta.stored, delta.evicted, delta.reset, delta.seq) == ((3,), (1,), False, 4)
    assert log.since(4).stored == log.since(4).evicted == ()
    for key in (5, 6, 7):  # the log keeps the last 4 events: a reader at event 2 fell behind
        log.record(True, key)
    behind = log.since(2)
    assert behind.reset and set(behind.stored) == {2, 3, 5, 6, 7} and behind.seq == 7
    assert log.since(99).reset  # a number this log never gave (another worker's): everything


def seq(rid: str, tokens: list[int]) -> Sequence:
    return Sequence(rid, list(tokens), SamplingParams(max_tokens=4))


def test_the_block_manager_reports_the_keys_it_stores_and_evicts() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    a = seq("a", list(range(10, 22)))  # 12 tokens: 3 full blocks
    bm.allocate(a)
    bm.commit(a, 0, 12)
    stored = bm.events.since(0)
    assert set(stored.stored) == set(prefix_keys(a.token_ids + [0], 4))  # all three, as a longer prompt sees them
    bm.free_seq(a)
    b = seq("b", list(range(50, 66)))  # 4 fresh blocks: every cached block is evicted
    bm.allocate(b)
    delta = bm.events.since(stored.seq)
    assert not delta.reset and set(delta.evicted) == set(stored.stored) and delta.stored == ()


def test_the_index_follows_each_worker_and_forgets_a_replaced_one() -> None:
    log, index = CacheEventLog(limit=100), PrefixIndex()
    keys = prefix_keys(list(range(100)), 16)  # 6 full blocks before the last token
    for k in keys[:4]:
        log.record(True, k)
    index.apply("decode", 0, log.since(index.acked("decode", 0)))
    assert index.matched("decode", 0, keys) == 4 and index.matched("decode", 1, keys) == 0
    log.record(False, keys[1])  # evicted: the prefix now ends after block 0
    index.apply("decode", 0, log.since(index.acked("decode", 0)))
    assert index.matched("decode", 0, keys) == 1 and index.keys("decode", 0) == {keys[0], *keys[2:4]}
    assert index.size() == 3
    assert index.approx_bytes() == 3 * 130
    index.reset("decode", 0)
    assert index.matched("decode", 0, keys) == 0 and index.acked("decode", 0) == 0


def test_a_decode_worker_holding_the_history_prefills_the_next_turn_itself() -> None:
    """A 2000-token prompt with a short answer goes remote on cold caches. When the decode worker holds
    1920 tokens of it, only 80 are left to compute there: local wins. When the prefill worker holds it
    instead, remote gets cheaper than it was."""
    policy, req = RatioPolicy(COST, *TARGETS), RequestFeatures(2000, 20, 20)

    def state(p_cached: int = 0, d_cached: int = 0) -> PoolState:
        return PoolState((PrefillLoad("p", 0, cached_tokens=p_cached),),
                         (DecodeLoad("d", 3, 10_000, 16, cached_tokens=d_cached),))
    assert policy.place(req, state()).path == "remote"
    warm = policy.place(req, state(d_cached=1920))
    assert warm.path == "local" and warm.est_ttft_s < policy.place(req, state()).est_ttft_s / 5
    assert policy.place(req, state(p_cached=1920)).est_ttft_s < policy.place(req, state()).est_ttft_s / 5
    with pytest.raises(ValueError, match="cached_tokens"):
        DecodeLoad("d", 0, 10, 16, cached_tokens=-1)


def test_the_index_of_100k_distinct_prefixes_stays_within_its_stated_bound() -> None:
    """100k distinct cached blocks over 4 workers (more than their pools hold in practice): the router's
    copy stays within `KEY_BYTES` per key, as the module docstring states."""
    import random
    import tracemalloc

    from router.prefix_index import KEY_BYTES

    rng = random.Random(0)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        index = PrefixIndex()
        for i in range(4):  # keys arrive as a worker's answer does: new int objects, the answer then dropped
            index.apply("decode", i, CacheDelta(1, tuple(rng.getrandbits(128) for _ in range(25_000)), (), True))
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert index.size() == 100_000 and used <= 100_000 * KEY_BYTES, used


def test_a_prompt_booked_on_a_worker_promises_it_the_prefix_until_the_request_ends() -> None:
    """Concurrent first turns over one system prompt: before the worker computing the first one has
    reported a block, the second sees the prefix on it (the engine there waits for it rather than
    computing it again). The promise ends with the request, and one made to a replaced worker does not
    count for its successor."""
    index = PrefixIndex()
    system = list(range(100))
    first, second = prefix_keys(system + [7] * 20, 16), prefix_keys(system + [9] * 20, 16)
    promise = index.promise([("prefill", 0)], first)
    assert index.matched("prefill", 0, second) == 6 and index.matched("decode", 0, second) == 0
    again = index.promise([("prefill", 0)], first)  # two requests, one prefix
    promise.withdraw()
    promise.withdraw()  # idempotent
    assert index.matched("prefill", 0, second) == 6
    again.withdraw()
    assert index.matched("prefill", 0, second) == 0
    stale = index.promise([("decode", 1)], first)
    index.reset("decode", 1)
    fresh = index.promise([("decode", 1)], second)
    stale.withdraw()  # the old worker's request ends after its replacement took new work
    assert index.matched("decode", 1, second) == 7
    fresh.withdraw()
    assert index.matched("decode", 1, second) == 0


def test_the_book_queues_only_what_the_prefilling_worker_computes() -> None:
    """A prompt whose prefix the worker holds queues only the rest there, and the policy's next
    estimate sees that queue, not the whole prompt."""
    from router.book import DecodeSlot, PoolBook, PrefillSlot

    book = PoolBook([PrefillSlot("p")], [DecodeSlot("d", 10_000, 16, 64)])
    state = PoolState((PrefillLoad("p", 0, cached_tokens=1920),), (DecodeLoad("d", 0, 10_000, 16),))
    pl = RatioPolicy(COST, *TARGETS).place(RequestFeatures(2000, 20, 20), state)
    assert pl.path == "remote" and pl.computed_tokens == 80
    booking = book.admit(pl, 2000, 20)
    assert book.state().prefill[0].queued_tokens == 80 and booking.computed_tokens == 80
    book.prefilled(booking)
    assert book.state().prefill[0].queued_tokens == 0


def test_a_prompt_is_arriving_where_a_remote_prefill_ships_its_next_block() -> None:
    """Remote: the decode worker is promised the prompt and receives it (arriving); the prefill worker and a
    local placement's worker are promised it but compute it (not arriving). A block the cache holds
    already is not arriving; the next one is. Withdrawn or replaced, nothing arrives."""
    index = PrefixIndex()
    keys = prefix_keys(list(range(100)), 16)
    remote = index.promise_placed(0, ("decode", 0), keys)
    assert index.matched("prefill", 0, keys) == index.matched("decode", 0, keys) == 6
    assert index.arriving("decode", 0, keys) and not index.arriving("prefill", 0, keys)
    assert index.arriving_blocks("decode", 0, keys) == 6 and index.arriving_blocks("prefill", 0, keys) == 0
    longer = prefix_keys(list(range(100)) + [7] * 60, 16)  # the 6 shipped blocks, then 4 nobody ships
    assert longer[:6] == keys and index.arriving_blocks("decode", 0, longer) == 6
    local = index.promise_placed(None, ("decode", 1), keys)
    assert index.matched("decode", 1, keys) == 6 and not index.arriving("decode", 1, keys)
    index.apply("decode", 0, CacheDelta(1, tuple(keys[:2]), (), True))  # it holds the first two already
    assert index.arriving("decode", 0, keys) and not index.arriving("decode", 0, keys[:2])
    assert index.arriving_blocks("decode", 0, keys) == 4  # from the first block it lacks
    remote.withdraw()
    local.withdraw()
    assert not index.arriving("decode", 0, keys) and index.matched("decode", 1, keys) == 0
    index.promise_placed(0, ("decode", 0), keys)
    index.reset("decode", 0)
    assert not index.arriving("decode", 0, keys)
