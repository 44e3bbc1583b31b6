"""Unit tests for router.elastic: when threads are lent and given back (pure asyncio; the workers'
`set_threads` calls are recorded, no Ray cluster), and when a prefill worker flips to decode and back
(the book alone)."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

from router.book import DecodeSlot, PoolBook, PrefillSlot
from router.elastic import RoleFlipper, ThreadLender
from router.policy import Loan, Placement
from worker_core.protocol import ThreadSpeedup


class FakeWorker:
    """Records `set_threads` / `prepare_threads` calls as (pool, index, what)."""

    def __init__(self, calls: list, pool: str, index: int) -> None:
        self.compiled = asyncio.Event()

        async def set_threads(n: int) -> None:
            calls.append((pool, index, n))

        async def prepare_threads(n: int) -> None:
            await self.compiled.wait()
            calls.append((pool, index, f"prepared {n}"))
        self.set_threads = SimpleNamespace(remote=set_threads)
        self.prepare_threads = SimpleNamespace(remote=prepare_threads)


def fake_pools(prefill: int, decode: int) -> tuple[SimpleNamespace, list]:
    calls: list = []
    return SimpleNamespace(prefill=[FakeWorker(calls, "prefill", i) for i in range(prefill)],
                           decode=[FakeWorker(calls, "decode", i) for i in range(decode)]), calls


def lender(pairs=((0, 0),), prefill: int = 1, decode: int = 1, threads: int = 1):
    pools, calls = fake_pools(prefill, decode)
    return ThreadLender(pools, [(p, d, ThreadSpeedup(1.5, 1.8)) for p, d in pairs], threads, poll_s=1.0), calls, pools


async def settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


BUSY = [3]  # the decode worker computes for 3 requests


def test_threads_are_lent_to_decode_after_two_idle_polls_and_come_back_with_a_prompt() -> None:
    async def main():
        lend, calls, _ = lender(threads=2)
        lend.rebalance([0], BUSY)
        await settle()
        assert calls == [] and not lend.lent_to(0)  # one idle poll is not enough
        lend.rebalance([0], BUSY)
        await settle()
        assert calls == [("decode", 0, 4)] and lend.lent_to(0) and lend.lent_count == 1 and lend.moved == 1
        assert lend.loans() == {0: Loan(0, 1.5, 1.8, 2.0)}  # back two polls after the lender's queue empties
        lend.rebalance([0], BUSY)
        await settle()
        assert calls == [("decode", 0, 4)]  # lent once, not again every poll
        lend.reclaim(0)  # a prompt is booked on the prefill worker
        await settle()
        assert calls == [("decode", 0, 4), ("decode", 0, 2)] and not lend.lent_to(0) and lend.loans() == {}
        lend.rebalance([0], BUSY)  # idle again: counted from zero
        await settle()
        assert calls == [("decode", 0, 4), ("decode", 0, 2)]
    asyncio.run(main())


def test_an_idle_decode_worker_lends_its_threads_to_prefill_until_a_request_computes_there() -> None:
    """Prompt-heavy: the decode worker has nothing to compute (requests waiting for their KV do not
    count), so the prefill worker prefills with both workers' threads, even while a prompt is being
    booked there; a request that starts computing on the decode worker takes them back. A decode
    worker that goes quiet while it borrows gives the loan back and lends the other way."""
    async def main():
        lend, calls, _ = lender()
        for _ in range(2):
            lend.rebalance([0], [0])
        await settle()
        assert calls == [("prefill", 0, 2)] and lend.borrowing(0) and lend.borrowed_count == 1
        assert lend.loans() == {0: Loan(0, 1.5, 1.8, 2.0, to_decode=False)} and lend.moved == 0
        lend.reclaim(0)  # a prompt for the prefill worker: it keeps computing with both workers' threads
        for queued in (900, 400):
            lend.rebalance([queued], [0])
        await settle()
        assert calls == [("prefill", 0, 2)] and lend.borrowing(0)
        lend.occupy(0)  # its prefill is done: the request decodes on the decode worker
        await settle()
        assert calls == [("prefill", 0, 2), ("prefill", 0, 1)] and not lend.borrowing(0)
        for _ in range(2):  # decoding, with nothing to prefill: the other way
            lend.rebalance([0], [1])
        await settle()
        assert calls[-1] == ("decode", 0, 2) and lend.lent_to(0)
        for _ in range(2):  # the batch ends: the decode worker gives the loan back and lends its own
            lend.rebalance([0], [0])
        await settle()
        assert calls[-2:] == [("decode", 0, 1), ("prefill", 0, 2)] and lend.borrowing(0) and not lend.lent_to(0)
    asyncio.run(main())


def test_a_decode_worker_computing_nothing_lends_at_once_while_prompts_wait() -> None:
    """Prompt-heavy: each prompt's short decode ends while the next prompt is queued on the prefill
    worker (or the next prompt comes after). The decode worker lends as the book changes (`nudge`),
    or at the first poll that finds it so, not two polls later; with nothing queued, or while it
    computes, it keeps its threads."""
    async def main():
        lend, calls, _ = lender()
        lend.nudge([0], [0])  # nothing waits for a prefill
        lend.nudge([512], [1])  # the decode worker computes
        await settle()
        assert calls == [] and not lend.borrowing(0)
        lend.nudge([512], [0])
        await settle()
        assert calls == [("prefill", 0, 2)] and lend.borrowing(0) and lend.borrowed_count == 1
        lend.nudge([512], [0])  # already lent
        lend.occupy(0)  # the prompt's KV arrived: the decode worker computes again
        lend.rebalance([300], [0])  # its request ended between polls; the first poll that sees it lends
        await settle()
        assert calls == [("prefill", 0, 2), ("prefill", 0, 1), ("prefill", 0, 2)] and lend.borrowed_count == 2
    asyncio.run(main())


def test_a_busy_worker_keeps_its_threads() -> None:
    async def main():
        lend, calls, _ = lender()
        for queued, decoding in ((0, 1), (300, 1), (0, 2), (120, 3), (0, 1)):
            lend.rebalance([queued], [decoding])
        await settle()
        assert calls == []
        lend.reclaim(0)  # nothing lent: nothing to give back
        lend.occupy(0)
        await settle()
        assert calls == []
    asyncio.run(main())


def test_an_idle_prefill_worker_offers_its_threads_to_a_local_prompt_and_lends_them_once_one_is_booked() -> None:
    """Turns that reach the prefill worker within two polls of each other never let it lend after two idle
    polls; a local prompt is priced with its threads wherever it has nothing queued (`offers`) and gets them
    as it is booked (`lend_for`). Not while prompts are queued there, not to an unpaired decode worker, not
    before the decode step is compiled for the lent count; a decode worker lending the other way is offered
    them once its own came back (`occupy`)."""
    async def main():
        lend, calls, pools = lender(pairs=((0, 0),), prefill=1, decode=2)
        offer = Loan(0, 1.5, 1.8, 2.0, to_decode=True)
        assert lend.offers([0]) == {0: offer} and lend.offers([300]) == {} and lend.loans() == {}
        lend.lend_for(0, [300])  # a prompt waits on the prefill worker: it keeps its threads
        lend.lend_for(1, [0])  # decode worker 1 has no partner
        await settle()
        assert calls == [] and not lend.lent_to(0)
        lend.lend_for(0, [0])
        await settle()
        assert calls == [("decode", 0, 2)] and lend.lent_to(0) and lend.lent_count == 1
        assert lend.loans() == {0: offer} and lend.offers([0]) == {}  # it stands now: nothing more to offer
        lend.lend_for(0, [0])  # lent once
        lend.reclaim(0)  # a prompt for the prefill worker
        await settle()
        assert calls == [("decode", 0, 2), ("decode", 0, 1)] and lend.offers([0]) == {0: offer}
        for _ in range(2):  # the decode worker computes nothing: it lends to the prefill worker
            lend.rebalance([0], [0, 0])
        await settle()
        assert lend.borrowing(0) and lend.offers([0]) == {}  # a loan stands, the other way
        lend.occupy(0)  # a local prompt is booked: the decode worker's threads come back, and it gets the other's
        lend.lend_for(0, [0])
        await settle()
        assert calls[2:] == [("prefill", 0, 2), ("prefill", 0, 1), ("decode", 0, 2)] and lend.lent_to(0)
        lend.reset("decode", 0)  # a fresh decode worker: nothing offered before its step is compiled for the loan
        lend.lend_for(0, [0])
        await settle()
        assert lend.offers([0]) == {} and not lend.lent_to(0) and len(calls) == 5  # the new one has its own
        pools.decode[0].compiled.set()
        await settle()
        assert lend.offers([0]) == {0: offer}
    asyncio.run(main())


def test_only_paired_workers_lend_and_a_replacement_starts_over() -> None:
    async def main():
        lend, calls, pools = lender(pairs=((1, 0),), prefill=2, decode=2)  # prefill 1 shares a node with decode 0
        for _ in range(2):
            lend.rebalance([0, 0], [1, 1])
        await settle()
        assert calls == [("decode", 0, 2)] and lend.pairs == [(1, 0)]
        lend.reclaim(0)  # prefill 0 has no partner
        await settle()
        assert calls == [("decode", 0, 2)]
        lend.reset("prefill", 1)  # the lender died and was replaced: its partner gives the loan back
        await settle()
        assert calls == [("decode", 0, 2), ("decode", 0, 1)] and not lend.lent_to(0)
        for _ in range(2):
            lend.rebalance([0, 0], [1, 1])
        lend.reset("decode", 0)  # a fresh decode worker starts with its own threads
        await settle()
        assert calls == [("decode", 0, 2), ("decode", 0, 1), ("decode", 0, 2)] and not lend.lent_to(0)
        for _ in range(3):  # and borrows only once its step is compiled for the lent count
            lend.rebalance([0, 0], [1, 1])
        await settle()
        assert len(calls) == 3 and not lend.lent_to(0)
        pools.decode[0].compiled.set()
        await settle()
        lend.rebalance([0, 0], [1, 1])
        await settle()
        assert calls[3:] == [("decode", 0, "prepared 2"), ("decode", 0, 2)] and lend.lent_to(0)
        for _ in range(2):  # it goes quiet: it lends to its partner; the partner dies and is replaced
            lend.rebalance([0, 0], [0, 0])
        lend.reset("prefill", 1)
        await settle()
        assert calls[5:] == [("decode", 0, 1), ("prefill", 1, 2)] and not lend.borrowing(1)  # the new one has its own
    asyncio.run(main())


# --- RoleFlipper: a prefill worker serves decode through its flex slot while it has nothing to prefill ---

def flex_book(prefill: int = 1) -> PoolBook:
    return PoolBook([PrefillSlot(f"p{i}") for i in range(prefill)], [DecodeSlot("d", 100, 16, 8)],
                    [DecodeSlot(f"p{i}", 50, 16, 8, flex=True, accepting=False) for i in range(prefill)])


def test_an_idle_prefill_worker_flips_to_decode_and_back_with_a_prompt() -> None:
    book = flex_book()
    flip = RoleFlipper(book)
    assert [d.healthy for d in book.state().decode] == [True, False]  # closed until flipped
    flip.rebalance([0], [0])
    assert not flip.flipped(0)  # one idle poll is not enough
    flip.rebalance([0], [0])
    assert flip.flipped(0) and flip.flips == 1 and flip.moved == 1
    state = book.state()
    assert [(d.worker_id, d.healthy, d.local_only) for d in state.decode] == [("d", True, False), ("p0", True, True)]
    assert not state.prefill[0].healthy  # a decode worker now: no prefill candidate
    unflipped = book.state(unflipped=True)  # the view the placer prices a flip back in
    assert unflipped.prefill[0].healthy and not unflipped.decode[1].healthy
    booking = book.admit(Placement("local", None, 1, "test", 0.1, 0.1), 100, 50)  # a request placed on it
    assert booking.decode is book.flex[0] and book.state().prefill[0].decoding == 1
    flip.reclaim(0)  # a prompt is booked on it: a prefill worker again
    assert not flip.flipped(0) and not book.state().decode[1].healthy and flip.moved == 0
    assert book.state().prefill[0].decoding == 1  # what it runs keeps running there
    book.finished(booking)
    assert book.state().prefill[0].decoding == 0
    flip.rebalance([0], [0])
    assert not flip.flipped(0)  # idle again: counted from zero


def test_a_busy_prefill_worker_does_not_flip_and_a_replacement_starts_as_prefill() -> None:
    book = flex_book(2)
    flip = RoleFlipper(book)
    for queued in ([0, 300], [120, 0], [0, 200]):
        flip.rebalance(queued, [0])
    assert not flip.flipped(0) and not flip.flipped(1)
    flip.rebalance([0, 0], [0])
    assert flip.flipped(0) and not flip.flipped(1)
    book.flex[0] = DecodeSlot("p0b", 50, 16, 8, flex=True, accepting=False)  # the placer's fresh slot
    flip.reset("prefill", 0)
    flip.rebalance([0, 0], [0])
    assert flip.flipped(1) and not flip.flipped(0)  # the new worker counts its idle polls from zero
    book.prefill[1].healthy = False  # an unhealthy prefill worker's flex slot is closed too
    assert not book.state().decode[2].healthy
