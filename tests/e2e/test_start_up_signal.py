"""`pdserve serve` stops on SIGINT / SIGTERM at any point of its start-up, not only once it serves: Ray's
start takes SIGINT over from Python's own handler, and a Ctrl-C while the workers started or calibrated
was lost (the server went on to serve)."""
from __future__ import annotations

import signal
import subprocess

import pytest

from tests.e2e.conftest import spawn_server, stop_server


@pytest.mark.parametrize("phase,sig", [("starting workers", signal.SIGINT),  # the workers start in a thread
                                       ("[pdserve] calibrating [1/", signal.SIGTERM)])  # calibration, a coroutine
def test_a_signal_while_the_server_starts_stops_it(phase, sig):
    srv = spawn_server(["--prefill", "1", "--decode", "1", "--no-compile"], until=phase)  # the phases, not the compile
    srv.proc.send_signal(sig)
    try:
        code = srv.proc.wait(90)
    except subprocess.TimeoutExpired:
        stop_server(srv.proc, log=srv.log)
        raise AssertionError("pdserve serve went on after a signal during its start-up:\n" + "".join(srv.log[-40:]))
    log = "".join(srv.log)
    assert code == 0, log[-3000:]
    assert "[pdserve] stopped while starting" in log, log[-3000:]
    assert "READY" not in log
