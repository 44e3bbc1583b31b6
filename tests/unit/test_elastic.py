"""Unit tests for router.elastic: when threads are lent and given back (pure asyncio; the workers'
`set_threads` calls are recorded, no Ray cluster)."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

from router.elastic import ThreadLender


class FakeWorker:
    def __init__(self, calls: list, index: int) -> None:
        async def set_threads(n: int) -> None:
            calls.append((index, n))
        self.set_threads = SimpleNamespace(remote=set_threads)


def lender(pairs=((0, 0),), decode: int = 1, threads: int = 1) -> tuple[ThreadLender, list]:
    calls: list = []
    pools = SimpleNamespace(decode=[FakeWorker(calls, i) for i in range(decode)])
    return ThreadLender(pools, list(pairs), threads), calls


async def settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


def test_threads_are_lent_after_two_idle_polls_and_come_back_with_a_prompt() -> None:
    async def main():
        lend, calls = lender(threads=2)
        lend.rebalance([0])
        await settle()
        assert calls == [] and not lend.lent_to(0)  # one idle poll is not enough
        lend.rebalance([0])
        await settle()
        assert calls == [(0, 4)] and lend.lent_to(0) and lend.loans == 1
        lend.rebalance([0])
        await settle()
        assert calls == [(0, 4)]  # lent once, not again every poll
        lend.reclaim(0)  # a prompt is booked on the prefill worker
        await settle()
        assert calls == [(0, 4), (0, 2)] and not lend.lent_to(0)
        lend.rebalance([0])  # idle again: counted from zero
        await settle()
        assert calls == [(0, 4), (0, 2)]
    asyncio.run(main())


def test_a_busy_prefill_worker_keeps_its_threads() -> None:
    async def main():
        lend, calls = lender()
        for queued in (0, 300, 0, 120, 0):
            lend.rebalance([queued])
        await settle()
        assert calls == []
        lend.reclaim(0)  # nothing lent: nothing to give back
        await settle()
        assert calls == []
    asyncio.run(main())


def test_only_paired_workers_lend_and_a_replacement_starts_over() -> None:
    async def main():
        lend, calls = lender(pairs=((1, 0),), decode=2)  # prefill 1 shares a node with decode 0; prefill 0 alone
        for _ in range(2):
            lend.rebalance([0, 0])
        await settle()
        assert calls == [(0, 2)] and lend.pairs == [(1, 0)]
        lend.reclaim(0)  # prefill 0 has no partner
        await settle()
        assert calls == [(0, 2)]
        lend.reset("prefill", 1)  # the lender died and was replaced: its partner gives the loan back
        await settle()
        assert calls == [(0, 2), (0, 1)] and not lend.lent_to(0)
        for _ in range(2):
            lend.rebalance([0, 0])
        lend.reset("decode", 0)  # a fresh decode worker starts with its own threads
        await settle()
        assert calls == [(0, 2), (0, 1), (0, 2)] and not lend.lent_to(0)
    asyncio.run(main())
