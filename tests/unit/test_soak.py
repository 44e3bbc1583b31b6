"""`pdserve bench soak`'s pure parts: the fault cycle flag, and the report table it writes."""
from __future__ import annotations

import argparse

import pytest

from loadtest.records import RequestRecord
from pdserve.bench.soak import (
    FAULTS,
    MARK_END,
    MARK_START,
    _faults,
    _write_report,
    failures_by_cause,
    machine,
    status_line,
)


def test_the_fault_cycle_is_checked_by_name() -> None:
    assert _faults("kill-decode, restart-router") == ["kill-decode", "restart-router"]
    with pytest.raises(argparse.ArgumentTypeError, match="unknown fault.*reboot.*choose from kill-prefill"):
        _faults("kill-decode,reboot")
    with pytest.raises(argparse.ArgumentTypeError):
        _faults(" , ")


def test_the_report_counts_faults_that_happened_and_the_router_s_downtime(tmp_path) -> None:
    faults = [{"fault": f, "ok": True} for f in FAULTS] + [{"fault": "hang-decode", "ok": False, "out": "no actor"}]
    faults[-2]["downtime_s"] = 7.6  # restart-router
    doc = {"machine": "2 cores", "minutes": 10.0, "command": "pdserve serve ...", "rate": 0.5, "workload": "128/64",
           "faults": faults, "recoveries": {"action=migrate": 2.0}, "replacements": {"pool=decode": 2.0},
           "summary": {"requests": {"total": 300, "ok": 297, "errors": 3}, "errors_by_kind": {"connection": 3}},
           "memory_mib": {"start": {"router": 400, "workers": 7000}, "end": {"router": 410, "workers": 7100}},
           "failures": {"router_down": 2, "router_killed": 1, "other": 0}}
    report = tmp_path / "B.md"
    report.write_text(f"# x\n\n{MARK_START}\nold\n{MARK_END}\n\nafter\n")
    _write_report(doc, report)
    text = report.read_text()
    assert "old" not in text and text.endswith("\n\nafter\n")
    row = next(line for line in text.splitlines() if line.startswith("| 10.0 |"))
    assert "| 297 | 3 (connection: 3; sent while the router was down: 2, in flight when it was killed: 1, other: 0) |" \
        in row
    # the hang that failed is not counted
    assert "kill-prefill: 1, kill-decode: 1, hang-prefill: 1, hang-decode: 1, restart-router: 1" in row
    assert "| 8–8 s |" in row and "migrate: 2" in row and "decode: 2" in row


def test_the_machine_line_names_the_class_and_cores() -> None:
    from engine import hardware

    line = machine()
    assert hardware.this_cpu().machine_class() in line and " cores, " in line and "torch " in line


def test_failures_are_told_apart_by_the_router_restarts_around_them() -> None:
    t_run = 1000.0
    events = [{"fault": "kill-decode", "t": 1010.0, "ok": True},
              {"fault": "restart-router", "t": 1050.0, "ok": True, "downtime_s": 20.0}]

    def rec(start: float, e2e: float | None, error: str | None = "boom") -> RequestRecord:
        return RequestRecord(0, 8, 8, start_s=start, e2e_s=e2e, error=error)
    records = [rec(5, 2, None), rec(55, None), rec(69, 0.1),  # fine; refused twice while the router was down
               rec(48, 3.0), rec(40, None),  # in flight when it was killed (the second's end unknown)
               rec(20, 1.0), rec(80, 1.0)]  # failed for other reasons: ended well before the kill, or after
    assert failures_by_cause(records, events, t_run) == {"router_down": 2, "router_killed": 2, "other": 2}


def test_the_status_line_says_how_far_the_soak_is() -> None:
    events = [{"fault": "kill-prefill", "ok": True}, {"fault": "kill-decode", "ok": False}]
    assert status_line(754.0, 30, 230, 220, 4, events) == (
        "[soak] 12.6/30 min | 230 requests sent, 224 ended: 220 ok, 4 failed | 2 faults done (1 took effect, "
        "last: kill-decode)")
    assert status_line(60.0, 0.5, 0, 0, 0, []).endswith("| 0 faults done (0 took effect)")
