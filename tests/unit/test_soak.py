"""`pdserve bench soak`'s pure parts: the fault cycle flag, and the report table it writes."""
from __future__ import annotations

import argparse

import pytest

from pdserve.bench.soak import FAULTS, MARK_END, MARK_START, _faults, _write_report, machine


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
           "memory_mib": {"start": {"router": 400, "workers": 7000}, "end": {"router": 410, "workers": 7100}}}
    report = tmp_path / "B.md"
    report.write_text(f"# x\n\n{MARK_START}\nold\n{MARK_END}\n\nafter\n")
    _write_report(doc, report)
    text = report.read_text()
    assert "old" not in text and text.endswith("\n\nafter\n")
    row = next(line for line in text.splitlines() if line.startswith("| 10.0 |"))
    assert "| 297 | 3 (connection: 3) |" in row
    assert "kill-prefill: 1, kill-decode: 1, hang-prefill: 1, hang-decode: 1, restart-router: 1" in row  # failed one not
    assert "| 8–8 s |" in row and "migrate: 2" in row and "decode: 2" in row


def test_the_machine_line_names_the_class_and_cores() -> None:
    from engine import hardware

    line = machine()
    assert hardware.this_cpu().machine_class() in line and " cores, " in line and "torch " in line
