"""`WorkerBase`: the part of a worker actor that does not depend on its role.

A worker owns one `LLMEngine` on one device and one KV connector registered on that engine's
pool. Only the engine-loop thread (`OwnerThread`) touches the engine, and builds it; actor methods, which Ray
runs on other threads, hand it commands with `self._owner.call`. Liveness never waits behind that
thread: `info()` is fixed at start, `load()` is the report the engine thread publishes after every
command and every round, and `cache_events()` reads the prefix cache's event log. A subclass sets
up its own state, then calls `_start_loop()`, and implements `_work()` (one round of the loop) and
`_load_now()` (its `LoadReport`).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import sys

import torch

from engine import EngineConfig, LLMEngine
from engine.block_manager import CacheDelta
from engine.command_loop import OwnerThread, Round, Stopped
from engine.profiling import time_prefill, time_threads_speedup
from kv_transfer import PeerInfo, TransferConfig, make_connector
from worker_core.protocol import LoadReport, StepTotals, ThreadSpeedup, WorkerInfo

LOG_LEVEL_ENV = "PDSERVE_WORKER_LOG_LEVEL"  # set by `pdserve serve` (its --log-level) for its workers' processes
_LOGGERS = ("engine", "worker_core", "prefill_worker", "decode_worker", "kv_transfer")
SETTLED_POLL_S = 0.05  # how often a waiting engine loop looks at transfers its connector wakes it for


def _log_to_stderr() -> None:
    """In a worker process started by `pdserve serve`: pdserve's log lines (kernel builds, the decode
    step's compilation, ...) at the router's level to stderr, which Ray forwards to the router's,
    prefixed with the worker. Ray configures its own logger only: without this, INFO lines are lost.
    Elsewhere (the variable unset: tests, embedding) logging stays as it is."""
    level = os.environ.get(LOG_LEVEL_ENV)
    if not level or not isinstance(logging.getLevelName(level.upper()), int):  # unset, or no level's name
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    for name in _LOGGERS:
        logger = logging.getLogger(name)
        if not logger.handlers:  # once per process, whatever number of workers it hosts
            logger.addHandler(handler)
            logger.setLevel(level.upper())
            logger.propagate = False


def _node_address() -> str | None:
    """This node's address as Ray knows it (None outside Ray: the connector picks one)."""
    import ray

    return ray.util.get_node_ip_address() if ray.is_initialized() else None


def model_fingerprint(config: object) -> str:
    """The model a KV pool belongs to, for pairing checks: its type and a digest of its
    configuration (where it was loaded from and the loading library's version left out)."""
    d = {k: v for k, v in config.to_dict().items() if k not in ("_name_or_path", "transformers_version")}
    digest = hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return f"{d.get('model_type', 'model')}:{digest}"


class ThreadCount:
    """The torch thread count a worker computes with, asked for from any thread (`want`: a loan made or
    ended by the router) and taken up by the engine thread (`apply`; torch's count belongs to the thread
    that sets it) between steps and between the layers of a prefill step, so a loan reaches a prompt
    that is already computing (a whole 1024-token prompt is one step of seconds).

    Args: own: the worker's own thread count (what its engine was built with); more is a loan."""

    def __init__(self, own: int) -> None:
        if own < 1:
            raise ValueError(f"own must be >= 1, got {own}")
        self.own = own
        self._wanted: int | None = None
        self._applied: int | None = None  # what `apply` last set (profiling may set its own meanwhile)

    @property
    def borrowed(self) -> bool:
        """Whether the engine thread computes with another worker's threads too (as of its last `apply`)."""
        return self._applied is not None and self._applied > self.own

    def want(self, threads: int) -> None:
        """Any thread: compute with `threads` from the engine thread's next `apply` on."""
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self._wanted = threads  # one reference swap, read by the engine thread

    def apply(self) -> None:
        """Engine thread: take up a count asked for since the last `apply` (nothing new: nothing changes)."""
        wanted = self._wanted
        if wanted is not None and wanted != self._applied:
            torch.set_num_threads(wanted)
            self._applied = wanted


class WorkerBase:
    """Args: engine_config, transfer_config, worker_id (unique; names the worker in transfers)."""

    def __init__(self, engine_config: EngineConfig, transfer_config: TransferConfig, worker_id: str) -> None:
        _log_to_stderr()
        self.worker_id = worker_id
        self._configs = (engine_config, transfer_config)  # as given: a replacement elsewhere resolves its own host
        self._kept: object | None = None
        # The engine is built on its own thread and computes only there: in a process where another
        # thread has run OpenMP regions too, every region runs slower (libgomp then holds more threads
        # than CPUs and stops spinning between regions: on a 2-core Xeon a 1024-token bf16 prefill took
        # 0.39 s instead of 0.29 s). The loop's rounds start with `_start_loop`.
        self._owner = OwnerThread(self._work, name=f"engine-{worker_id}", after=self._after, paused=True)
        try:
            self.engine = self._owner.call(lambda: LLMEngine(engine_config))
        except BaseException:
            self._owner.stop()
            raise
        if transfer_config.host is None:  # the transfer plane listens where Ray reaches this node
            transfer_config = dataclasses.replace(transfer_config, host=_node_address())
        self.connector = make_connector(transfer_config, worker_id)
        self.connector.register(self.engine.runner.kv, model_fingerprint(self.engine.runner.model.config))
        self._info = WorkerInfo(worker_id=worker_id, **self.engine.describe())  # static: answered off the engine thread
        self._threads = ThreadCount(self._owner.call(torch.get_num_threads))  # the count the engine was built with

    def _start_loop(self) -> None:
        """Start the engine loop; call last in the subclass's `__init__` (it starts running at once)."""
        self._publish_load()
        # A connector that wakes the loop as each transfer settles leaves it only a slow look for safety;
        # one that cannot is polled (each look is an engine-thread round: ~5-10% of a core at 500 a second,
        # taken from the prefill computing beside it on a small node).
        poll_s = SETTLED_POLL_S if self.connector.wakes_owner else OwnerThread.POLL_S
        self._owner.resume(poll_s)
        self.connector.set_waker(self._owner.commands.wake)
        self._owner.call(lambda: self.engine.set_prefill_layer_hook(self._after_layer))

    def _after_layer(self, layer: int, seqs: list) -> None:
        """Engine thread, after each layer of a step that computes prompts: a loan made or ended meanwhile
        takes effect from the next layer."""
        self._threads.apply()

    def _work(self) -> Round:
        """One round of the engine loop; returns what it left (`Round`)."""
        raise NotImplementedError

    def _load_now(self) -> LoadReport:
        """The worker's load, read on the engine thread."""
        raise NotImplementedError

    def _abort(self, request_id: str) -> bool:
        """Engine thread: drop one request wherever it is here; its blocks return. Returns whether it was found."""
        raise NotImplementedError

    def _publish_load(self) -> None:
        """Engine thread: the report `load()` hands out."""
        # one reference swap: never half-built
        st = self.engine.stats
        steps = StepTotals(st.decode_seconds, st.decode_steps, st.decode_tokens - st.ride_tokens, st.prefill_seconds,
                           st.prefill_steps, st.mixed_steps, st.ride_tokens, st.prefill_tokens,
                           self._owner.busy_s, st.decode_context)
        self._load: LoadReport | None = dataclasses.replace(self._load_now(), threads=torch.get_num_threads(),
                                                            preemptions=self.engine.scheduler.num_preemptions,
                                                            steps=steps)

    def _after(self) -> None:
        """Engine thread, after every command and every round: publish the load and what else the role
        hands out once per round."""
        self._publish_load()

    # -- actor API shared by both roles (any thread) -------------------------------------------------
    def pid(self) -> int:
        """This worker's process id (fault-injection tests kill it)."""
        return os.getpid()

    def node_id(self) -> str:
        """The Ray node this worker runs on."""
        import ray

        return ray.get_runtime_context().get_node_id()

    def peer_info(self) -> PeerInfo:
        """This worker's transfer address, for its peers."""
        return self.connector.local_info()

    def load(self) -> LoadReport:
        """The load as of the engine thread's last command or round. Never waits behind the engine
        thread: a worker in a long prefill answers at once (busy, not dead). Raises Stopped after
        `shutdown` (a stopped worker is not a healthy one)."""
        load = self._load
        if load is None:
            raise Stopped(f"worker {self.worker_id} has shut down")
        return load

    def cache_events(self, acked: int) -> CacheDelta:
        """What entered and left this worker's prefix cache after event number `acked` (0: all it holds).
        Never waits behind the engine thread."""
        return self.engine.block_manager.events.since(acked)

    def info(self) -> WorkerInfo:
        """Static facts the router plans with (KV geometry, limits, vocabulary size) and what runs them
        (dtype, attention kernel, compiled). Never waits behind the engine thread."""
        return self._info

    def set_threads(self, threads: int) -> None:
        """Compute with `threads` torch threads from the next engine step on, and within a prefill step
        under way from its next layer (compute lent by a worker on the same node, or given back)."""
        self._threads.want(threads)  # a prefill step under way takes it up at its next layer
        self._owner.call(self._threads.apply)

    def prepare_threads(self, threads: int) -> None:
        """Get ready to compute with `threads` threads (`set_threads`) without a pause then: the compiled
        decode step is compiled for that thread count now (seconds; call before serving)."""
        self._owner.call(lambda: self.engine.runner.prepare_threads(threads))

    def profile_threads(self, threads: int) -> ThreadSpeedup:
        """How much faster this worker's engine decodes and prefills with `threads` threads than with its
        own (call while idle, after `prepare_threads(threads)`)."""
        decode, prefill = self._owner.call(lambda: time_threads_speedup(self.engine, threads))
        return ThreadSpeedup(decode, prefill)

    def profile_prefill(self, lengths: list[int]) -> list[float]:
        """Seconds of a prefill of each prompt length, on this worker's engine (call while idle)."""
        return self._owner.call(lambda: [time_prefill(self.engine, n, seed=i) for i, n in enumerate(lengths)])

    def configs(self) -> tuple[EngineConfig, TransferConfig]:
        """What this worker was started with (its transfer secret too): a router that adopts it starts
        any replacement the same way."""
        return self._configs

    def keep(self, state: object) -> None:
        """Hold `state` for the router (its calibrated cost model), which a restarted router reads back."""
        self._kept = state

    def kept(self) -> object | None:
        return self._kept

    def abort_all(self) -> int:
        """Drop every request held here (for a router that adopts this worker: it knows none of them);
        their blocks return to the pool. Returns how many there were."""
        def do() -> int:
            sched = self.engine.scheduler
            ids = [s.request_id for s in (*sched.waiting, *sched.running, *sched.receiving.values(),
                                          *sched.held.values())]
            return sum(self._abort(rid) for rid in ids)
        return self._owner.call(do)

    def drop_peer(self, peer_id: str) -> None:
        """A peer worker is gone for good: release this worker's pair with it."""
        self.connector.drop_peer(peer_id)

    def shutdown(self) -> None:
        """Stop the engine loop and the connector. Requests still running end with WORKER_STOPPING."""
        try:
            self._owner.call(self._stopping)
        except Stopped:  # a second shutdown
            pass
        self._owner.stop()
        self._load = None
        self.connector.close()

    def _stopping(self) -> None:
        """On the engine thread, before it stops: end what is in flight (the role's own streams)."""
