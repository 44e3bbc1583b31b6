"""The token feed: per decode worker, one pull carries every token it produced since the last one.

Lifecycle of a request on a feed:
1. Before the request starts on decode worker D (`feed=True`), it subscribes by the id D knows it by
   and gets a queue of its own.
2. While anyone subscribes, the feed's task keeps one `D.drain()` call in flight: it returns as soon
   as D has items (a whole engine step's tokens, for every request, in one message) and the task
   puts each on its request's queue. Items of requests no longer subscribed are dropped. Each call
   acknowledges the entries the feed already has, so D keeps what a lost answer carried (a call
   left over from a closed feed takes nothing from the next one).
3. The request unsubscribes when it ends (finished, failed, moved, or cancelled).
4. If a drain call fails (D died or was killed), every subscriber gets the error, which the request
   handles as its decode worker's failure; the feed ends with it.
Only the event loop touches a feed. No engine, no torch.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import ray

from worker_core.protocol import StreamItem

log = logging.getLogger(__name__)


class DecodeFeed:
    """One decode worker's feed.

    Args:
        worker: the decode worker's actor handle.
        wait_s: how long one drain call waits on the worker for a first item.
        observe: called with the number of new items each message carried (a metric).
    """

    def __init__(self, worker: ray.actor.ActorHandle, wait_s: float,
                 observe: Callable[[int], None] | None = None) -> None:
        self.worker = worker
        self.wait_s = wait_s
        self._observe = observe
        self._subs: dict[str, asyncio.Queue[StreamItem | BaseException]] = {}
        self._task: asyncio.Task | None = None
        self._acked = 0  # the last feed entry received
        self.failed: BaseException | None = None  # the error that ended it

    def subscribe(self, request_id: str) -> asyncio.Queue[StreamItem | BaseException]:
        """A queue that gets the request's items, or the feed's error."""
        q: asyncio.Queue[StreamItem | BaseException] = asyncio.Queue()
        if self.failed is not None:
            q.put_nowait(self.failed)
            return q
        self._subs[request_id] = q
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._pump())
        return q

    def unsubscribe(self, request_id: str) -> None:
        self._subs.pop(request_id, None)

    @property
    def active(self) -> bool:
        """Whether it has subscribers or a drain call in flight."""
        return bool(self._subs) or (self._task is not None and not self._task.done())

    async def _pump(self) -> None:
        while self._subs:
            try:
                entries = await self.worker.drain.remote(self._acked, self.wait_s)
            except ray.exceptions.RayError as e:  # the worker is gone: each request moves or fails by its own rules
                self.failed = e
                log.warning("decode worker feed ended: %r", e)
                for q in self._subs.values():
                    q.put_nowait(e)
                self._subs.clear()
                return
            new = [e for e in entries if e.seq > self._acked]
            if new:
                self._acked = new[-1].seq
                if self._observe is not None:
                    self._observe(len(new))
            for e in new:
                q = self._subs.get(e.request_id)
                if q is not None:
                    q.put_nowait(e.item)

    async def close(self) -> None:
        """Stop the pump (its subscribers get nothing more)."""
        self._subs.clear()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


class Feeds:
    """The feed of each decode worker, by worker id (a replaced worker has a new id, so a new feed).

    Args:
        wait_s, observe: as `DecodeFeed`'s.
    """

    def __init__(self, wait_s: float = 1.0, observe: Callable[[int], None] | None = None) -> None:
        self.wait_s = wait_s
        self._observe = observe
        self._feeds: dict[str, DecodeFeed] = {}

    def get(self, worker_id: str, worker: ray.actor.ActorHandle) -> DecodeFeed:
        feed = self._feeds.get(worker_id)
        if feed is None or feed.worker is not worker:
            for wid in [w for w, f in self._feeds.items() if not f.active]:  # ended feeds of replaced workers
                del self._feeds[wid]
            feed = self._feeds[worker_id] = DecodeFeed(worker, self.wait_s, self._observe)
        return feed

    async def close(self) -> None:
        await asyncio.gather(*(f.close() for f in self._feeds.values()))
        self._feeds.clear()
