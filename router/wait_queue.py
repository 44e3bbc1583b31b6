"""The router's wait queue: requests no decode worker has room for wait here, bounded in number and time.

Request lifecycle here: placement found no decode worker with room → `wait` (refused at once with
"overloaded" when `max_queued` already wait) → woken by `notify` when a booking is released or a
worker replaced, to try placement again → refused with "overloaded" once `queue_timeout_s` passed,
or with DeadlineExceeded once the request's own deadline passed first. Memory pressure thus makes
requests wait at the router instead of stalling or preempting decode batches.
"""
from __future__ import annotations

import asyncio
import time

from router.metrics import Metrics
from router.types import DeadlineExceeded, OverloadedError


class WaitQueue:
    """Args: max_queued: requests that may wait at once; timeout_s: the longest wait; metrics: its gauge."""

    def __init__(self, max_queued: int, timeout_s: float, metrics: Metrics) -> None:
        self._max, self._timeout_s, self._metrics = max_queued, timeout_s, metrics
        self._room = asyncio.Condition()
        self._waiting = 0

    @property
    def waiting(self) -> int:
        return self._waiting

    def limit(self, own_deadline: float | None) -> float:
        """The monotonic time a request placed now may wait until: the queue's timeout, or its own deadline."""
        limit = time.monotonic() + self._timeout_s
        return limit if own_deadline is None else min(limit, own_deadline)

    async def wait(self, limit: float, own_deadline: float | None) -> None:
        """Wait for a `notify` (or until `limit`). Raises OverloadedError when the queue is full or the
        queue's timeout passed, DeadlineExceeded when the request's own deadline passed."""
        if self._waiting >= self._max:
            raise OverloadedError(f"every decode worker is full and {self._waiting} requests are already "
                                  "waiting; retry later", retry_after_s=1.0)
        left = limit - time.monotonic()
        if left <= 0 and own_deadline is not None and own_deadline <= limit:
            raise DeadlineExceeded("the request's timeout passed while it waited for a decode worker with room")
        if left <= 0:
            raise OverloadedError(f"no decode worker had room within {self._timeout_s:.0f} s; retry later",
                                  retry_after_s=2.0)
        self._waiting += 1
        self._metrics.queued.set(self._waiting)
        try:
            async with self._room, asyncio.timeout(left):  # not wait_for: it can swallow a cancel (3.11)
                await self._room.wait()
        except TimeoutError:
            pass
        finally:
            self._waiting -= 1
            self._metrics.queued.set(self._waiting)

    async def notify(self) -> None:
        """Room may have appeared: every waiter tries placement again."""
        async with self._room:
            self._room.notify_all()
