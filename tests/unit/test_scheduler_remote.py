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
