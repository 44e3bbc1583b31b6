"""The router's own account of each worker's load, kept at every admission and completion.

The router reserves, per decode worker, the KV blocks a request may need at worst (prompt +
max_tokens), so a decode worker is never promised more than it holds: memory pressure makes
requests wait at the router instead of stalling or preempting decode batches. A `Booking` points
at the slot objects it charged, so a replaced worker's fresh slot is never charged for old work.

Each prefill worker also has a flex slot: a decode slot for the requests it runs whole while its
role is flipped to decode (`router.elastic.RoleFlipper`). The policy sees the flex slots after the
decode workers' (decode index `len(decode) + i` is prefill worker i), local path only, and only
while accepting (the worker is then no prefill candidate); `Pools.decoder` resolves the same
indices to actors.
"""
from __future__ import annotations

from dataclasses import dataclass

from router.policy import DecodeLoad, Placement, PoolState, PrefillLoad
from router.prefix_index import Promise


@dataclass(eq=False)
class PrefillSlot:
    worker_id: str
    queued_tokens: int = 0  # prompt tokens it computes for the prompts sent to it, not yet prefilled
    healthy: bool = True


@dataclass(eq=False)
class DecodeSlot:
    worker_id: str
    num_blocks: int
    block_size: int
    max_num_seqs: int
    running: int = 0  # requests placed on it and not finished
    reserved_blocks: int = 0  # worst-case KV blocks of those requests
    queued_prefill_tokens: int = 0  # prompt tokens it computes for local prefills not yet done
    awaiting_kv: int = 0  # of `running`, remote prefills not yet done (their KV is on its way)
    healthy: bool = True
    flex: bool = False  # a prefill worker's: local path only (it never receives KV)
    accepting: bool = True  # takes new requests (a flex slot: while its prefill worker is flipped)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)


@dataclass(eq=False)
class Booking:
    """What one placed request holds in the book; released once (`prefilled`, then `finished`)."""

    placement: Placement
    prefill: PrefillSlot | None
    decode: DecodeSlot
    prompt_tokens: int
    max_tokens: int
    blocks: int
    computed_tokens: int  # the prompt tokens queued on the worker that prefills it (its cache holds the rest)
    awaits_kv: bool = False  # its KV (or, local, its prefix) comes from a prefill worker: D computes nothing yet
    prefill_open: bool = True
    open: bool = True
    promise: Promise | None = None  # its prompt's prefix keys, promised to the workers computing and receiving it

    @property
    def own_ttft(self) -> bool:
        """Whether its placement set its TTFT: not a local prompt that waited for another request's KV (that
        request's prefill did), which the cost model's correction must not learn from."""
        return self.prefill is not None or not self.awaits_kv


class PoolBook:
    """Per-worker load as the router sees it. Args: prefill and decode slots, index-aligned with the pools;
    flex: one flex slot per prefill worker (index-aligned with `prefill`), or none."""

    def __init__(self, prefill: list[PrefillSlot], decode: list[DecodeSlot],
                 flex: list[DecodeSlot] | None = None) -> None:
        self.prefill = prefill
        self.decode = decode
        self.flex = flex or []
        assert not self.flex or len(self.flex) == len(prefill), "one flex slot per prefill worker"

    def decode_slot(self, index: int) -> DecodeSlot:
        """The slot at a policy's decode index: decode workers first, then flex slots."""
        return self.decode[index] if index < len(self.decode) else self.flex[index - len(self.decode)]

    def state(self, unflipped: bool = False) -> PoolState:
        """The policy's view; a decode worker at its sequence limit shows no free blocks. A prefill worker
        flipped to decode shows as a decode worker (its flex slot) and not as a prefill worker;
        `unflipped`: the view where every prefill worker is one again (flex slots closed). A prefill
        worker and its flex slot, one engine, show the prompt tokens of both as their queue."""
        flex = self.flex or [None] * len(self.prefill)
        flipped = [bool(f and f.accepting) and not unflipped for f in flex]
        shared = [f.queued_prefill_tokens if f else 0 for f in flex]
        prefill = tuple(PrefillLoad(p.worker_id, p.queued_tokens + q, p.healthy and not flip, f.running if f else 0)
                        for p, f, q, flip in zip(self.prefill, flex, shared, flipped))
        decode = [(d, d.queued_prefill_tokens, d.healthy) for d in self.decode]
        decode += [(f, f.queued_prefill_tokens + p.queued_tokens, f.healthy and flip and p.healthy)
                   for f, p, flip in zip(self.flex, self.prefill, flipped)]
        return PoolState(prefill, tuple(
            DecodeLoad(d.worker_id, d.running,
                       0 if d.running >= d.max_num_seqs else max(0, d.num_blocks - d.reserved_blocks),
                       d.block_size, queued, healthy, local_only=d.flex, awaiting_kv=d.awaiting_kv)
            for d, queued, healthy in decode))

    def admit(self, placement: Placement, prompt_tokens: int, max_tokens: int, arriving: bool = False) -> Booking:
        """Book a placed request on its workers. `arriving`: placed local, it waits on D for its prefix,
        which another request's remote prefill is bringing there; until its first token it awaits KV as
        a remote request does."""
        d = self.decode_slot(placement.decode)
        p = self.prefill[placement.prefill] if placement.path == "remote" else None
        computed = min(prompt_tokens, placement.computed_tokens or prompt_tokens)
        booking = Booking(placement, p, d, prompt_tokens, max_tokens, d.blocks_for(prompt_tokens + max_tokens),
                          computed, awaits_kv=p is not None or arriving)
        d.running += 1
        d.reserved_blocks += booking.blocks
        d.awaiting_kv += booking.awaits_kv
        if p is not None:
            p.queued_tokens += computed
        else:
            d.queued_prefill_tokens += computed
        return booking

    @staticmethod
    def prefilled(booking: Booking) -> None:
        """The request's prefill is over (first token known, or it ended before). Idempotent."""
        if booking.prefill_open:
            booking.prefill_open = False
            booking.decode.awaiting_kv -= booking.awaits_kv
            if booking.prefill is not None:
                booking.prefill.queued_tokens -= booking.computed_tokens
            else:
                booking.decode.queued_prefill_tokens -= booking.computed_tokens

    def finished(self, booking: Booking) -> None:
        """The request left its decode worker. Idempotent."""
        self.prefilled(booking)
        if booking.open:
            booking.open = False
            booking.decode.running -= 1
            booking.decode.reserved_blocks -= booking.blocks
            assert booking.decode.running >= 0 and booking.decode.reserved_blocks >= 0, booking.decode
