"""Guard benchmarks against other processes on a small machine.

On 2 cores, one busy process from someone else makes 2-thread torch runs 2-50× slower
(threads wait on a descheduled sibling). `CpuMonitor` measures the CPU share other processes
take (the machine's busy CPU time from psutil, minus this process's CPU time), waits for a quiet
machine, and lets a workload abort early (`check`) so that it can be run again instead of being
reported wrong.
"""
from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable
from typing import Any

import psutil

Snapshot = tuple[float, float, float]  # wall clock, machine busy CPU seconds, this process's CPU seconds


class Contended(Exception):
    """Another process took too much CPU during a timed workload."""


def _busy_seconds(times: Any) -> float:
    """Machine-wide CPU seconds spent on anything but idle and iowait; steal counts as busy.

    On Linux, guest time is already part of user and nice time, so it is not added again.
    """
    busy = times.user + times.system
    for field in ("nice", "irq", "softirq", "steal"):
        busy += getattr(times, field, 0.0)
    return busy


def _snapshot() -> Snapshot:
    busy = _busy_seconds(psutil.cpu_times())
    return time.perf_counter(), busy, time.process_time()


def other_share(since: Snapshot) -> float:
    """Fraction of the machine's CPU (0..1) that other processes used since `since`."""
    t, busy, own = _snapshot()
    return max(0.0, ((busy - since[1]) - (own - since[2])) / (max(t - since[0], 1e-6) * (os.cpu_count() or 1)))


class CpuMonitor:
    """Tracks other processes' CPU share per workload.

    Args:
        patience_s: total time, over the whole run, spent waiting for quiet; once spent, workloads
            are no longer aborted or retried (their contamination is only recorded).
        limit: other processes' share above which a workload counts as contaminated.
        log: where progress lines go.
    """

    def __init__(self, patience_s: float, log: Callable[[str], None], limit: float = 0.1) -> None:
        self.patience_s, self.limit, self.log = patience_s, limit, log
        self.waited_s, self.retries, self.strict = 0.0, 0, True
        self.start = self.window = _snapshot()

    def wait_quiet(self) -> None:
        """Wait, within what is left of the patience, until other processes use < `limit` of the CPU."""
        while self.waited_s < self.patience_s:
            snap = _snapshot()
            time.sleep(0.5)
            self.waited_s += 0.5
            if (share := other_share(snap)) < self.limit:
                return
            if self.waited_s % 5 == 0:
                self.log(f"other processes use {100 * share:.0f}% of the CPU; waiting for a quiet machine")

    def check(self) -> None:
        """Call often inside a workload: raises Contended when the last second or more was contaminated."""
        if self.strict and time.perf_counter() - self.window[0] >= 1.0:
            share, self.window = other_share(self.window), _snapshot()
            if share > 2 * self.limit:
                raise Contended(f"other processes took {100 * share:.0f}% of the CPU")

    def run(self, fn: Callable[[], dict[str, Any]], max_attempts: int = 6) -> dict[str, Any]:
        """Run a workload on a quiet machine if possible, again if it was contaminated; records `other_cpu`."""
        for attempt in itertools.count(1):
            self.wait_quiet()
            self.strict = attempt < max_attempts and self.waited_s < self.patience_s
            self.start = self.window = _snapshot()
            try:
                out = fn()
            except Contended as e:
                self.log(f"{e}; running that workload again")
                self.retries += 1
                continue
            out["other_cpu"] = other_share(self.start)
            if out["other_cpu"] <= self.limit or not self.strict:
                return out
            self.log(f"other processes took {100 * out['other_cpu']:.0f}% of the CPU; running that workload again")
            self.retries += 1
        raise AssertionError("unreachable")
