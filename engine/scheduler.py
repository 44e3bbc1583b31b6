"""Continuous batching: decides which sequences run each step. No torch.

A step is either a prefill batch (newly admitted prompts, admitted while blocks and the
token budget allow) or a decode batch (every running sequence, one token each). When a
decode step finds no free block, the most recently admitted sequence is preempted: its
blocks are freed and it waits to be recomputed (its cached prefix blocks usually survive).
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from engine.block_manager import BlockManager
from engine.sequence import FinishReason, Sequence, SequenceStatus

StopCheck = Callable[[Sequence], "FinishReason | None"]


@dataclass
class Batch:
    seqs: list[Sequence]
    is_prefill: bool

    @property
    def num_tokens(self) -> int:
        if not self.is_prefill:
            return len(self.seqs)
        return sum(s.num_tokens - s.num_cached_tokens for s in self.seqs)


class Scheduler:
    """Owns the waiting and running queues and every change of a sequence's status.

    Args:
        block_manager: allocator of KV blocks.
        max_num_seqs: most sequences running at once.
        max_num_batched_tokens: most prompt tokens computed in one prefill step.
        stop_check: decides after each new token whether a sequence is done.
    """

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 stop_check: StopCheck) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.stop_check = stop_check
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.receiving: dict[str, Sequence] = {}  # decode side of remote prefills: KV arriving
        self.held: dict[str, Sequence] = {}  # prefill side of remote prefills: KV being sent
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        assert seq.status is SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        """Whether a step has work: waiting or running sequences (not receiving or held ones)."""
        return bool(self.waiting or self.running)

    def reserve(self, seq: Sequence) -> bool:
        """Decode side of a remote prefill: blocks for the prompt's incoming KV. False if full."""
        assert seq.status is SequenceStatus.WAITING and not seq.prefill_only
        if len(self.running) + len(self.receiving) >= self.max_num_seqs or not self.block_manager.can_allocate(seq):
            return False
        self.block_manager.allocate(seq, use_cache=False)
        seq.status = SequenceStatus.RECEIVING
        self.receiving[seq.request_id] = seq
        return True

    def activate(self, request_id: str, first_token: int) -> Sequence:
        """The KV landed: the sequence joins the decode batch with the first token sampled remotely."""
        seq = self.receiving.pop(request_id)
        self.block_manager.publish(seq)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        self.update(Batch([seq], is_prefill=True), [first_token])
        return seq

    def release(self, request_id: str) -> Sequence:
        """Prefill side: the KV has been sent; free the held blocks (cached prompt blocks stay reusable)."""
        seq = self.held.pop(request_id)
        self._finish(seq, seq.finish_reason or FinishReason.LENGTH)
        return seq

    def schedule(self) -> Batch | None:
        """Pick the next batch: admit waiting prompts first, else decode all running."""
        batch = self._schedule_prefill()
        if batch is not None:
            return batch
        return self._schedule_decode()

    def _schedule_prefill(self) -> Batch | None:
        seqs: list[Sequence] = []
        budget = self.max_num_batched_tokens
        while self.waiting and len(self.running) + len(seqs) < self.max_num_seqs:
            seq = self.waiting[0]
            cost = seq.num_tokens - self.block_manager.cached_prefix_len(seq.token_ids)
            if seqs and cost > budget:  # a prompt over the budget still runs, alone
                break
            if not self.block_manager.can_allocate(seq):
                break
            self.block_manager.allocate(seq)
            budget -= cost
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            seqs.append(seq)
        self.running.extend(seqs)
        return Batch(seqs, is_prefill=True) if seqs else None

    def _schedule_decode(self) -> Batch | None:
        scheduled: list[Sequence] = []
        running = list(self.running)
        while running:
            seq = running.pop(0)
            while not self.block_manager.can_append(seq):
                victim = running.pop() if running else seq
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                self.block_manager.append_slot(seq)
                scheduled.append(seq)
        self.running = scheduled
        return Batch(list(scheduled), is_prefill=False) if scheduled else None

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free_seq(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def update(self, batch: Batch, token_ids: list[int]) -> list[Sequence]:
        """Append each sequence's new token; finish those that stop. Returns the finished."""
        finished = []
        for seq, token_id in zip(batch.seqs, token_ids):
            if seq.is_finished:  # aborted while the step ran: drop its token, keep ABORT
                continue
            seq.token_ids.append(token_id)
            if seq.prefill_only:  # remote prefill: keep the blocks until the KV is sent
                self.running.remove(seq)
                seq.status = SequenceStatus.HELD
                self.held[seq.request_id] = seq
                continue
            reason = self.stop_check(seq)
            if reason is not None:
                self._finish(seq, reason)
                finished.append(seq)
        return finished

    def find(self, request_id: str) -> Sequence | None:
        """The unfinished sequence with this id, if any."""
        for table in (self.receiving, self.held):
            if request_id in table:
                return table[request_id]
        return next((s for q in (self.waiting, self.running) for s in q if s.request_id == request_id), None)

    def abort(self, request_id: str) -> Sequence | None:
        """Finish a request wherever it is; its blocks return to the pool."""
        seq = self.find(request_id)
        if seq is not None:
            self._finish(seq, FinishReason.ABORT)
        return seq

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.block_manager.free_seq(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.receiving.pop(seq.request_id, None)
        self.held.pop(seq.request_id, None)
