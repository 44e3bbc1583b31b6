"""Scheduler states of a remote prefill: RECEIVING on the decode side, HELD on the prefill side."""
from __future__ import annotations

from engine.block_manager import BlockManager
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import FinishReason, Sequence, SequenceStatus

BS = 4


def stop(seq: Sequence) -> FinishReason | None:
    if seq.last_token_id == 0:  # token 0 plays EOS
        return FinishReason.STOP
    return FinishReason.LENGTH if seq.num_output_tokens >= seq.sampling.max_tokens else None


def make(num_blocks: int = 16) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, BS), max_num_seqs=4, max_num_batched_tokens=256, stop_check=stop)


def seq(rid: str, n: int = 10, max_tokens: int = 3) -> Sequence:
    return Sequence(rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens))


def test_reserved_blocks_are_not_reusable_until_activated():
    sched = make()
    a = seq("a")
    assert sched.reserve(a) and a.status is SequenceStatus.RECEIVING and len(a.block_table) == 3
    assert not sched.has_unfinished()  # nothing to step while the KV is in flight
    assert sched.block_manager.cached_prefix_len(a.token_ids + [99]) == 0  # not keyed before it lands
    sched.activate("a", first_token=7)
    assert a.status is SequenceStatus.RUNNING and a.output_token_ids == [7]
    assert sched.block_manager.cached_prefix_len(a.token_ids + [99]) == 8  # keyed once landed
    batch = sched.schedule()
    assert batch is not None and not batch.is_prefill and batch.seqs == [a]


def test_first_token_can_finish_the_request():
    sched = make()
    a = seq("a")
    sched.reserve(a)
    sched.activate("a", first_token=0)
    assert a.status is SequenceStatus.FINISHED and a.finish_reason is FinishReason.STOP
    assert sched.block_manager.num_free_blocks == 16


def test_reserve_refuses_without_room():
    sched = make(num_blocks=4)
    assert sched.reserve(seq("a", n=12))
    assert not sched.reserve(seq("b", n=8))
    assert sched.abort("a") is not None and sched.block_manager.num_free_blocks == 4


def test_prefill_only_is_held_until_released():
    sched = make()
    a = seq("a")
    a.prefill_only = True
    sched.add(a)
    batch = sched.schedule()
    sched.update(batch, [5])
    assert a.status is SequenceStatus.HELD and a.output_token_ids == [5] and not sched.running
    assert sched.block_manager.num_free_blocks == 13  # blocks kept while the KV is sent
    sched.release("a")
    assert a.status is SequenceStatus.FINISHED and sched.block_manager.num_free_blocks == 16


def test_a_prompt_sharing_a_prefix_that_is_arriving_waits_for_it_and_reuses_it():
    """The n choices of one prompt on a decode worker: the first is reserved for KV coming from a
    prefill worker; a local prompt with the same 2 full blocks waits (the next one, not sharing them,
    goes ahead) and, once the KV landed, computes only its own tokens on the received blocks, which both
    then hold."""
    sched = make()
    a, b, other = seq("a"), seq("b", n=10), Sequence("o", [50, 51, 52], SamplingParams(max_tokens=3))
    assert sched.reserve(a)
    sched.add(b)
    sched.add(other)
    batch = sched.schedule()
    assert [c.seq for c in batch.prefill] == [other] and list(sched.waiting) == [b]
    sched.update(batch, [5])
    assert sched.schedule().seqs == [other]  # b still waits: the blocks are not there yet
    sched.activate("a", first_token=7)
    batch = sched.schedule()
    chunk = next(c for c in batch.prefill if c.seq is b)
    assert (chunk.start, chunk.end) == (8, 10) and b.num_cached_tokens == 8
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert sched.block_manager.blocks[a.block_table[0]].ref_count == 2


def test_a_prompt_waiting_for_arriving_blocks_computes_them_when_the_transfer_is_aborted():
    sched = make()
    a, b = seq("a"), seq("b")
    assert sched.reserve(a)
    sched.add(b)
    assert sched.schedule() is None and list(sched.waiting) == [b]
    sched.abort("a")  # the transfer failed: nothing it promised is keyed, the wait ends
    assert not sched.block_manager.pending and sched.block_manager.num_free_blocks == 16
    batch = sched.schedule()
    assert [(c.seq, c.start, c.end) for c in batch.prefill] == [(b, 0, 10)] and b.num_cached_tokens == 0
