"""Continuous batching with chunked prefill: decides what each step computes. No torch.

A step computes, under a token budget, one token for every decoding sequence and a chunk of the
prompt of sequences still prefilling, in one forward pass ("mixed" steps): a long prompt never
stops the running batch for longer than one chunk, and prompts prefilled side by side each move
every step (shortest-first, one prompt after the other, measured worse on a 1 + 1 node that lends
threads: prompts that finish apart each take a decode worker's threads back for their decode, and
the one computing next runs on half of them; prompt-heavy TTFT p99 1.2-1.3x, BENCHMARKS.md). A
prompt alone in its step (nothing decodes, no other prompt waits or prefills) goes whole, within
the budget: a chunk would hold nobody up less, and smaller products run slower (a 2000-token
prompt in 256-token chunks took 1.5x as long on an AMX CPU in bf16, 1.12x on AVX2).
A sequence is sampled once the KV of all its tokens is computed (after its last chunk; every
decode step). Per step:
1. decoding sequences (one uncomputed token) get a slot for it; when none is free, the most
   recently admitted sequence is preempted: its blocks are freed and it waits to be recomputed
   (its cached prefix blocks usually survive);
2. sequences part-way through their prompt get their next chunk;
3. waiting sequences are admitted, in order, while a sequence slot, blocks and budget remain; one
   whose next uncached prefix block another sequence is computing, or is receiving from a prefill
   worker, waits for it (its KV is reused once there) and the next ones are considered.
While sequences decode, past the step's first prompt chunk only chunks that complete their prompt join
it (2 and 3): with the step's prompt tokens capped, a part of the next prompt would delay the step's
first tokens (and every decoding stream) without finishing that prompt sooner. A wave of eight
136-token turns beside seven decoding streams got its first tokens two by two; one by one, its median
came 13% sooner and its last 4% later (BENCHMARKS.md).
Blocks are keyed for prefix reuse once their KV is computed, never before.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.sequence import FinishReason, Sequence, SequenceStatus

StopCheck = Callable[[Sequence], "FinishReason | None"]


@dataclass(frozen=True)
class Chunk:
    """Prompt tokens [start, end) of `seq` computed in one step."""

    seq: Sequence
    start: int
    end: int
    final: bool  # it completes the sequence's KV: the step samples its next token


@dataclass
class Batch:
    """One step: each decoding sequence's newest token, then each prefill chunk."""

    decode: list[Sequence] = field(default_factory=list)
    prefill: list[Chunk] = field(default_factory=list)

    @property
    def seqs(self) -> list[Sequence]:
        """Every sequence the step computes for, decoding ones first."""
        return self.decode + [c.seq for c in self.prefill]

    @property
    def sampled(self) -> list[Sequence]:
        """The sequences that get a token from this step, in the order of the step's logits."""
        return self.decode + [c.seq for c in self.prefill if c.final]

    @property
    def is_prefill(self) -> bool:
        """Whether the step computes prompt tokens (alone or next to decoding sequences)."""
        return bool(self.prefill)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(c.end - c.start for c in self.prefill)

    @property
    def num_tokens(self) -> int:
        return len(self.decode) + self.num_prefill_tokens


class Scheduler:
    """Owns the waiting and running queues and every change of a sequence's status.

    Args:
        block_manager: allocator of KV blocks.
        max_num_seqs: most sequences running at once.
        max_num_batched_tokens: most tokens one step computes (decoding sequences always run).
        stop_check: decides after each new token whether a sequence is done.
        prefill_chunk_tokens: most prompt tokens of one sequence in a step that it shares (with
            decoding sequences or other prompts), and most prompt tokens in all of a step while
            sequences decode in it (the longest a prompt stalls them).
    """

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 stop_check: StopCheck, prefill_chunk_tokens: int | None = None) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.prefill_chunk_tokens = prefill_chunk_tokens or max_num_batched_tokens
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

    def reserve(self, seq: Sequence, reuse: bool = True) -> bool:
        """Decode side of a remote prefill: blocks for the prompt's incoming KV, its cached prefix reused
        (`seq.num_cached_tokens` of it: only the rest comes over; none without `reuse`). False if full.
        The blocks coming over are pending until they land: a prompt sharing them waits and reuses them."""
        assert seq.status is SequenceStatus.WAITING and not seq.prefill_only
        if len(self.running) + len(self.receiving) >= self.max_num_seqs or not self.block_manager.can_allocate(seq):
            return False
        self.block_manager.allocate(seq, use_cache=reuse)
        self.block_manager.computing(seq)
        seq.status = SequenceStatus.RECEIVING
        self.receiving[seq.request_id] = seq
        return True

    def activate(self, request_id: str, first_token: int) -> Sequence:
        """The KV landed: the sequence joins the decode batch with the first token sampled remotely."""
        seq = self.receiving.pop(request_id)
        self.block_manager.commit(seq, 0, seq.num_tokens)
        seq.num_computed_tokens = seq.num_tokens
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        self._append(seq, first_token)
        return seq

    def release(self, request_id: str) -> Sequence:
        """Prefill side: the KV has been sent; free the held blocks (cached prompt blocks stay reusable)."""
        seq = self.held.pop(request_id)
        self._finish(seq, seq.finish_reason or FinishReason.LENGTH)
        return seq

    def schedule(self) -> Batch | None:
        """Pick the next step's work (see the module docstring). None when there is none."""
        decode, prefilling = self._schedule_running()
        budget = self.max_num_batched_tokens - len(decode)
        if decode:
            budget = min(budget, self.prefill_chunk_tokens)
        alone = not decode and len(prefilling) + len(self.waiting) == 1  # one prompt, nobody to hold up
        chunk = budget if alone else self.prefill_chunk_tokens
        chunks = []
        for seq in prefilling:
            if budget <= 0 or not self._joins(decode, chunks, seq, budget):
                break
            chunks.append(self._chunk(seq, min(budget, chunk)))
            budget -= chunks[-1].end - chunks[-1].start
        i = 0  # waiting sequences are admitted in order, passing over those whose prefix is being computed
        while budget > 0 and i < len(self.waiting) and len(self.running) < self.max_num_seqs:
            seq = self.waiting[i]
            if self.block_manager.computing_prefix(seq.token_ids):
                i += 1
                continue
            if not self._joins(decode, chunks, seq, budget) or not self.block_manager.can_allocate(seq):
                break
            del self.waiting[i]
            self.block_manager.allocate(seq)
            self.block_manager.computing(seq)
            seq.num_computed_tokens = seq.num_cached_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            chunks.append(self._chunk(seq, min(budget, chunk)))
            budget -= chunks[-1].end - chunks[-1].start
        return Batch(decode, chunks) if decode or chunks else None

    def _joins(self, decode: list[Sequence], chunks: list[Chunk], seq: Sequence, budget: int) -> bool:
        """Whether `seq` (prefilling, or waiting) gets a chunk of this step. While sequences decode, a step's
        prompt tokens are capped, so prompts go one after the other: past the step's first chunk, only one
        whose chunk completes its prompt joins (a waiting one's cached prefix not counted). A part of
        another would only make the step longer, and every first token it samples later, without
        finishing that prompt any sooner."""
        if not (decode and chunks):
            return True
        if seq.status is SequenceStatus.WAITING:
            return seq.num_tokens - self.block_manager.cached_prefix_len(seq.token_ids) <= budget
        return seq.num_uncomputed <= budget

    def has_prefill_work(self) -> bool:
        """Whether prompts wait or are part-way through their prefill."""
        return bool(self.waiting) or any(not self._decoding(s) for s in self.running)

    def prompt_tokens_left(self) -> int:
        """Prompt tokens still to compute: of waiting prompts and of those part-way through their prefill."""
        return sum(s.num_uncomputed for s in self.waiting) + sum(s.num_uncomputed for s in self.running
                                                                 if not self._decoding(s))

    def _chunk(self, seq: Sequence, most: int) -> Chunk:
        start = seq.num_computed_tokens
        end = start + min(seq.num_uncomputed, most)
        return Chunk(seq, start, end, final=end == seq.num_tokens)

    def _schedule_running(self) -> tuple[list[Sequence], list[Sequence]]:
        """(decoding, prefilling) running sequences, in admission order. Each decoding one gets a slot
        for its newest token's KV, preempting the most recently admitted when no block is free."""
        kept: list[Sequence] = []
        running = list(self.running)
        while running:
            seq = running.pop(0)
            if not self._decoding(seq):  # its blocks came with its admission
                kept.append(seq)
                continue
            while not self.block_manager.can_append(seq):
                victim = running.pop() if running else seq
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                self.block_manager.append_slot(seq)
                kept.append(seq)
        self.running = kept
        return [s for s in kept if self._decoding(s)], [s for s in kept if not self._decoding(s)]

    @staticmethod
    def _decoding(seq: Sequence) -> bool:
        """Whether `seq` runs as a decode row: one token to compute. A prompt with one token left runs as
        one too (the same computation), except a prefill-only one: its last chunk must be a chunk, which
        the prefill worker's layer hook ships."""
        return seq.num_uncomputed == 1 and not seq.prefill_only

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free_seq(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def update(self, batch: Batch, token_ids: list[int]) -> list[Sequence]:
        """Record the step: its KV is computed (and keyed for reuse); each of `batch.sampled` gets
        its token from `token_ids`, and those that stop finish. Returns the finished."""
        for seq, end in [(s, s.num_tokens) for s in batch.decode] + [(c.seq, c.end) for c in batch.prefill]:
            if not seq.is_finished:  # aborted while the step ran: its blocks are gone
                self.block_manager.commit(seq, seq.num_computed_tokens, end)
                seq.num_computed_tokens = end
        return [seq for seq, token_id in zip(batch.sampled, token_ids) if self._append(seq, token_id)]

    def _append(self, seq: Sequence, token_id: int) -> bool:
        """Append a sampled token; hold a remote prefill's blocks or finish a stopped sequence.
        Returns whether it finished."""
        if seq.is_finished:  # aborted while the step ran: drop its token, keep ABORT
            return False
        seq.token_ids.append(token_id)
        if seq.prefill_only:  # remote prefill: keep the blocks until the KV is sent
            self.running.remove(seq)
            seq.status = SequenceStatus.HELD
            self.held[seq.request_id] = seq
            return False
        reason = self.stop_check(seq)
        if reason is not None:
            self._finish(seq, reason)
            return True
        return False

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
        seq.grammar = None  # a finished or aborted request frees its matcher
        self.block_manager.free_seq(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.receiving.pop(seq.request_id, None)
        self.held.pop(seq.request_id, None)
