"""Ray nodes for multi-node tests on one machine: each `ray start --block` runs in a process group
of its own and is stopped by signalling that group. No `ray stop`, which would stop every Ray on
the machine (the e2e session's server among them)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from pdserve.bench.serving import free_port

RAY = str(Path(sys.executable).with_name("ray"))
# Token auth is Ray's default for local clusters; the drivers of these tests run without it.
ENV = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONUNBUFFERED": "1"}


def start_node(flags: list[str], log: Path) -> subprocess.Popen:
    """Start one node (`flags` as for `ray start`) and wait until it is up; its output goes to `log`."""
    with open(log, "w") as out:
        proc = subprocess.Popen([RAY, "start", "--block", "--node-ip-address=127.0.0.1", "--disable-usage-stats",
                                 f"--dashboard-agent-listen-port={free_port()}", *flags], stdout=out,
                                stderr=subprocess.STDOUT, env=ENV, start_new_session=True)
    deadline = time.monotonic() + 120
    while "Ray runtime started" not in log.read_text():  # nodes start one at a time (shared session dir)
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_group(proc)
            raise RuntimeError(f"ray start failed:\n{log.read_text()[-3000:]}")
        time.sleep(0.3)
    return proc


def stop_group(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    """Stop a node's whole process group: SIGTERM, then SIGKILL."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait_s)
            return
        except subprocess.TimeoutExpired:
            continue
