"""Hands work from any thread to the one thread that owns an engine, and returns the result."""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from enum import IntEnum
from typing import Any, TypeVar

T = TypeVar("T")
log = logging.getLogger(__name__)


class Stopped(RuntimeError):
    """The owning thread has stopped: the command did not run."""


class Round(IntEnum):
    """What one round of an owner's work left behind, i.e. when the next round is due."""
    IDLE = 0  # nothing pending: the next round follows the next command
    WAITING = 1  # something outside the thread is under way (a KV transfer): look again shortly
    BUSY = 2  # more work now: the next round follows at once


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

    def wake(self) -> None:
        """Wake a `drain` that waits for a command (a no-op command nobody waits on)."""
        self._q.put((lambda: None, Future()))

    def drain(self, wait_s: float | None = 0.0, after: Callable[[], None] | None = None) -> None:
        """Run every queued command; first wait up to `wait_s` for one when none is queued (None: until
        one comes). `after` runs after each command, before its caller gets the result."""
        try:
            item = self._q.get(timeout=wait_s) if wait_s is None or wait_s > 0 else self._q.get_nowait()
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
        work: one round of the owner's work; returns the `Round` it left: BUSY (the next round at
            once), WAITING (after `poll_s`, or a command), IDLE (after the next command only: an idle
            owner sleeps instead of polling).
        name: thread name.
        poll_s: how long a WAITING owner waits for a command before it looks again.
        after: runs on this thread after every command (before its caller gets the result) and after
            every round: it publishes what other threads read without waiting (a worker's load).
        paused: run commands only, no rounds and no `after`, until `resume` (the engine is built on this
            thread through `call` first).
    """

    POLL_S = 0.002  # the default `poll_s`: what is under way is looked at 500 times a second

    def __init__(self, work: Callable[[], Round], name: str, poll_s: float = POLL_S,
                 after: Callable[[], None] | None = None, paused: bool = False) -> None:
        self.commands = CommandQueue()
        self._work = work
        self._after = None if after is None else self._kept_alive(after, name)
        self._waits = {Round.BUSY: 0.0, Round.WAITING: poll_s, Round.IDLE: None}
        self.busy_s = 0.0  # seconds of busy rounds and the command drains between them (owner writes)
        self._stop = threading.Event()
        self._resumed = threading.Event()
        if not paused:
            self._resumed.set()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def resume(self, poll_s: float | None = None) -> None:
        """A paused owner starts its rounds (a WAITING one looks again after `poll_s`, when given)."""
        if poll_s is not None:
            self._waits[Round.WAITING] = poll_s
        self._resumed.set()
        self.commands.wake()

    def call(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the owner thread. Returns its result or raises its exception; raises `Stopped`
        once the thread has stopped (a call never waits on a thread that will not answer)."""
        return self.commands.call(fn)

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self.commands.wake()
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
        while not (self._resumed.is_set() or self._stop.is_set()):
            self.commands.drain(None)
        left, began = Round.BUSY, time.perf_counter()
        while not self._stop.is_set():
            self.commands.drain(self._waits[left], self._after)
            now = time.perf_counter()
            if left is Round.BUSY:  # a busy round, and what ran between it and this one
                self.busy_s += now - began
            began = now
            if self._stop.is_set():
                break
            try:
                left = self._work()
            except Exception:  # the owner's own handler failed: keep serving commands (abort, shutdown)
                log.exception("%s: a round of work failed", self._thread.name)
                left = Round.WAITING
            if self._after is not None:
                self._after()
        self.commands.drain(after=self._after)  # what was queued before the stop still runs
        self.commands.close(f"{self._thread.name} has stopped")
