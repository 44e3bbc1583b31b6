"""The worker pools on Ray: prefill and decode actors placed by custom resources.

Each prefill actor asks for one unit of the `prefill_pool` resource, each decode actor one of
`decode_pool` (plus a GPU when its engine runs on CUDA), so a cluster maps pools to node groups
by the resources its nodes advertise (`ray start --resources='{"decode_pool": 4}'`).

Pools of a named deployment (`deployment=NAME`) are detached actors named `NAME.prefill-0`,
`NAME.decode-1`, ... (slot names: a replacement takes its slot's name): they outlive the router
that started them, and a router started again with the same name adopts them (`adopt_pools`)
instead of starting new ones. `end_deployment` stops them for good.

A prefill worker runs prompt passes only, unless the router flips roles (`prefill_decodes`): then it
serves decode too. Only then does it compile a decode step (`role_config`); otherwise its start is
its model load, and it takes no compile time from the decode workers starting beside it.
"""
from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import ray

from decode_worker import DecodeWorker
from engine import EngineConfig
from engine.hardware import AUTO
from kv_transfer import PeerInfo, TransferConfig
from prefill_worker import PrefillWorker
from worker_core.protocol import WorkerInfo

PREFILL_RESOURCE = "prefill_pool"
DECODE_RESOURCE = "decode_pool"
NAMESPACE = "pdserve"  # every worker actor is named after its worker id in this Ray namespace (`pdserve status`)
_MAX_CONCURRENCY = 256  # actor threads: one per in-flight call (streams block in theirs)
_SCAN_PAST_GAP = 64  # slots looked at past the first free one when a deployment is adopted
log = logging.getLogger(__name__)


@dataclass
class Pools:
    """Live worker handles and their transfer addresses, index-aligned."""

    prefill: list[ray.actor.ActorHandle] = field(default_factory=list)
    decode: list[ray.actor.ActorHandle] = field(default_factory=list)
    prefill_peers: list[PeerInfo] = field(default_factory=list)
    decode_peers: list[PeerInfo] = field(default_factory=list)
    engine_config: EngineConfig = field(default_factory=EngineConfig)  # what the workers run (dtype settled)
    deployment: str | None = None  # its workers are detached, named after it (None: they die with the router)
    prefill_decodes: bool = False  # prefill workers serve decode too (role flips): they compile decode steps

    def decoder(self, index: int) -> ray.actor.ActorHandle:
        """The actor at a placement's decode index: decode workers first, then prefill workers (their
        flex slots, `router.book`)."""
        return self.decode[index] if index < len(self.decode) else self.prefill[index - len(self.decode)]

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop every worker: a graceful stop for up to `timeout_s`, then the actors are killed."""
        refs = [w.shutdown.remote() for w in self.prefill + self.decode]
        ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        for w in self.prefill + self.decode:
            ray.kill(w)
        self.prefill, self.decode, self.prefill_peers, self.decode_peers = [], [], [], []


def slot_name(deployment: str, slot: str) -> str:
    """The actor name of a deployment's worker slot (`slot`: "prefill-0", "decode-1", ...)."""
    return f"{deployment}.{slot}"


def role_config(pool: str, engine_config: EngineConfig, prefill_decodes: bool) -> EngineConfig:
    """What a worker of `pool` runs: `engine_config`, except that a prefill worker that never runs
    decode steps (`prefill_decodes` False) does not compile one."""
    if pool == "prefill" and engine_config.compile and not prefill_decodes:
        return replace(engine_config, compile=False)
    return engine_config


def _launch(cls: type, resource: str, name: str, engine_config: EngineConfig, transfer_config: TransferConfig,
            num_cpus: float, deployment: str | None = None) -> tuple[ray.actor.ActorHandle, ray.ObjectRef]:
    """Start an actor for slot `name` ("decode-1"); returns it and the ref of its transfer address
    (ready once it has started). In a deployment it is detached and named after its slot."""
    gpus = 1 if engine_config.device.startswith("cuda") else 0
    worker_id = f"{name}-{uuid.uuid4().hex[:6]}"
    named = {"name": worker_id} if deployment is None else {"name": slot_name(deployment, name), "lifetime": "detached"}
    actor = ray.remote(cls).options(**named, namespace=NAMESPACE, resources={resource: 1}, num_cpus=num_cpus,
                                    num_gpus=gpus, max_concurrency=_MAX_CONCURRENCY).remote(
        engine_config, transfer_config, worker_id)
    return actor, actor.peer_info.remote()


def _start(cls: type, resource: str, name: str, engine_config: EngineConfig, transfer_config: TransferConfig,
           num_cpus: float, deployment: str | None = None) -> tuple[ray.actor.ActorHandle, PeerInfo]:
    actor, peer = _launch(cls, resource, name, engine_config, transfer_config, num_cpus, deployment)
    return actor, ray.get(peer)


def _named(deployment: str, slot: str) -> ray.actor.ActorHandle | None:
    try:
        return ray.get_actor(slot_name(deployment, slot), namespace=NAMESPACE)
    except ValueError:  # no such actor
        return None


def _free_name(deployment: str, slot: str, timeout_s: float = 30.0) -> None:
    """Wait until a killed slot's name is free again (Ray releases it once the actor is gone)."""
    end = time.monotonic() + timeout_s
    while _named(deployment, slot) is not None:
        if time.monotonic() > end:
            raise RuntimeError(f"worker slot {slot_name(deployment, slot)} is still taken {timeout_s:.0f} s after "
                               "its worker was killed")
        time.sleep(0.1)


_KINDS = {"prefill": (PrefillWorker, PREFILL_RESOURCE), "decode": (DecodeWorker, DECODE_RESOURCE)}


def _lists(pools: Pools, pool: str) -> tuple[list, list]:
    """(actors, peers) of `pool`, "prefill" or "decode"."""
    return (pools.prefill, pools.prefill_peers) if pool == "prefill" else (pools.decode, pools.decode_peers)


def add_worker(pools: Pools, pool: str, engine_config: EngineConfig, transfer_config: TransferConfig,
               num_cpus: float = 1) -> ray.actor.ActorHandle:
    """Start one more actor in `pool` ("prefill" | "decode") and return it. A decode worker serves as
    soon as its transfer address is known; a prefill worker pairs with decode workers lazily."""
    actors, peers = _lists(pools, pool)
    if pools.deployment is not None:  # a stray of an earlier router may be going away under that name
        _free_name(pools.deployment, f"{pool}-{len(actors)}")
    actor, peer = _start(*_KINDS[pool], f"{pool}-{len(actors)}",
                         role_config(pool, engine_config, pools.prefill_decodes), transfer_config, num_cpus,
                         pools.deployment)
    actors.append(actor)
    peers.append(peer)
    return actor


def replace_worker(pools: Pools, pool: str, index: int, engine_config: EngineConfig,
                   transfer_config: TransferConfig, num_cpus: float = 1) -> WorkerInfo:
    """Start a fresh actor in place of worker `index` of `pool` ("prefill" | "decode"), which died or
    hangs (it is killed first). The new worker has a new id, so no transfer pair of the old one is
    reused. Returns the new worker's `info()`."""
    actors, peers = _lists(pools, pool)
    try:
        ray.kill(actors[index], no_restart=True)
    except Exception:  # noqa: S110 - already gone
        pass
    if pools.deployment is not None:
        _free_name(pools.deployment, f"{pool}-{index}")
    actor, peer = _start(*_KINDS[pool], f"{pool}-{index}",
                         role_config(pool, engine_config, pools.prefill_decodes), transfer_config, num_cpus,
                         pools.deployment)
    actors[index], peers[index] = actor, peer
    return ray.get(actor.info.remote())


def create_pools(num_prefill: int, num_decode: int, engine_config: EngineConfig,
                 transfer_config: TransferConfig, num_cpus: float = 1,
                 on_started: Callable[[], None] | None = None, deployment: str | None = None,
                 prefill_decodes: bool = False) -> Pools:
    """Start `num_prefill` prefill and `num_decode` decode actors on the connected Ray cluster
    (`on_started()` as each is up), all at once (a worker's start is mostly compiling, on its own
    cores). With `dtype="auto"` the first (a prefill worker where there are any) starts alone and
    settles it: the rest, and replacements started with `pools.engine_config`, run the dtype it chose,
    so that KV moves between any two of them. `deployment`: the workers are that deployment's
    (detached, named after their slots). `prefill_decodes`: the prefill workers serve decode too (role
    flips), so they compile decode steps as well (`role_config`)."""
    pools = Pools(engine_config=engine_config, deployment=deployment, prefill_decodes=prefill_decodes)
    kinds = ["prefill"] * num_prefill + ["decode"] * num_decode
    if kinds and engine_config.dtype == AUTO:
        actor = add_worker(pools, kinds.pop(0), engine_config, transfer_config, num_cpus)
        pools.engine_config = replace(engine_config, dtype=ray.get(actor.info.remote()).dtype)
        if on_started is not None:
            on_started()
    counts = {"prefill": len(pools.prefill), "decode": len(pools.decode)}
    launched = []
    for pool in kinds:
        launched.append((pool, *_launch(*_KINDS[pool], f"{pool}-{counts[pool]}",
                                        role_config(pool, pools.engine_config, prefill_decodes),
                                        transfer_config, num_cpus, deployment)))
        counts[pool] += 1
    waiting = [peer for _, _, peer in launched]
    while waiting:
        ready, waiting = ray.wait(waiting, num_returns=1)
        ray.get(ready)  # a worker that failed to start raises here
        if on_started is not None:
            on_started()
    for pool, actor, peer in launched:
        actors, peers = _lists(pools, pool)
        actors.append(actor)
        peers.append(ray.get(peer))
    return pools


@dataclass(frozen=True)
class Adopted:
    """A deployment's running workers, as a restarted router finds them."""

    pools: Pools
    transfer_config: TransferConfig  # what they move KV with (their secret): replacements need the same
    kept: object | None  # what the last router left with them (its cost model), or None
    aborted: int  # requests of the last router that they dropped


def adopt_pools(deployment: str) -> Adopted | None:
    """The live workers of `deployment` on the connected cluster (None: it has none). Each drops the
    requests it held for the router that started them (their blocks return; that router's clients are
    gone with it) and computes with its own threads again."""
    found: dict[str, list[ray.actor.ActorHandle]] = {"prefill": [], "decode": []}
    for pool, actors in found.items():
        while (actor := _named(deployment, f"{pool}-{len(actors)}")) is not None:
            actors.append(actor)
        for slot in range(len(actors) + 1, len(actors) + _SCAN_PAST_GAP):  # past a lost slot: cannot keep its place
            if (stray := _named(deployment, f"{pool}-{slot}")) is not None:
                log.warning("worker %s is past a lost slot of its pool; it is stopped",
                            slot_name(deployment, f"{pool}-{slot}"))
                ray.kill(stray, no_restart=True)
    workers = found["prefill"] + found["decode"]
    if not workers:
        return None
    # a decode worker's config: a prefill worker's may leave compiling out (`role_config`)
    engine_config, transfer_config = ray.get((found["decode"] or workers)[0].configs.remote())
    aborted = sum(ray.get([w.abort_all.remote() for w in workers]))
    ray.get([w.set_threads.remote(engine_config.num_threads or 1) for w in workers])
    kept = next((k for k in ray.get([w.kept.remote() for w in workers]) if k is not None), None)
    pools = Pools(found["prefill"], found["decode"], ray.get([w.peer_info.remote() for w in found["prefill"]]),
                  ray.get([w.peer_info.remote() for w in found["decode"]]), engine_config, deployment)
    return Adopted(pools, transfer_config, kept, aborted)


def end_deployment(deployment: str) -> int:
    """Stop and kill every worker of `deployment` on the connected cluster. Returns how many there were."""
    adopted = adopt_pools(deployment)
    if adopted is None:
        return 0
    n = len(adopted.pools.prefill) + len(adopted.pools.decode)
    adopted.pools.shutdown()
    return n
