"""Hands work from any thread to the one thread that owns an engine, and returns the result."""
from __future__ import annotations

import queue
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")


class CommandQueue:
    """Callers block in `call`; the owning thread runs the commands in order in `drain`."""

    def __init__(self) -> None:
        self._q: queue.Queue[tuple[Callable[[], Any], Future]] = queue.Queue()

    def call(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the owning thread. Returns its result or raises its exception."""
        fut: Future = Future()
        self._q.put((fn, fut))
        return fut.result()

    def drain(self, wait_s: float = 0.0) -> None:
        """Run every queued command; first wait up to `wait_s` for one when none is queued."""
        try:
            item = self._q.get(timeout=wait_s) if wait_s > 0 else self._q.get_nowait()
        except queue.Empty:
            return
        while True:
            fn, fut = item
            try:
                fut.set_result(fn())
            except BaseException as e:  # the caller gets the error; the owning thread keeps serving
                fut.set_exception(e)
            try:
                item = self._q.get_nowait()
            except queue.Empty:
                return
