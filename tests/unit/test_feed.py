"""Unit tests for router.feed, with a worker stand-in that keeps entries the way `DecodeWorker.drain`
does (pure asyncio, no Ray cluster; the real drain is tested in tests/integration/test_disaggregated.py)."""
from __future__ import annotations

import asyncio

import ray

from router.feed import DecodeFeed, Feeds
from worker_core.protocol import ErrorKind, FeedEntry, StreamItem


class FakeDrain:
    """`drain.remote(acked, wait_s)` over a list of entries: drops the acknowledged, returns the rest."""

    def __init__(self) -> None:
        self.entries: list[FeedEntry] = []
        self.seq = 0
        self.calls: list[int] = []
        self.error: BaseException | None = None
        self.changed = asyncio.Event()

    def emit(self, rid: str, item: StreamItem) -> None:
        self.seq += 1
        self.entries.append(FeedEntry(self.seq, rid, item))
        self.changed.set()

    async def _drain(self, acked: int, wait_s: float) -> list[FeedEntry]:
        self.calls.append(acked)
        self.entries = [e for e in self.entries if e.seq > acked]
        if not self.entries and self.error is None:
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), wait_s)
            except TimeoutError:
                pass
        if self.error is not None:
            raise self.error
        return [e for e in self.entries if e.seq > acked]

    def remote(self, acked: int, wait_s: float):
        return self._drain(acked, wait_s)


class FakeWorker:
    def __init__(self) -> None:
        self.drain = FakeDrain()


def tok(t: int, finished: bool = False) -> StreamItem:
    return StreamItem((t,), str(t), "length" if finished else None)


async def take(q: asyncio.Queue, n: int) -> list:
    return [await asyncio.wait_for(q.get(), 2) for _ in range(n)]


def test_items_reach_their_request_in_order_and_others_are_dropped() -> None:
    async def main():
        w = FakeWorker()
        feed = DecodeFeed(w, wait_s=0.05)
        a, b = feed.subscribe("a"), feed.subscribe("b")
        for t in range(3):  # one engine step's tokens for both, then the next step's
            w.drain.emit("a", tok(t))
            w.drain.emit("b", tok(10 + t))
            w.drain.emit("gone", tok(99))  # a request nobody reads any more
        assert [i.token_ids[0] for i in await take(a, 3)] == [0, 1, 2]
        assert [i.token_ids[0] for i in await take(b, 3)] == [10, 11, 12]
        feed.unsubscribe("a")
        feed.unsubscribe("b")
        await asyncio.sleep(0.2)
        assert not feed.active  # no subscribers: the pump stops
        assert a.empty() and b.empty()
    asyncio.run(main())


def test_a_lost_answer_loses_nothing() -> None:
    """A drain answer that never reaches its caller (a closed feed's last call) leaves its entries for
    the next caller, which acknowledges only what it got."""
    async def main():
        w = FakeWorker()
        w.drain.emit("a", tok(1))
        lost = await w.drain.remote(0, 0.01)  # answered to nobody
        assert [e.seq for e in lost] == [1]
        feed = DecodeFeed(w, wait_s=0.05)
        q = feed.subscribe("a")
        w.drain.emit("a", tok(2, finished=True))
        assert [i.token_ids[0] for i in await take(q, 2)] == [1, 2]
        feed.unsubscribe("a")
        await feed.close()
        assert w.drain.calls[-1] >= 1  # the live feed acknowledged what it had
    asyncio.run(main())


def test_a_failed_drain_reaches_every_subscriber_and_later_ones() -> None:
    async def main():
        w = FakeWorker()
        feed = DecodeFeed(w, wait_s=0.05)
        a, b = feed.subscribe("a"), feed.subscribe("b")
        dead = ray.exceptions.RayActorError()  # the actor died
        w.drain.error = dead
        w.drain.changed.set()
        assert await take(a, 1) == [dead] and await take(b, 1) == [dead]
        assert feed.failed is dead and not feed.active
        assert await take(feed.subscribe("c"), 1) == [dead]  # a late subscriber hears it at once
    asyncio.run(main())


def test_feeds_are_per_worker_and_a_replaced_worker_gets_a_new_one() -> None:
    async def main():
        feeds = Feeds(wait_s=0.05)
        w1, w2 = FakeWorker(), FakeWorker()
        f1 = feeds.get("d0-aaa", w1)
        assert feeds.get("d0-aaa", w1) is f1 and feeds.get("d1-bbb", w2) is not f1
        new = FakeWorker()
        assert feeds.get("d0-ccc", new).worker is new
        await feeds.close()
    asyncio.run(main())


def test_a_failed_item_is_an_item() -> None:
    """Worker errors travel as finished items with a kind, not as feed failures."""
    async def main():
        w = FakeWorker()
        feed = DecodeFeed(w, wait_s=0.05)
        q = feed.subscribe("a")
        w.drain.emit("a", StreamItem.failed(ErrorKind.TRANSFER_FAILED, "KV transfer for a failed"))
        (item,) = await take(q, 1)
        assert item.finished and item.error.kind is ErrorKind.TRANSFER_FAILED and feed.failed is None
        await feed.close()
    asyncio.run(main())
