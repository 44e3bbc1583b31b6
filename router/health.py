"""Worker health: the load poll, and the replacement of workers that died or hang.

Lifecycle: every `load_poll_s` every worker is asked for its `LoadReport` and its prefix-cache
events since the last poll, all at once (gauges and the placer's `PrefixIndex` refreshed from
them). Workers answer both off their engine thread, so a busy worker answers: one
that does not answer in time is marked unhealthy (no new requests go to it) and healthy again
once it answers. One that stays silent for `hang_timeout_s` (its process stopped or wedged) is
declared hung and killed, so that it dies for everyone: its requests' streams fail and move to
other workers, and it is replaced like a dead one. A dead worker is replaced when the router was
given a `respawn` function: in a daemon thread of its own (starting an actor blocks), after which
its peers drop their transfer pairs with the dead one and the placer gets the new worker's slot.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable

import ray

from router.config import RouterConfig
from router.metrics import Metrics
from router.placer import Placer
from router.pools import Pools
from worker_core.protocol import WorkerInfo

log = logging.getLogger(__name__)
_MIN_POLL_TIMEOUT_S = 5.0  # a load answer may take this long before the worker counts as unhealthy


class HealthMonitor:
    """Args: pools: the live workers; placer: where health and replacements are recorded; config;
    metrics; respawn: `respawn(pool, index)` replaces a dead worker and returns its `WorkerInfo`
    (blocking; run in a thread); None: dead workers stay out of rotation."""

    def __init__(self, pools: Pools, placer: Placer, config: RouterConfig, metrics: Metrics,
                 respawn: Callable[[str, int], WorkerInfo] | None) -> None:
        self._pools, self._placer, self._config, self._metrics = pools, placer, config, metrics
        self._respawn = respawn
        self._poller: asyncio.Task | None = None
        self.respawning: set[tuple[str, int]] = set()  # (pool, index) of replacements under way
        self._silent_since: dict[tuple[str, int], float] = {}  # (pool, index) -> first unanswered poll

    def start(self) -> None:
        """Poll every `load_poll_s` (call inside the serving loop)."""
        self._poller = asyncio.get_running_loop().create_task(self._poll_loop())

    async def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            await asyncio.gather(self._poller, return_exceptions=True)

    async def poll_once(self) -> None:
        """Ask every worker for its load at once (a silent one holds up no other); then idle workers'
        compute goes to the other role (`router.elastic`)."""
        await asyncio.gather(*(self._poll(pool, i, actor)
                               for pool, actors in (("prefill", self._pools.prefill), ("decode", self._pools.decode))
                               for i, actor in enumerate(actors) if (pool, i) not in self.respawning))
        if self._placer.elastic is not None:
            self._placer.elastic.rebalance(*self._placer.computing())
            self._metrics.elastic.set(self._placer.elastic.moved)
            self._metrics.elastic_decode.set(self._placer.elastic.moved_to_prefill)
        self._metrics.observe_split(self._placer.split())

    async def _poll(self, pool: str, index: int, actor: ray.actor.ActorHandle) -> None:
        slot = self._placer.slots(pool)[index]
        try:
            async with asyncio.timeout(max(_MIN_POLL_TIMEOUT_S, self._config.load_poll_s)):
                load, cache = await asyncio.gather(actor.load.remote(),
                                                   actor.cache_events.remote(self._placer.prefix.acked(pool, index)))
        except (TimeoutError, ray.exceptions.RayError) as e:
            if slot.healthy:
                log.warning("%s worker %s failed its health check: %r", pool, slot.worker_id, e)
                self._metrics.worker_failures.labels(pool).inc()
            self._placer.set_healthy(pool, index, False)
            if isinstance(e, ray.exceptions.RayActorError):
                self._silent_since.pop((pool, index), None)
                if self._respawn is not None:
                    self.respawning.add((pool, index))
                    asyncio.get_running_loop().create_task(self._replace(pool, index))
            elif isinstance(e, TimeoutError):
                self._check_hung(pool, index, actor, slot.worker_id)
            return
        self._silent_since.pop((pool, index), None)
        if not slot.healthy:
            log.info("%s worker %s is healthy again", pool, slot.worker_id)
        self._placer.set_healthy(pool, index, True)
        self._placer.prefix.apply(pool, index, cache)
        self._metrics.observe_worker(pool, slot.worker_id, load)
        self._metrics.prefix_index.set(self._placer.prefix.size())

    def _check_hung(self, pool: str, index: int, actor: ray.actor.ActorHandle, worker_id: str) -> None:
        """A poll went unanswered: kill the worker once it has been silent for `hang_timeout_s`."""
        now = asyncio.get_running_loop().time()
        since = self._silent_since.setdefault((pool, index), now)
        if now - since < self._config.hang_timeout_s:
            return
        log.warning("%s worker %s answered no health check for %.0f s: declared hung and killed; its requests "
                    "move to other workers", pool, worker_id, now - since)
        self._metrics.worker_hangs.labels(pool).inc()
        del self._silent_since[(pool, index)]
        ray.kill(actor, no_restart=True)  # the next poll sees it dead and replaces it

    async def _replace(self, pool: str, index: int) -> None:
        """Start a worker in place of a dead one; its fresh slot joins the book once it answers."""
        try:
            old = self._placer.slots(pool)[index].worker_id
            info = await in_daemon_thread(self._respawn, pool, index)
            for peer in self._pools.decode if pool == "prefill" else self._pools.prefill:
                peer.drop_peer.remote(old)  # their pairs with the dead worker go away; fire and forget
            await self._placer.replace_worker(pool, index, info)
            if self._placer.elastic is not None:
                self._placer.elastic.reset(pool, index)
            log.info("%s worker %d replaced by %s", pool, index, info.worker_id)
            self._metrics.worker_replacements.labels(pool).inc()
        except Exception:
            log.exception("replacing %s worker %d failed; will try again", pool, index)
        finally:
            self.respawning.discard((pool, index))

    async def _poll_loop(self) -> None:
        while True:
            await self.poll_once()
            await asyncio.sleep(self._config.load_poll_s)


async def in_daemon_thread(fn: Callable, *args: object) -> object:
    """`fn(*args)` in a daemon thread of its own. Unlike the loop's executor, a call stuck on a Ray
    cluster that went away (a respawn waiting for its actor) does not hold up the process's exit."""
    done: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        if not done.set_running_or_notify_cancel():  # running: a cancel from the awaiting side no longer lands
            return
        try:
            done.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting task
            done.set_exception(e)
    threading.Thread(target=run, daemon=True, name=f"pdserve-{getattr(fn, '__name__', 'call')}").start()
    return await asyncio.wrap_future(done)
