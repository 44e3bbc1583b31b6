"""Unit tests for engine.scheduler, driven with fake model outputs (token ids fed to `update`)."""
from __future__ import annotations

import itertools
import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.block_manager import BlockManager
from engine.sampling_params import SamplingParams
from engine.scheduler import Batch, Scheduler
from engine.sequence import FinishReason, Sequence, SequenceStatus

BS = 4
_ids = itertools.count()


def stop_on_max_tokens(seq: Sequence) -> FinishReason | None:
    return FinishReason.LENGTH if seq.num_output_tokens >= seq.sampling.max_tokens else None


def make_seq(n: int, max_tokens: int = 8, base: int = 0) -> Sequence:
    return Sequence(f"r{next(_ids)}", [base + i for i in range(n)], SamplingParams(max_tokens=max_tokens))


def make(*seqs: Sequence, num_blocks: int = 64, max_num_seqs: int = 8, max_tokens: int = 1024,
         caching: bool = True, chunk: int | None = None) -> Scheduler:
    """A scheduler over a fresh pool, with `seqs` added in order."""
    sched = Scheduler(BlockManager(num_blocks, BS, caching), max_num_seqs, max_tokens, stop_on_max_tokens, chunk)
    for s in seqs:
        sched.add(s)
    return sched


def step(sched: Scheduler, token: int = 1) -> Batch | None:
    """One engine step; `batch.computed` keeps the tokens computed, read before `update` grows the seqs."""
    batch = sched.schedule()
    if batch is not None:
        batch.computed = batch.num_tokens  # type: ignore[attr-defined]
        batch.per_seq = [1] * len(batch.decode) + [c.end - c.start for c in batch.prefill]  # type: ignore[attr-defined]
        sched.update(batch, [token] * len(batch.sampled))
    return batch


def chunks(batch: Batch) -> list[tuple[Sequence, int, int]]:
    return [(c.seq, c.start, c.end) for c in batch.prefill]


def test_prefill_respects_max_num_seqs() -> None:
    seqs = [make_seq(3, base=10 * i) for i in range(3)]
    sched = make(*seqs, max_num_seqs=2)
    b = step(sched)
    assert b.is_prefill and b.seqs == seqs[:2]
    b = step(sched)  # the running set is full: decode, the third keeps waiting
    assert not b.is_prefill and b.seqs == seqs[:2]
    assert list(sched.waiting) == [seqs[2]] and seqs[2].status is SequenceStatus.WAITING


def test_the_token_budget_is_filled_with_a_chunk_of_the_next_prompt() -> None:
    seqs = [make_seq(4, base=10 * i) for i in range(3)]
    sched = make(*seqs, max_tokens=10)
    b = step(sched)
    assert chunks(b) == [(seqs[0], 0, 4), (seqs[1], 0, 4), (seqs[2], 0, 2)] and b.computed == 10
    assert b.sampled == seqs[:2] and seqs[2].num_output_tokens == 0  # no token before its prompt is done
    b = step(sched)  # the two decode next to the rest of the third prompt
    assert b.decode == seqs[:2] and chunks(b) == [(seqs[2], 2, 4)] and b.sampled == seqs
    assert [s.num_output_tokens for s in seqs] == [2, 2, 1]


def test_a_long_prompt_is_prefilled_in_chunks_next_to_the_running_batch() -> None:
    short1, long_, short2 = make_seq(3, base=0), make_seq(25, base=100), make_seq(3, base=200)
    sched = make(short1, long_, short2, max_tokens=9, chunk=6)
    b = step(sched)
    assert chunks(b) == [(short1, 0, 3), (long_, 0, 6)]  # each prompt's chunk is at most 6 tokens
    assert chunks(step(sched)) == [(long_, 6, 12)]  # 1 decode token; prompts get at most a chunk's worth
    b = step(sched)
    assert b.decode == [short1] and chunks(b) == [(long_, 12, 18)] and b.sampled == [short1]
    b = step(sched)
    assert b.decode == [short1] and chunks(b) == [(long_, 18, 24)]
    b = step(sched)  # the long prompt's last token runs as a decode row; the next prompt starts
    assert b.decode == [short1, long_] and chunks(b) == [(short2, 0, 3)]
    assert b.sampled == [short1, long_, short2]
    assert [s.num_output_tokens for s in (short1, long_, short2)] == [5, 1, 1]


def test_a_prompt_alone_goes_whole_within_the_budget() -> None:
    """Nothing decodes and no other prompt waits: no chunks (they would hold nobody up less); a second
    prompt arriving makes both move in chunks again; the budget still bounds a step."""
    a, b_ = make_seq(9), make_seq(30, base=100)
    sched = make(a, max_tokens=20, chunk=4)
    assert chunks(step(sched)) == [(a, 0, 9)]
    sched.add(b_)
    b = step(sched)
    assert b.decode == [a] and chunks(b) == [(b_, 0, 4)]
    sched.abort(a.request_id)
    assert chunks(step(sched)) == [(b_, 4, 24)]  # alone again: the rest, up to the budget
    assert chunks(step(sched)) == [(b_, 24, 30)]


def test_while_sequences_decode_only_a_chunk_that_completes_its_prompt_joins_the_first() -> None:
    """Past a shared step's first prompt chunk, a prompt joins only with the rest of it: a part of it would
    delay the step's first tokens without finishing it sooner. Its cached prefix does not count."""
    running = make_seq(8, base=500)
    a, b_, c = make_seq(5, base=100), make_seq(5, base=200), make_seq(2, base=300)
    over_cache = Sequence("over-cache", running.token_ids[:8] + [900, 901], SamplingParams(max_tokens=8))
    sched = make(running, max_tokens=32, chunk=8)
    step(sched)  # alone: whole, and its two blocks keyed
    for s in (a, b_, c):
        sched.add(s)
    b = step(sched)
    assert b.decode == [running] and chunks(b) == [(a, 0, 5)]  # b_ does not fit the 3 left: not split
    b = step(sched)
    assert chunks(b) == [(b_, 0, 5), (c, 0, 2)]  # c's 2 fit the 3 left: it joins whole
    long_ = make_seq(22, base=700)
    sched.add(long_)
    sched.add(over_cache)
    assert chunks(step(sched)) == [(long_, 0, 8)]  # a step's first chunk may be part of its prompt
    assert chunks(step(sched)) == [(long_, 8, 16)]
    assert chunks(step(sched)) == [(long_, 16, 22), (over_cache, 8, 10)]  # its 2 uncached tokens fit the 2 left


def test_without_decoding_sequences_several_chunks_fill_the_budget() -> None:
    a, b_ = make_seq(20, base=0), make_seq(20, base=100)
    sched = make(a, b_, max_tokens=10, chunk=6)
    assert chunks(step(sched)) == [(a, 0, 6), (b_, 0, 4)]
    assert chunks(step(sched)) == [(a, 6, 12), (b_, 4, 8)]


def test_decode_batch_contains_all_running() -> None:
    seqs = [make_seq(3 + i, base=10 * i) for i in range(4)]
    sched = make(*seqs)
    assert step(sched).is_prefill
    b = step(sched)
    assert not b.is_prefill and b.seqs == seqs and b.computed == 4
    assert all(s.num_output_tokens == 2 for s in seqs)


def test_sequences_join_mid_run() -> None:
    a = make_seq(5, max_tokens=6)
    sched = make(a)
    step(sched)
    step(sched)
    b = make_seq(5, max_tokens=3, base=50)
    sched.add(b)
    batch = step(sched)  # the newcomer's prefill runs next to the running one's decode
    assert batch.decode == [a] and chunks(batch) == [(b, 0, 5)]
    assert a.num_output_tokens == 3 and b.num_output_tokens == 1
    batch = step(sched)
    assert not batch.is_prefill and batch.seqs == [a, b]
    while sched.has_unfinished():
        step(sched)
    assert a.num_output_tokens == 6 and b.num_output_tokens == 3
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def test_finished_sequences_free_their_blocks() -> None:
    a = make_seq(6, max_tokens=2)
    sched = make(a, num_blocks=8, caching=False)
    step(sched)
    assert sched.block_manager.num_free_blocks == 6
    finished_batch = sched.schedule()
    done = sched.update(finished_batch, [7])
    assert done == [a] and a.is_finished and a.finish_reason is FinishReason.LENGTH
    assert a.block_table == [] and not sched.running
    assert sched.block_manager.num_free_blocks == 8 and not sched.has_unfinished()


def test_preemption_when_blocks_run_out() -> None:
    seqs = [make_seq(4, max_tokens=8, base=10 * i) for i in range(3)]  # 1 block each
    sched = make(*seqs, num_blocks=5, caching=False)
    a, b, c = seqs
    assert step(sched).seqs == seqs  # 5 tokens each: the first decode needs 3 more blocks, 2 free
    batch = step(sched)
    assert batch.seqs == [a, b], "the newest running sequence is preempted"
    assert sched.num_preemptions == 1 and c.num_preemptions == 1
    assert c.status is SequenceStatus.WAITING and c.block_table == [] and list(sched.waiting) == [c]
    assert sched.running == [a, b]
    assert sched.block_manager.num_free_blocks == 5 - 4
    generated = list(c.token_ids)
    assert len(generated) == 5  # prompt + the token it got at prefill
    late = make_seq(2, base=90)
    sched.add(late)
    while c.status is SequenceStatus.WAITING:
        assert late.status is SequenceStatus.WAITING, "a preempted sequence goes before later arrivals"
        batch = step(sched)
    assert batch.is_prefill and c in batch.seqs
    assert c.token_ids[:5] == generated and c.num_tokens == 6  # prompt + generated, then one new token
    assert batch.per_seq[batch.seqs.index(c)] == 5  # recomputed: prompt + generated tokens, none cached
    while sched.has_unfinished():
        step(sched)
    assert all(s.num_output_tokens == 8 for s in seqs + [late])
    assert sched.num_preemptions == sum(s.num_preemptions for s in seqs + [late]) >= 1
    assert sched.block_manager.num_free_blocks == 5


def test_preemptions_of_several_keep_arrival_order_in_waiting() -> None:
    seqs = [make_seq(4, max_tokens=8, base=10 * i) for i in range(3)]
    sched = make(*seqs, num_blocks=5, caching=False)
    while sched.num_preemptions < 2:
        step(sched)
    a, b, c = seqs
    assert list(sched.waiting) == [b, c] and sched.running == [a]  # b (older) preempted after c, goes first


def test_preempted_sequence_reuses_its_cached_prefix() -> None:
    a, b = make_seq(8, max_tokens=8, base=0), make_seq(5, max_tokens=8, base=50)
    sched = make(a, b, num_blocks=5)
    step(sched)  # a: 2 blocks, b: 2 blocks, 1 free
    while b.status is SequenceStatus.RUNNING:
        batch = step(sched)
    assert batch.seqs == [a] and b.num_preemptions == 1
    while b.status is SequenceStatus.WAITING:
        batch = step(sched)
    assert batch.is_prefill and batch.seqs == [b]
    assert b.num_cached_tokens == BS  # its first full block survived in the prefix cache
    assert batch.computed == b.num_tokens - 1 - BS


def test_a_prompt_waits_for_a_shared_prefix_being_computed_and_reuses_it() -> None:
    """Three prompts at once, two sharing a 3-block prefix: the shared blocks are computed once (the
    second waits for them, then hits the cache), and the unrelated prompt is not held up."""
    shared = list(range(100, 100 + 3 * BS))
    a, b = make_seq(3 * BS + 2, base=0), make_seq(3 * BS + 3, base=0)
    a.token_ids[:3 * BS] = shared
    b.token_ids[:3 * BS] = shared
    other = make_seq(5, base=500)
    sched = make(a, b, other, chunk=2 * BS)
    first = step(sched)
    assert [s for s, _, _ in chunks(first)] == [a, other]  # b passed over: its next block is a's
    assert list(sched.waiting) == [b]
    step(sched)  # a's second chunk: the shared prefix is in the cache now
    computed = 0
    while sched.has_unfinished():
        batch = step(sched)
        computed += sum(end - start for s, start, end in chunks(batch) if s is b)
    assert b.num_cached_tokens == 3 * BS
    assert computed == 3  # only b's own tokens
    assert b.finish_reason is FinishReason.LENGTH and not sched.block_manager.pending


def test_a_prompt_waiting_for_a_shared_prefix_goes_ahead_when_its_computer_is_aborted() -> None:
    shared = list(range(100, 100 + 3 * BS))
    a, b = make_seq(3 * BS + 2), make_seq(3 * BS + 3)
    a.token_ids[:3 * BS] = shared
    b.token_ids[:3 * BS] = shared
    sched = make(a, b, chunk=BS)
    step(sched)
    assert list(sched.waiting) == [b]
    sched.abort(a.request_id)
    assert not sched.block_manager.pending
    batch = step(sched)
    assert chunks(batch) == [(b, BS, len(b.prompt_token_ids))]  # b reuses a's computed block; alone: the rest whole


def test_abort_waiting_and_running() -> None:
    run, wait = make_seq(6, base=0), make_seq(6, base=50)
    sched = make(run, wait, num_blocks=8, max_num_seqs=1)
    step(sched)
    assert sched.block_manager.num_free_blocks == 6
    assert sched.abort(wait.request_id) is wait
    assert wait.finish_reason is FinishReason.ABORT and wait.is_finished and not sched.waiting
    assert sched.abort(run.request_id) is run
    assert run.finish_reason is FinishReason.ABORT and run.block_table == [] and not sched.running
    assert sched.block_manager.num_free_blocks == 8
    assert sched.abort("nope") is None and not sched.has_unfinished()
    assert sched.schedule() is None


def test_abort_between_schedule_and_update() -> None:
    """An abort that lands while a step runs: the step's token must not revive the sequence."""
    a, b = make_seq(5, max_tokens=2, base=0), make_seq(5, max_tokens=4, base=50)
    sched = make(a, b, num_blocks=8)
    step(sched)
    batch = sched.schedule()
    sched.abort(a.request_id)
    finished = sched.update(batch, [3, 3])
    assert a not in finished and a.finish_reason is FinishReason.ABORT
    assert a.num_output_tokens == 1 and b.num_output_tokens == 2


# -- randomized: a tiny pool, many sequences, prefix sharing, preemption ---------------------------

class FakeRunner:
    """Checks the KV a step reads was written for exactly these tokens, as the real pool would hold it."""

    def __init__(self, bm: BlockManager) -> None:
        self.bm = bm
        self.pool: dict[int, tuple[int, ...]] = {}  # slot -> the token prefix whose last KV it holds

    def slot(self, seq: Sequence, pos: int) -> int:
        return seq.block_table[pos // BS] * BS + pos % BS

    def run(self, batch: Batch) -> None:
        writes = [(s, s.num_tokens - 1) for s in batch.decode] + [(c.seq, p) for c in batch.prefill
                                                                  for p in range(c.start, c.end)]
        step: dict[int, tuple[int, ...]] = {}
        for s, p in writes:
            assert p >= s.num_computed_tokens, "KV computed twice"
            assert self.bm.blocks[s.block_table[p // BS]].ref_count == 1, "a write into a block another sequence holds"
            kv = tuple(s.token_ids[:p + 1])
            assert step.setdefault(self.slot(s, p), kv) == kv, "two different writes to one slot in a step"
        self.pool.update(step)  # the real attention writes a layer's K/V for the whole batch, then reads
        reads = [(s, s.num_tokens) for s in batch.decode] + [(c.seq, c.end) for c in batch.prefill]
        for s, end in reads:
            for p in range(end):
                assert self.pool.get(self.slot(s, p)) == tuple(s.token_ids[:p + 1]), "stale KV read"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), num_blocks=st.integers(6, 14), max_num_seqs=st.integers(1, 6),
       budget=st.integers(4, 40), chunk=st.integers(1, 12), caching=st.booleans(),
       specs=st.lists(st.tuples(st.integers(1, 12), st.integers(1, 10), st.integers(0, 3)), min_size=1, max_size=12))
def test_random_workload_runs_to_completion(seed: int, num_blocks: int, max_num_seqs: int, budget: int, chunk: int,
                                            caching: bool, specs: list[tuple[int, int, int]]) -> None:
    """Chunks of any size, decode steps, arrivals, prefix hits and preemption: every step reads exactly
    the KV of its tokens, within the budget, and every sequence runs to its length with no block lost."""
    rng = random.Random(seed)
    bm = BlockManager(num_blocks, BS, caching)
    sched = Scheduler(bm, max_num_seqs, budget, stop_on_max_tokens, chunk)
    runner = FakeRunner(bm)
    prefixes = [[rng.randrange(4) for _ in range(2 * BS)] for _ in range(3)]
    pending = []
    for n, max_tokens, group in specs:
        max_tokens = min(max_tokens, num_blocks * BS - n)  # fits the pool alone, as the engine validates
        prompt = (prefixes[group - 1][:n] if group else []) + [rng.randrange(4) for _ in range(n)]
        prompt = prompt[:max(1, num_blocks * BS - max_tokens)]
        pending.append(Sequence(f"s{len(pending)}", prompt, SamplingParams(max_tokens=max(1, max_tokens))))
    all_seqs = list(pending)
    limit = 50 * sum(s.sampling.max_tokens + s.num_tokens for s in all_seqs)
    steps = 0
    while pending or sched.has_unfinished():
        if pending and (rng.random() < 0.5 or not sched.has_unfinished()):
            sched.add(pending.pop(0))  # arrivals between steps, also while others decode
        steps += 1
        assert steps <= limit, "no progress"
        alone = len(sched.running) + len(sched.waiting) == 1  # a lone prompt goes whole, within the budget
        batch = sched.schedule()
        assert batch is not None and batch.num_tokens >= 1, "work left but nothing scheduled"
        assert len(sched.running) <= max_num_seqs
        chunked = [c.seq for c in batch.prefill]
        assert batch.decode == [s for s in sched.running if s.num_uncomputed == 1 and s not in chunked], \
            "every decoding sequence runs"
        assert all(c.end - c.start <= (budget if alone else chunk) for c in batch.prefill)
        assert batch.num_prefill_tokens <= (min(chunk, budget - len(batch.decode)) if batch.decode else budget)
        runner.run(batch)
        sched.update(batch, [rng.randrange(4) for _ in batch.sampled])
        held = [b for s in sched.running for b in s.block_table]
        assert all(b.ref_count == held.count(b.block_id) >= 0 for b in bm.blocks)
        assert all(not s.block_table for s in sched.waiting)
    assert bm.num_free_blocks == num_blocks and all(b.ref_count == 0 for b in bm.blocks)
    assert not bm.pending and all(b.pending is None for b in bm.blocks)
    for s in all_seqs:
        assert s.finish_reason is FinishReason.LENGTH
        assert s.num_output_tokens == s.sampling.max_tokens
