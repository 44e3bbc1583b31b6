"""The worker pools on Ray: prefill and decode actors placed by custom resources.

Each prefill actor asks for one unit of the `prefill_pool` resource, each decode actor one of
`decode_pool` (plus a GPU when its engine runs on CUDA), so a cluster maps pools to node groups
by the resources its nodes advertise (`ray start --resources='{"decode_pool": 4}'`).
"""
from __future__ import annotations

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


@dataclass
class Pools:
    """Live worker handles and their transfer addresses, index-aligned."""

    prefill: list[ray.actor.ActorHandle] = field(default_factory=list)
    decode: list[ray.actor.ActorHandle] = field(default_factory=list)
    prefill_peers: list[PeerInfo] = field(default_factory=list)
    decode_peers: list[PeerInfo] = field(default_factory=list)
    engine_config: EngineConfig = field(default_factory=EngineConfig)  # what the workers run (dtype settled)

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


def _launch(cls: type, resource: str, name: str, engine_config: EngineConfig, transfer_config: TransferConfig,
            num_cpus: float) -> tuple[ray.actor.ActorHandle, ray.ObjectRef]:
    """Start an actor; returns it and the ref of its transfer address (ready once it has started)."""
    gpus = 1 if engine_config.device.startswith("cuda") else 0
    worker_id = f"{name}-{uuid.uuid4().hex[:6]}"
    actor = ray.remote(cls).options(name=worker_id, namespace=NAMESPACE, resources={resource: 1}, num_cpus=num_cpus,
                                    num_gpus=gpus, max_concurrency=_MAX_CONCURRENCY).remote(
        engine_config, transfer_config, worker_id)
    return actor, actor.peer_info.remote()


def _start(cls: type, resource: str, name: str, engine_config: EngineConfig, transfer_config: TransferConfig,
           num_cpus: float) -> tuple[ray.actor.ActorHandle, PeerInfo]:
    actor, peer = _launch(cls, resource, name, engine_config, transfer_config, num_cpus)
    return actor, ray.get(peer)


_KINDS = {"prefill": (PrefillWorker, PREFILL_RESOURCE), "decode": (DecodeWorker, DECODE_RESOURCE)}


def _lists(pools: Pools, pool: str) -> tuple[list, list]:
    """(actors, peers) of `pool`, "prefill" or "decode"."""
    return (pools.prefill, pools.prefill_peers) if pool == "prefill" else (pools.decode, pools.decode_peers)


def add_worker(pools: Pools, pool: str, engine_config: EngineConfig, transfer_config: TransferConfig,
               num_cpus: float = 1) -> ray.actor.ActorHandle:
    """Start one more actor in `pool` ("prefill" | "decode") and return it. A decode worker serves as
    soon as its transfer address is known; a prefill worker pairs with decode workers lazily."""
    actors, peers = _lists(pools, pool)
    actor, peer = _start(*_KINDS[pool], f"{pool}-{len(actors)}", engine_config, transfer_config, num_cpus)
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
    actor, peer = _start(*_KINDS[pool], f"{pool}-{index}", engine_config, transfer_config, num_cpus)
    actors[index], peers[index] = actor, peer
    return ray.get(actor.info.remote())


def create_pools(num_prefill: int, num_decode: int, engine_config: EngineConfig,
                 transfer_config: TransferConfig, num_cpus: float = 1,
                 on_started: Callable[[], None] | None = None) -> Pools:
    """Start `num_prefill` prefill and `num_decode` decode actors on the connected Ray cluster
    (`on_started()` as each is up), all at once (a worker's start is mostly compiling, on its own
    cores). With `dtype="auto"` the first (a prefill worker where there are any) starts alone and
    settles it: the rest, and replacements started with `pools.engine_config`, run the dtype it chose,
    so that KV moves between any two of them."""
    pools = Pools(engine_config=engine_config)
    kinds = ["prefill"] * num_prefill + ["decode"] * num_decode
    if kinds and engine_config.dtype == AUTO:
        actor = add_worker(pools, kinds.pop(0), engine_config, transfer_config, num_cpus)
        pools.engine_config = replace(engine_config, dtype=ray.get(actor.info.remote()).dtype)
        if on_started is not None:
            on_started()
    counts = {"prefill": len(pools.prefill), "decode": len(pools.decode)}
    launched = []
    for pool in kinds:
        launched.append((pool, *_launch(*_KINDS[pool], f"{pool}-{counts[pool]}", pools.engine_config,
                                        transfer_config, num_cpus)))
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
