"""pdserve.bench.cpu_watch: other processes' CPU share, and retrying a contaminated workload."""
from __future__ import annotations

import itertools
from collections import namedtuple

import pytest

from pdserve.bench import cpu_watch
from pdserve.bench.cpu_watch import Contended, CpuMonitor

Times = namedtuple("Times", "user nice system idle iowait irq softirq steal guest guest_nice")


def test_busy_time_is_all_but_idle_and_iowait_and_counts_guest_once():
    t = Times(user=10, nice=1, system=2, idle=100, iowait=5, irq=0.5, softirq=0.25, steal=3, guest=4, guest_nice=1)
    assert cpu_watch._busy_seconds(t) == pytest.approx(10 + 1 + 2 + 0.5 + 0.25 + 3)


def test_busy_time_tolerates_platforms_without_linux_fields():
    assert cpu_watch._busy_seconds(namedtuple("T", "user system idle")(3, 1, 9)) == 4


def test_busy_time_matches_the_live_counters():
    busy = cpu_watch._snapshot()[1]
    assert 0 < busy <= cpu_watch._snapshot()[1]


def fake_clock(monkeypatch: pytest.MonkeyPatch, other_share_per_second: list[float], cpus: int = 2) -> None:
    """Each _snapshot() advances one second; other processes use the given share of the machine in it."""
    shares = itertools.chain(other_share_per_second, itertools.repeat(other_share_per_second[-1]))
    state = {"t": 0.0, "busy": 0.0}

    def snapshot() -> cpu_watch.Snapshot:
        state["t"] += 1.0
        state["busy"] += next(shares) * cpus
        return state["t"], state["busy"], 0.0

    monkeypatch.setattr(cpu_watch, "_snapshot", snapshot)
    monkeypatch.setattr(cpu_watch.os, "cpu_count", lambda: cpus)
    monkeypatch.setattr(cpu_watch.time, "sleep", lambda _: None)
    monkeypatch.setattr(cpu_watch.time, "perf_counter", lambda: state["t"] + 1.0)


def test_other_share_subtracts_this_process(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(cpu_watch, "_snapshot", lambda: (11.0, 30.0, 2.0))
    monkeypatch.setattr(cpu_watch.os, "cpu_count", lambda: 2)
    assert cpu_watch.other_share((1.0, 20.0, 0.0)) == pytest.approx((10 - 2) / (10 * 2))


def test_run_records_other_cpu_on_a_quiet_machine(monkeypatch: pytest.MonkeyPatch):
    fake_clock(monkeypatch, [0.0])
    mon = CpuMonitor(patience_s=10, log=lambda _: None)
    out = mon.run(lambda: {"x": 1})
    assert out == {"x": 1, "other_cpu": 0.0} and mon.retries == 0


def test_run_repeats_a_contaminated_workload(monkeypatch: pytest.MonkeyPatch):
    fake_clock(monkeypatch, [0.0])
    calls = []

    def workload() -> dict:
        calls.append(1)
        if len(calls) == 1:
            raise Contended("busy")
        return {}

    logs = []
    mon = CpuMonitor(patience_s=10, log=logs.append)
    assert mon.run(workload)["other_cpu"] == 0.0
    assert len(calls) == 2 and mon.retries == 1 and "running that workload again" in logs[0]


def test_check_raises_when_others_take_the_cpu(monkeypatch: pytest.MonkeyPatch):
    fake_clock(monkeypatch, [0.5])
    mon = CpuMonitor(patience_s=0, log=lambda _: None)
    with pytest.raises(Contended, match="50%"):
        mon.check()
