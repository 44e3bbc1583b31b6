"""Progress lines for pdserve's long steps (model fetch, calibration, benchmarks): plain text, one
line per step, with its number, the seconds since the task began and, from the steps done so far,
an estimate of the time left; `still` reports a single long wait every few seconds. They go to a
`report` callable (a logger's `info`, or a print to stderr), so each caller keeps its own channel
and level. No torch.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

Report = Callable[[str], None]


class Steps:
    """The numbered steps of one task.

    Args:
        what: the task, leading each line ("calibrating", "engine benchmark").
        total: how many steps it has.
        report: receives each line.
    """

    def __init__(self, what: str, total: int, report: Report) -> None:
        if total < 1:
            raise ValueError(f"total must be >= 1 steps, got {total}")
        self.what, self.total, self._report = what, total, report
        self.done = 0
        self._t0 = time.monotonic()

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self._t0

    def step(self, name: str) -> None:
        """Step `name` starts: reports `what [i/n] name (T s so far, about E s left)`."""
        self.done = min(self.done + 1, self.total)
        elapsed = self.elapsed_s
        eta = ""
        if self.done > 1:  # the mean of the steps done so far, for those left (this one included)
            eta = f", about {elapsed / (self.done - 1) * (self.total - self.done + 1):.0f} s left"
        self._report(f"{self.what} [{self.done}/{self.total}] {name} ({elapsed:.0f} s so far{eta})")

    def finish(self, summary: str = "done") -> None:
        self._report(f"{self.what}: {summary} in {self.elapsed_s:.1f} s")


@contextmanager
def still(report: Report, doing: str, every_s: float = 10.0) -> Iterator[None]:
    """While the block runs, report `still <doing> (T s)` every `every_s` seconds (nothing when it
    ends sooner): a single call that says nothing for long (a download, a conversion) shows it is alive."""
    stop = threading.Event()
    t0 = time.monotonic()

    def beat() -> None:
        while not stop.wait(every_s):
            report(f"still {doing} ({time.monotonic() - t0:.0f} s)")

    t = threading.Thread(target=beat, daemon=True, name="pdserve-progress")
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()
