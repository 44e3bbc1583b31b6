"""`pdserve serve`: Ray, the pools, calibration, then HTTP and gRPC until SIGINT / SIGTERM.

1. Connect to Ray: a local cluster (whose custom resources make room for the pools) or an
   existing one (`--address`), whose nodes advertise `prefill_pool` / `decode_pool`.
2. Start the prefill and decode actors; read their KV geometry and limits.
3. Calibrate the cost model on them (prefill, decode step, transfer, round trip).
4. Serve the OpenAI-compatible HTTP API and the gRPC API from one event loop.
5. On a signal: stop accepting, cancel in-flight streams (their blocks are freed), stop the actors.
   The handlers are installed right after step 1 (Ray's start takes SIGINT over from Python's own
   handler, so a Ctrl-C before them was lost): a signal during steps 2-3 ends the start-up there.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, TypeVar

from engine import EngineConfig
from kv_transfer import TransferConfig
from router.config import RouterConfig
from worker_core.protocol import WorkerInfo

if TYPE_CHECKING:
    from router.tls import TlsFiles

log = logging.getLogger("pdserve.serve")
_DEPLOYMENT_NAME = re.compile(r"[A-Za-z0-9_-]{1,63}")


@dataclass(frozen=True)
class ServeConfig:
    """Everything `pdserve serve` runs with.

    Args:
        engine: each worker's engine; transfer: the KV transfer backend; router: placement and admission.
        address: Ray cluster to join (None: start a local one; "auto": the one this machine belongs to).
        num_prefill / num_decode: workers per pool (num_prefill may be 0: local prefill only).
        cpus_per_worker: Ray CPUs each actor claims.
        lend_threads: a prefill worker and a decode worker on one node lend each other their threads
            whenever one has nothing to compute (`router.elastic`; CPU workers); not with
            `router.flip_roles`, the other way to use an idle prefill worker.
        host: interface both servers bind (loopback by default; 0.0.0.0 exposes them).
        http_port / grpc_port: their ports (0 picks a free one).
        ssl_certfile / ssl_keyfile: TLS for both servers (both or neither); protect_metrics: /metrics
            needs an API key too.
        api_keys: keys clients must send (empty: no authentication); never printed.
        deployment: the workers belong to this named deployment, not to this router: they are
            detached Ray actors that outlive it (a crash, a restart, a pod move), and a router
            started again with the same name and cluster adopts them (no new workers, no
            calibration: the cost model is kept with them); `pdserve stop` ends them. Needs
            `address` (a local Ray ends with the router).
        cost_model: start from this measured cost model instead of calibrating: a JSON file of one (as
            `GET /pdserve/cost_model` answers) or a running pdserve's address (http://HOST:PORT, without API
            keys), e.g. the first replica of a fleet; measured on the same model, dtype, kind of machine and
            with prefill workers if these have them (the router corrects its figures online from served
            requests). Read at every start; adopted workers (`deployment`) keep the one they have.
    """

    engine: EngineConfig = field(default_factory=lambda: EngineConfig(compile=True))  # a server runs long: it pays
    transfer: TransferConfig = field(default_factory=TransferConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    address: str | None = field(default=None, metadata={
        "help": "Ray cluster to join: auto, HOST:PORT or ray://HOST:PORT (default: start a local one)"})
    num_prefill: int = field(default=1, metadata={"flag": "--prefill", "help": "prefill workers (0: local prefill only)"})
    num_decode: int = field(default=1, metadata={"flag": "--decode", "help": "decode workers (>= 1)"})
    cpus_per_worker: float = field(default=1.0, metadata={"help": "Ray CPUs each worker claims"})
    lend_threads: bool = field(default=True, metadata={
        "help": "a prefill and a decode worker on one node lend each other their threads while one has nothing "
        "to compute (CPU workers; not with --flip-roles)"})
    host: str = field(default="127.0.0.1", metadata={"help": "interface to bind (0.0.0.0 exposes the server)"})
    http_port: int = field(default=8000, metadata={"help": "OpenAI-compatible HTTP port (0: any free)",
                                                   "aliases": ("--port",)})
    grpc_port: int = field(default=50051, metadata={"help": "gRPC port (0: any free)"})
    ssl_certfile: str | None = field(default=None, metadata={
        "help": "serve HTTPS and gRPC over TLS with this PEM certificate (chain); needs --ssl-keyfile"})
    ssl_keyfile: str | None = field(default=None, metadata={"help": "the certificate's PEM private key"})
    protect_metrics: bool = field(default=False, metadata={
        "help": "with API keys, /metrics needs a key too (Prometheus then scrapes with a bearer token)"})
    api_keys: frozenset[str] = field(default=frozenset(), repr=False)
    deployment: str | None = field(default=None, metadata={
        "help": "name the workers' deployment: they outlive this router and a router started again with the "
        "same name adopts them (needs --address; `pdserve stop` ends them)"})
    cost_model: str | None = field(default=None, metadata={
        "help": "start from this measured cost model, skipping the start-up calibration: a JSON file of "
        "one (GET /pdserve/cost_model) or a running pdserve's http://HOST:PORT, measured on the same model, "
        "dtype and kind of machine"})

    def __post_init__(self) -> None:
        if not isinstance(self.num_prefill, int) or self.num_prefill < 0:
            raise ValueError(f"prefill: must be an integer >= 0 workers, got {self.num_prefill!r}")
        if not isinstance(self.num_decode, int) or self.num_decode < 1:
            raise ValueError(f"decode: must be an integer >= 1 workers, got {self.num_decode!r}")
        if not self.cpus_per_worker >= 0:
            raise ValueError(f"cpus_per_worker: must be >= 0, got {self.cpus_per_worker!r}")
        for name in ("http_port", "grpc_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise ValueError(f"{name}: must be in [0, 65535] (0 = any free port), got {getattr(self, name)}")
        if self.deployment is not None:
            if not _DEPLOYMENT_NAME.fullmatch(self.deployment):
                raise ValueError(f"deployment: letters, digits, '-' and '_' only (1-63), got {self.deployment!r}")
            if self.address is None:
                raise ValueError("deployment: needs --address (workers outlive the router only on a Ray cluster "
                                 "of their own; a local one ends with the router)")
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise ValueError("ssl_certfile / ssl_keyfile: give both (a certificate and its key) or neither")

    @property
    def tls(self) -> TlsFiles | None:
        """Both servers' TLS certificate and key; None: plaintext."""
        if self.ssl_certfile is None or self.ssl_keyfile is None:
            return None
        from router.tls import TlsFiles

        return TlsFiles(self.ssl_certfile, self.ssl_keyfile)


_CLIENT_ATTEMPTS = 3  # a head node under load sometimes fails to start the per-client server once


def _runtime_env() -> dict:
    """What the workers' processes start with: the router's log level (`worker_core.base.LOG_LEVEL_ENV`),
    so that their progress lines (kernel builds, compilation) reach its log as its own do."""
    from worker_core.base import LOG_LEVEL_ENV

    return {"env_vars": {LOG_LEVEL_ENV: logging.getLevelName(logging.getLogger().getEffectiveLevel())}}


def _join(address: str, runtime_env: dict | None = None) -> None:
    """Connect to an existing cluster; a `ray://` connection whose per-client server did not start
    is tried again."""
    import ray

    for attempt in range(1, _CLIENT_ATTEMPTS + 1):
        try:
            ray.init(address=address, log_to_driver=True, runtime_env=runtime_env)
            return
        except ConnectionAbortedError as e:
            if not address.startswith("ray://") or attempt == _CLIENT_ATTEMPTS:
                raise
            why = (str(e).strip().splitlines() or [type(e).__name__])[-1]
            log.warning("Ray Client connection to %s failed (%s); trying again (%d of %d)",
                        address, why, attempt + 1, _CLIENT_ATTEMPTS)
            time.sleep(2.0 * attempt)


def _connect(cfg: ServeConfig) -> None:
    import ray

    from router.pools import DECODE_RESOURCE, PREFILL_RESOURCE

    if cfg.address is not None:
        _join(cfg.address, _runtime_env())
        return
    need = (cfg.num_prefill + cfg.num_decode) * cfg.cpus_per_worker
    ray.init(num_cpus=max(os.cpu_count() or 1, int(need + 0.999)), include_dashboard=False,
             resources={PREFILL_RESOURCE: cfg.num_prefill, DECODE_RESOURCE: cfg.num_decode}, runtime_env=_runtime_env())


def _start_pools(cfg: ServeConfig):
    """The workers: the deployment's running ones when there are (topped up to the configured counts),
    else new ones. Returns (pools, prefill infos, decode infos, their transfer config, what the last
    router kept with them: its cost model, or None)."""
    import ray
    from tqdm import tqdm

    from router.pools import add_worker, adopt_pools, create_pools

    adopted = adopt_pools(cfg.deployment) if cfg.deployment is not None else None
    if adopted is None:
        with tqdm(total=cfg.num_prefill + cfg.num_decode, desc="starting workers", unit="worker",
                  file=sys.stderr) as bar:
            pools = create_pools(cfg.num_prefill, cfg.num_decode, cfg.engine, cfg.transfer, cfg.cpus_per_worker,
                                 on_started=bar.update, deployment=cfg.deployment,
                                 prefill_decodes=cfg.router.flip_roles)
        transfer, kept = cfg.transfer, None
    else:
        pools, transfer, kept = adopted.pools, adopted.transfer_config, adopted.kept
        if pools.engine_config.model != cfg.engine.model:
            raise ValueError(f"deployment: {cfg.deployment!r} runs model {pools.engine_config.model!r}, not "
                             f"{cfg.engine.model!r}; end it first (`pdserve stop`) or give its model")
        pools.prefill_decodes = cfg.router.flip_roles
        if not pools.decode:  # its config came from a prefill worker, which may not compile (`role_config`)
            pools.engine_config = replace(pools.engine_config, compile=cfg.engine.compile)
        print(f"[pdserve] adopted deployment {cfg.deployment!r}: {len(pools.prefill)} prefill + "
              f"{len(pools.decode)} decode workers running ({adopted.aborted} requests of the last router dropped)",
              file=sys.stderr, flush=True)
        for pool, have, want in (("prefill", len(pools.prefill), cfg.num_prefill),
                                 ("decode", len(pools.decode), cfg.num_decode)):
            for _ in range(want - have):
                add_worker(pools, pool, pools.engine_config, transfer, cfg.cpus_per_worker)
    infos = ray.get([w.info.remote() for w in pools.prefill + pools.decode])
    n = len(pools.prefill)
    return pools, infos[:n], infos[n:], transfer, kept


_T = TypeVar("_T")


class _Stopped(Exception):
    """A signal arrived while the server was starting."""


def _stop_on_signals(stop: asyncio.Event) -> None:
    """SIGINT and SIGTERM set `stop` (the event loop's handlers; none outside the main thread, as in tests)."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread (tests)
            pass


def _on_own_thread(fn: Callable[..., _T], *args: object) -> Awaitable[_T]:
    """`fn(*args)` on a daemon thread of its own. Not the loop's executor: `asyncio.run` joins that at exit,
    and a start-up phase a signal abandoned may block in Ray for minutes after the teardown."""
    done: concurrent.futures.Future[_T] = concurrent.futures.Future()

    def work() -> None:
        if not done.set_running_or_notify_cancel():  # abandoned before it started
            return
        try:  # a running future cannot be cancelled: an abandoned phase's result is set and dropped
            done.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 -- handed to the awaiting coroutine
            done.set_exception(e)
    threading.Thread(target=work, daemon=True, name=f"pdserve-{getattr(fn, '__name__', 'start')}").start()
    return asyncio.wrap_future(done)


async def _unless_stopped(stop: asyncio.Event, work: Awaitable[_T]) -> _T:
    """`work`'s result, unless `stop` is set first: then `work` is cancelled and `_Stopped` raised (work in a
    thread goes on until the teardown ends what it waits on)."""
    task, halt = asyncio.ensure_future(work), asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait([task, halt], return_when=asyncio.FIRST_COMPLETED)
    finally:
        halt.cancel()
    if not task.done():
        task.cancel()
        raise _Stopped
    return task.result()


async def serve(cfg: ServeConfig, ready: asyncio.Event | None = None, stop: asyncio.Event | None = None) -> None:
    """Run pdserve until `stop` is set or a SIGINT / SIGTERM arrives. Sets `ready` once serving."""
    import ray

    from engine.chat_template import use_chat_template
    from engine.model_loader import load_tokenizer
    from engine.model_store import resolve_model
    from router.calibrate import calibrate
    from router.cost_model import CostModel, load_cost_model
    from router.grpc_server import start_grpc_server
    from router.http_server import start_http_server
    from router.pools import replace_worker
    from router.service import Router

    if cfg.tls is not None:
        cfg.tls.http_context()  # a bad certificate or key is refused before anything starts
    given = load_cost_model(cfg.cost_model) if cfg.cost_model is not None else None  # refused before any worker
    model_dir = resolve_model(cfg.engine.model)
    tokenizer = load_tokenizer(model_dir)
    if cfg.engine.chat_template is not None:  # a bad one fails here, before any worker starts
        use_chat_template(tokenizer, cfg.engine.chat_template)
        cfg = replace(cfg, engine=replace(cfg.engine, chat_template=None))  # workers take token ids: the router's
    _connect(cfg)
    stop = stop or asyncio.Event()
    _stop_on_signals(stop)
    if cfg.address is None and cfg.transfer.host is None:  # a local cluster: KV moves over loopback only
        cfg = replace(cfg, transfer=replace(cfg.transfer, host="127.0.0.1"))
    pools = None
    try:
        t0 = time.perf_counter()
        pools, p_infos, d_infos, transfer, kept = await _unless_stopped(stop, _on_own_thread(_start_pools, cfg))
        up = (f"[pdserve] {len(pools.prefill)} prefill + {len(pools.decode)} decode workers up in "
              f"{time.perf_counter() - t0:.1f} s")
        if isinstance(kept, CostModel):  # adopted workers go on with theirs, whatever a restart is given
            cost = kept
            print(f"{up}; the deployment's cost model kept", file=sys.stderr, flush=True)
        elif given is not None:
            d = d_infos[0]
            cost = given.for_workers(d.kv_bytes_per_token, d.num_layers, d.prefill_chunk_tokens, bool(pools.prefill))
            print(f"{up}; the cost model of {cfg.cost_model} (no calibration)", file=sys.stderr, flush=True)
        else:
            print(f"{up}; calibrating the cost model ...", file=sys.stderr, flush=True)
            cost = await _unless_stopped(stop, calibrate(
                pools, d_infos[0], report=lambda line: print(f"[pdserve] {line}", file=sys.stderr, flush=True)))
        if pools.deployment is not None:  # a restarted router reads it back from any of them
            await asyncio.gather(*(w.keep.remote(cost) for w in pools.prefill + pools.decode))

        def respawn(pool: str, index: int) -> WorkerInfo:
            info = replace_worker(pools, pool, index, pools.engine_config, transfer, cfg.cpus_per_worker)
            if pools.deployment is not None:
                ray.get((pools.prefill if pool == "prefill" else pools.decode)[index].keep.remote(cost))
            return info

        lender = None
        if (cfg.lend_threads and not cfg.router.flip_roles and pools.prefill and cfg.engine.num_threads
                and cfg.engine.device == "cpu"):  # threads are CPU compute
            from router.elastic import ThreadLender

            print("[pdserve] measuring what a worker gains with the threads of the other role's worker beside it ...",
                  file=sys.stderr, flush=True)
            lender = await _unless_stopped(stop, _on_own_thread(
                ThreadLender.on_same_nodes, pools, cfg.engine.num_threads, cfg.router.load_poll_s))
            print(f"[pdserve] lent threads: {lender.describe()}", file=sys.stderr, flush=True)
        router = Router(pools, p_infos, d_infos, tokenizer, model_dir, cfg.router, cost, respawn=respawn,
                        lender=lender)
        await router.poll_once()
        router.start_polling()
        http, http_port = await start_http_server(router, cfg.host, cfg.http_port, api_keys=cfg.api_keys, tls=cfg.tls,
                                                  protect_metrics=cfg.protect_metrics)
        grpc_server, grpc_port = await start_grpc_server(router, cfg.host, cfg.grpc_port, api_keys=cfg.api_keys,
                                                         tls=cfg.tls)
        _announce(router, cfg, cost, http_port, grpc_port)
        if ready is not None:
            ready.set()
        await stop.wait()
        print("[pdserve] shutting down: in-flight requests are cancelled", file=sys.stderr, flush=True)
        await grpc_server.stop(grace=2.0)
        await http.cleanup()
        await router.stop_polling()
    except _Stopped:
        print("[pdserve] stopped while starting", file=sys.stderr, flush=True)
        _stuck.set()  # the abandoned phase may still be in a Ray call: Ray's exit hooks would wait on it
    finally:
        _teardown(pools, cfg.address)


_TEARDOWN_S = 30.0
_stuck = threading.Event()  # Ray work was left behind: `run` exits without waiting for Ray any longer


def _teardown(pools: object | None, address: str | None = None) -> None:
    """Stop the workers (not a deployment's: they outlive the router) and leave Ray, for at most
    `_TEARDOWN_S`. With the Ray cluster gone (its head stopped or lost), Ray's calls can block for
    minutes; the server still exits."""
    import ray

    deployment = getattr(pools, "deployment", None)
    if deployment is not None:
        print(f"[pdserve] the workers of deployment {deployment!r} keep running: `pdserve serve --address "
              f"{address} --deployment {deployment}` adopts them, `pdserve stop --address {address} --deployment "
              f"{deployment}` ends them", file=sys.stderr, flush=True)

    def work() -> None:
        if pools is not None and deployment is None:
            pools.shutdown()  # type: ignore[attr-defined]
        ray.shutdown()
    t = threading.Thread(target=work, daemon=True, name="pdserve-teardown")
    t.start()
    t.join(_TEARDOWN_S)
    if t.is_alive():
        log.warning("Ray did not shut down within %.0f s (is its cluster gone?); exiting without it", _TEARDOWN_S)
        _stuck.set()


def _announce(router: object, cfg: ServeConfig, cost: object, http_port: int, grpc_port: int) -> None:
    host = "127.0.0.1" if cfg.host in ("0.0.0.0", "::") else cfg.host
    name = router.model_name  # type: ignore[attr-defined]
    c = cost.to_dict()  # type: ignore[attr-defined]
    rt = router.runtime  # type: ignore[attr-defined]
    print(f"[pdserve] runs {rt.summary()} (dtype: {rt.dtype_reason})", file=sys.stderr)
    print(f"[pdserve] cost model: {c}", file=sys.stderr)
    auth = " -H 'Authorization: Bearer $PDSERVE_API_KEY'" if cfg.api_keys else ""
    keys = f" ({len(cfg.api_keys)} API keys required)" if cfg.api_keys else ""
    scheme, tls = ("https", " over TLS") if cfg.tls is not None else ("http", "")
    ca = f" --tls-ca {cfg.ssl_certfile}" if cfg.tls is not None else ""
    print(f"[pdserve] serving {name!r} with policy {cfg.router.policy}: HTTP {scheme}://{host}:{http_port}  "
          f"gRPC {host}:{grpc_port}{tls}{keys}\n"
          f"  curl {scheme}://{host}:{http_port}/v1/chat/completions -H 'Content-Type: application/json'{auth} "
          f"-d '{{\"model\": \"{name}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello!\"}}], "
          f"\"max_tokens\": 32}}'\n"
          f"  pdserve generate --server {host}:{grpc_port}{ca} \"Hello!\"", file=sys.stderr, flush=True)
    print(f"READY http={http_port} grpc={grpc_port}", flush=True)


def run(cfg: ServeConfig, log_level: str = "info") -> int:
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(serve(cfg))
    if _stuck.is_set():  # Ray's exit hooks would block again on the lost cluster
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


def stop_deployment(address: str, deployment: str) -> int:
    """`pdserve stop`: end the workers of `deployment` on the Ray cluster at `address`. Returns how many."""
    import ray

    from router.pools import end_deployment

    _join(address)
    try:
        return end_deployment(deployment)
    finally:
        ray.shutdown()
