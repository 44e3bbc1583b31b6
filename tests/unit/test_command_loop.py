"""The engine-owning thread: commands run on it in order; once it stops, a call raises at once
instead of waiting on a thread that will never answer (a worker's shutdown, then a late call)."""
from __future__ import annotations

import threading
import time

import pytest

from engine.command_loop import OwnerThread, Round, Stopped


def test_commands_run_on_the_owner_thread_and_errors_reach_the_caller():
    owner = OwnerThread(lambda: Round.IDLE, name="owner-test")
    try:
        assert owner.call(lambda: threading.current_thread().name) == "owner-test"
        with pytest.raises(ZeroDivisionError):
            owner.call(lambda: 1 / 0)
        assert owner.call(lambda: 42) == 42  # an error does not stop the thread
    finally:
        owner.stop()


def test_after_stop_a_call_raises_stopped_and_never_runs():
    ran = []
    owner = OwnerThread(lambda: Round.IDLE, name="owner-test")
    owner.call(lambda: ran.append("before"))
    owner.stop()
    with pytest.raises(Stopped, match="owner-test has stopped"):
        owner.call(lambda: ran.append("after"))
    assert ran == ["before"]


def test_a_call_queued_while_the_thread_stops_gets_an_answer():
    """Callers racing the stop either run or raise Stopped; none is left waiting."""
    gate = threading.Event()

    def work() -> Round:
        gate.wait(0.01)
        return Round.WAITING
    owner = OwnerThread(work, name="owner-test")
    results: list[str] = []

    def caller() -> None:
        try:
            owner.call(lambda: None)
            results.append("ran")
        except Stopped:
            results.append("stopped")
    threads = [threading.Thread(target=caller) for _ in range(20)]
    for t in threads:
        t.start()
    owner.stop()
    for t in threads:
        t.join(timeout=5)
    assert not any(t.is_alive() for t in threads)
    assert len(results) == 20


def test_after_runs_on_the_owner_thread_after_each_command_before_its_caller_returns():
    """What `after` publishes (a worker's load) is current by the time a command's caller returns."""
    state = {"n": 0}
    published: list[tuple[int, str]] = []
    owner = OwnerThread(lambda: Round.IDLE, name="owner-test",
                        after=lambda: published.append((state["n"], threading.current_thread().name)))
    try:
        for i in range(1, 4):
            owner.call(lambda: state.__setitem__("n", state["n"] + 1))
            assert published[-1][0] == i  # published before call() returned
        assert {name for _, name in published} == {"owner-test"}
        with pytest.raises(ZeroDivisionError):
            owner.call(lambda: 1 / 0)
        assert published[-1][0] == 3  # after runs after a failed command too
    finally:
        owner.stop()


def test_a_failing_after_is_logged_and_the_thread_keeps_serving():
    def broken() -> None:
        raise RuntimeError("cannot publish")
    owner = OwnerThread(lambda: Round.IDLE, name="owner-test", after=broken)
    try:
        assert owner.call(lambda: 7) == 7 and owner.call(lambda: 8) == 8
    finally:
        owner.stop()


def test_an_idle_owner_sleeps_until_a_command_and_a_waiting_one_polls():
    """IDLE: no round runs until a command comes (an idle worker burns no CPU); WAITING: rounds follow
    every `poll_s` (a transfer under way is looked at); stop wakes a sleeping owner at once."""
    rounds = {"idle": 0, "waiting": 0}

    def idle() -> Round:
        rounds["idle"] += 1
        return Round.IDLE

    def waiting() -> Round:
        rounds["waiting"] += 1
        return Round.WAITING
    sleeper = OwnerThread(idle, name="idle-owner")
    poller = OwnerThread(waiting, name="waiting-owner", poll_s=0.005)
    try:
        time.sleep(0.3)
        assert rounds["idle"] == 1  # the first round, then asleep
        assert rounds["waiting"] >= 10
        sleeper.call(lambda: None)  # one command: one more round (it runs after the caller returns)
        deadline = time.monotonic() + 2.0
        while rounds["idle"] < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)
        assert rounds["idle"] == 2
    finally:
        t0 = time.monotonic()
        sleeper.stop()
        poller.stop()
        assert time.monotonic() - t0 < 1.0


def test_a_paused_owner_runs_commands_on_its_thread_but_no_rounds_until_resumed():
    """A worker builds its engine through a paused owner (the engine's OpenMP threads then belong to the
    thread that computes): commands run on the owner thread at once, rounds and `after` only after `resume`."""
    rounds, afters = [], []
    owner = OwnerThread(lambda: rounds.append(1) or Round.IDLE, name="paused", after=lambda: afters.append(1),
                        paused=True)
    try:
        assert owner.call(threading.current_thread).name == "paused"
        time.sleep(0.05)
        assert rounds == [] and afters == []
        owner.resume(poll_s=0.001)
        deadline = time.monotonic() + 5
        while not rounds and time.monotonic() < deadline:
            time.sleep(0.01)
        assert rounds and afters
    finally:
        owner.stop()


def test_a_paused_owner_stops_cleanly():
    owner = OwnerThread(lambda: Round.IDLE, name="paused-stop", paused=True)
    owner.stop()
    with pytest.raises(Stopped):
        owner.call(lambda: None)
