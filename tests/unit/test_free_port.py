"""`free_port`: a port that is free and outside the kernel's ephemeral range (where an outgoing connection
could take it before the server it is meant for binds it) and Ray's worker ports."""
from __future__ import annotations

import socket

import pytest

from pdserve.bench.serving import free_port


@pytest.mark.parametrize("ephemeral,below", [(32768, 32768), (49152, 49152), (1024, 30000)])
def test_free_port_is_bindable_and_below_the_ephemeral_range(monkeypatch, ephemeral, below) -> None:
    monkeypatch.setattr("pdserve.bench.serving._ephemeral_low", lambda: ephemeral)
    for _ in range(20):
        port = free_port()
        assert 20000 <= port < below
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_free_port_passes_over_a_port_in_use(monkeypatch) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        picks = iter([taken, taken, 20001])

        class Picks:
            def randrange(self, lo: int, hi: int) -> int:
                return next(picks)
        monkeypatch.setattr("pdserve.bench.serving._PORT_PICKS", Picks())
        monkeypatch.setattr("pdserve.bench.serving._ephemeral_low", lambda: 65535)
        assert free_port() == 20001
