"""The router's background work stops cleanly: the load poller when cancelled, even when the awaited
result arrives in the same loop turn as the cancel (the race that makes 3.11's `asyncio.wait_for`
swallow the cancel and leave `stop_polling` waiting forever); a respawn thread whose waiter was
cancelled. Pure asyncio: workers are stand-ins."""
from __future__ import annotations

import asyncio
from dataclasses import replace

from router.config import RouterConfig
from router.pools import Pools
from router.service import Router
from tests.unit.test_policy import measured_cost
from worker_core.protocol import LoadReport, WorkerInfo

_INFO = WorkerInfo(worker_id="d0", num_blocks=64, block_size=16, kv_bytes_per_token=1024, num_layers=2,
                   max_num_seqs=8, max_model_len=2048, prefill_chunk_tokens=256, vocab_size=512, dtype="float32",
                   dtype_reason="set explicitly",
                   attention="torch", compiled=False, linear="plain")


class _Method:
    """Stands in for an actor method: `.remote()` hands out a future the test resolves."""

    def __init__(self) -> None:
        self.calls: list[asyncio.Future] = []
        self.called = asyncio.Event()

    def remote(self, *args) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        self.calls.append(fut)
        self.called.set()
        return fut


class _Worker:
    def __init__(self) -> None:
        self.load = _Method()


def _router(worker: _Worker) -> Router:
    pools = Pools(prefill=[], decode=[worker], prefill_peers=[], decode_peers=[None])
    return Router(pools, [], [_INFO], None, "m", RouterConfig(load_poll_s=0.01), measured_cost())


def test_stop_polling_returns_when_a_load_answer_races_the_cancel() -> None:
    async def main() -> None:
        worker = _Worker()
        router = _router(worker)
        router.start_polling()
        await worker.load.called.wait()
        worker.load.calls[-1].set_result(LoadReport(free_blocks=64, num_blocks=64))
        stop = asyncio.create_task(router.stop_polling())  # cancel lands before the poller resumes
        await asyncio.wait([stop], timeout=2)
        assert stop.done(), "stop_polling hung: the poller swallowed its cancel"
        assert router.health._poller.cancelled()

    asyncio.run(main())


def test_a_respawn_whose_waiter_was_cancelled_finishes_quietly() -> None:
    """The respawn thread outlives a cancelled waiter (e.g. at shutdown) without an error of its own;
    results and errors reach a waiter that stays."""
    import threading
    import time

    from router.health import in_daemon_thread

    errors: list[BaseException] = []
    hook, threading.excepthook = threading.excepthook, lambda a: errors.append(a.exc_value)
    try:
        async def main() -> None:
            gone = asyncio.create_task(in_daemon_thread(time.sleep, 0.2))
            await asyncio.sleep(0.05)
            gone.cancel()
            await asyncio.gather(gone, return_exceptions=True)
            assert await in_daemon_thread(lambda x: 2 * x, 21) == 42
            try:
                await in_daemon_thread(lambda: 1 / 0)
                raise AssertionError("the error did not reach the waiter")
            except ZeroDivisionError:
                pass
            await asyncio.sleep(0.3)  # the first call has finished by now

        asyncio.run(main())
    finally:
        threading.excepthook = hook
    assert errors == []


def test_the_runtime_comes_from_the_workers_and_names_who_chose_the_dtype() -> None:
    """The decode worker's dtype, kernel and compile state; the reason of the first worker started
    (here a prefill worker: it chose, the rest were started with its dtype)."""
    from router.pools import Pools
    from router.types import Runtime

    chooser = replace(_INFO, worker_id="p0", dtype_reason="the CPU has no bf16 instructions")
    decode = replace(_INFO, attention="avx2", compiled=True, linear="packed")
    router = Router(Pools(decode=[_Worker()]), [chooser], [decode], None, "m", RouterConfig(), measured_cost())
    assert router.runtime == Runtime("float32", "the CPU has no bf16 instructions", "avx2", True, "packed")
    assert router.runtime.summary() == "float32, avx2, linear packed, compiled"
    assert router.models()[0].runtime == router.runtime
