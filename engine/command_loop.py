"""Hands work from any thread to the one thread that owns an engine, and returns the result."""
from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")
log = logging.getLogger(__name__)


class Stopped(RuntimeError):
    """The owning thread has stopped: the command did not run."""


class CommandQueue:
    """Callers block in `call`; the owning thread runs the commands in order in `drain`, and `close`s
    the queue when it stops: every command still queued, and every later one, raises `Stopped`."""

    def __init__(self) -> None:
        self._q: queue.Queue[tuple[Callable[[], Any], Future]] = queue.Queue()
        self._lock = threading.Lock()
        self._closed: Stopped | None = None

    def call(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the owning thread. Returns its result or raises its exception (Stopped: never ran)."""
        fut: Future = Future()
        with self._lock:
            if self._closed is not None:
                raise self._closed
            self._q.put((fn, fut))
        return fut.result()

    def close(self, reason: str) -> None:
        """No more commands: the queued ones and every later `call` raise `Stopped(reason)`."""
        with self._lock:
            self._closed = Stopped(reason)
        while True:
            try:
                _, fut = self._q.get_nowait()
            except queue.Empty:
                return
            fut.set_exception(self._closed)

    def drain(self, wait_s: float = 0.0, after: Callable[[], None] | None = None) -> None:
        """Run every queued command; first wait up to `wait_s` for one when none is queued. `after`
        runs after each command, before its caller gets the result."""
        try:
            item = self._q.get(timeout=wait_s) if wait_s > 0 else self._q.get_nowait()
        except queue.Empty:
            return
        while True:
            fn, fut = item
            try:
                result = fn()
            except BaseException as e:  # the caller gets the error; the owning thread keeps serving
                result, error = None, e
            else:
                error = None
            if after is not None:
                after()
            if error is None:
                fut.set_result(result)
            else:
                fut.set_exception(error)
            try:
                item = self._q.get_nowait()
            except queue.Empty:
                return


class OwnerThread:
    """The one thread that owns an engine: runs `work` over and over, and between two rounds the
    commands other threads hand it through `call`.

    Args:
        work: one round of the owner's work; returns whether more is pending (then no idle wait).
        name: thread name.
        idle_wait_s: how long to wait for a command when idle.
        after: runs on this thread after every command (before its caller gets the result) and after
            every round: it publishes what other threads read without waiting (a worker's load).
    """

    def __init__(self, work: Callable[[], bool], name: str, idle_wait_s: float = 0.002,
                 after: Callable[[], None] | None = None) -> None:
        self.commands = CommandQueue()
        self._work = work
        self._after = None if after is None else self._kept_alive(after, name)
        self._idle_wait_s = idle_wait_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def call(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the owner thread. Returns its result or raises its exception; raises `Stopped`
        once the thread has stopped (a call never waits on a thread that will not answer)."""
        return self.commands.call(fn)

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._thread.join(timeout=timeout_s)

    @staticmethod
    def _kept_alive(after: Callable[[], None], name: str) -> Callable[[], None]:
        def run() -> None:
            try:
                after()
            except Exception:  # logged; the thread keeps serving
                log.exception("%s: publishing its state failed", name)
        return run

    def _run(self) -> None:
        busy = False
        while not self._stop.is_set():
            self.commands.drain(0.0 if busy else self._idle_wait_s, self._after)
            try:
                busy = self._work()
            except Exception:  # the owner's own handler failed: keep serving commands (abort, shutdown)
                log.exception("%s: a round of work failed", self._thread.name)
                busy = False
            if self._after is not None:
                self._after()
        self.commands.drain(after=self._after)  # what was queued before the stop still runs
        self.commands.close(f"{self._thread.name} has stopped")
