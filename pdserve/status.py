"""`pdserve status`: pdserve's workers on a Ray cluster, where they run, and whether they answer.

1. Connect to the cluster (`auto`, HOST:PORT or ray://HOST:PORT), unless this process already is.
2. List the worker actors by class (Ray's state API; without a dashboard, the GCS actor table).
3. Ask every live worker for its `load()` at once; one that does not answer within the timeout
   is unhealthy. Workers are found by name in the `pdserve` namespace (`router.pools` names each
   actor after its worker id); an unnamed actor cannot be reached from another driver, so its load
   and health stay unknown.
4. Read each node's pool, CPU and GPU resources (total and available).
5. With a router's address (`--router`), read its role split (`GET /pdserve/split`, `router.split`):
   how many prefill workers hold the prefill role, and whether an operator pinned it (`router_split`).
Dead workers are listed when their server still runs (it may be replacing them); `include_dead`
lists those of stopped servers too.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import time

from worker_core.protocol import LoadReport

# Plain strings, so that `pdserve status` starts without importing torch; test_cluster_deploy.py checks
# that they match `PrefillWorker.__name__`, `DecodeWorker.__name__` and `router.pools`.
POOL_OF_CLASS = {"PrefillWorker": "prefill", "DecodeWorker": "decode"}
NAMESPACE = "pdserve"
RESOURCES = ("prefill_pool", "decode_pool", "CPU", "GPU")


def cluster_status(address: str | None, timeout_s: float = 5.0, include_dead: bool = False) -> dict:
    """A snapshot of pdserve on the Ray cluster at `address`.

    Args:
        address: "auto", "HOST:PORT" (GCS) or "ray://HOST:PORT"; None: $RAY_ADDRESS, else "auto".
            Ignored when this process is already connected to Ray.
        timeout_s: how long every worker gets to answer `load()`.
        include_dead: also list dead workers of servers that no longer run.
    Returns:
        {"address", "workers": [{pool, worker_id, actor_id, name, namespace, state, node_id, node_ip, pid, job_id,
        healthy (True / False / None: unknown), load (`LoadReport` or None), runs (dtype, attention kernel,
        compiled or eager; or None), error}], "nodes": [{node_id,
        node_ip, alive, is_head, resources: {name: {"total", "available"}}}], "pools": {pool: {"alive",
        "healthy"}}, "healthy": bool}; `healthy` is True when every live worker answered and at
        least one decode worker is up.
    Raises:
        ConnectionError: no Ray cluster at `address`.
    """
    import ray

    connected_here = not ray.is_initialized()
    if connected_here:
        target = address or os.environ.get("RAY_ADDRESS") or "auto"
        _check_reachable(target)
        ray.init(address=target, log_to_driver=False, logging_level=logging.WARNING, configure_logging=False)
    try:
        nodes = _nodes()
        ip_of = {n["node_id"]: n["node_ip"] for n in nodes}
        workers = _visible(_actors(), include_dead)
        for w in workers:
            w["node_ip"] = ip_of.get(w["node_id"])
        _probe_loads(workers, timeout_s)
        pools = {pool: {"alive": sum(w["state"] == "ALIVE" for w in workers if w["pool"] == pool),
                        "healthy": sum(w["healthy"] is True for w in workers if w["pool"] == pool)}
                 for pool in POOL_OF_CLASS.values()}
        live = [w for w in workers if w["state"] == "ALIVE"]
        healthy = bool(live) and pools["decode"]["alive"] > 0 and all(w["healthy"] is True for w in live)
        return {"address": _gcs_address(address), "workers": workers, "nodes": nodes, "pools": pools,
                "healthy": healthy}
    finally:
        if connected_here:
            ray.shutdown()


def format_status(status: dict) -> str:
    """`cluster_status`'s snapshot as text: one table of workers, one of nodes, a verdict line."""
    rows = [("POOL", "WORKER", "STATE", "NODE", "NODE IP", "HEALTH", "RUNS", "LOAD")]
    for w in sorted(status["workers"], key=lambda w: (w["pool"], w["worker_id"] or w["actor_id"])):
        health = {True: "ok", False: "NO ANSWER", None: "unknown"}[w["healthy"]]
        if w["healthy"] is None and w["state"] == "ALIVE" and w["error"]:
            health = "unknown*"
        rows.append((w["pool"], w["worker_id"] or w["actor_id"][:12], w["state"], (w["node_id"] or "-")[:12],
                     w["node_ip"] or "-", health, w.get("runs") or "-", _load_text(w["pool"], w["load"])))
    lines = [f"Ray cluster {status['address']}", "", *_table(rows)]
    notes = sorted({w["error"] for w in status["workers"] if w["error"] and w["state"] == "ALIVE"})
    lines += [f"  * {n}" for n in notes]
    rows = [("NODE", "IP", "ALIVE", "HEAD", *(f"{r} (free/total)" for r in RESOURCES))]
    for n in sorted(status["nodes"], key=lambda n: (not n["is_head"], n["node_ip"], n["node_id"])):
        rows.append((n["node_id"][:12], n["node_ip"], "yes" if n["alive"] else "no", "yes" if n["is_head"] else "",
                     *(_res_text(n["resources"].get(r)) for r in RESOURCES)))
    lines += ["", *_table(rows), ""]
    if "router" in status:
        r = status["router"]
        lines.append(f"router {r['url']}: role split: {r['text']}")
    p = status["pools"]
    verdict = "healthy" if status["healthy"] else "UNHEALTHY"
    lines.append(f"pdserve: {verdict}: prefill {p['prefill']['healthy']}/{p['prefill']['alive']} and decode "
                 f"{p['decode']['healthy']}/{p['decode']['alive']} live workers answering")
    if not status["workers"]:
        lines.append("no pdserve workers on this cluster: is `pdserve serve --address ...` running against it?")
    return "\n".join(lines)


def router_split(url: str, api_key: str | None) -> dict:
    """The role split of the router at `url`: {"url", "split" (`RoleSplit.to_json`, or None when it could not
    be read), "text" (its description, or why it could not be read)}."""
    from planner.watch import read_split

    try:
        split = read_split(url, api_key)
    except ValueError as e:
        return {"url": url, "split": None, "text": f"unknown ({e})"}
    return {"url": url, "split": split.to_json(), "text": split.describe()}


# -- gathering -------------------------------------------------------------------------------------
def _check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Fail fast on a HOST:PORT nobody listens on (Ray itself retries for minutes)."""
    if address == "auto":
        return
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit():
        raise ConnectionError(f"address must be auto, HOST:PORT or ray://HOST:PORT, got {address!r}")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise ConnectionError(f"no Ray cluster at {address}: {e}") from None


def _gcs_address(address: str | None) -> str:
    import ray

    try:
        return ray.get_runtime_context().gcs_address
    except Exception:  # noqa: BLE001  Ray Client: the driver runs on the head; show what we were given
        return address or "auto"


def _actors() -> list[dict]:
    """Every PrefillWorker / DecodeWorker actor the cluster knows, live or dead."""
    try:
        from ray.util.state import list_actors

        found = []
        for cls in POOL_OF_CLASS:
            found += list_actors(address=_gcs_address(None), filters=[("class_name", "=", cls)], detail=True,
                                 limit=10_000, timeout=10, raise_on_missing_output=False)
        return [_worker(a.class_name, a.actor_id, a.name, a.ray_namespace, a.state, a.node_id, a.pid, a.job_id)
                for a in found]
    except Exception:  # noqa: BLE001  no dashboard (`--include-dashboard=false`): read the GCS table
        import ray._private.state as gcs

        return [_worker(a["ActorClassName"], a["ActorID"], a["Name"], None, a["State"], a["Address"]["NodeID"],
                        a["Pid"], a["JobID"])
                for a in gcs.actors().values() if a["ActorClassName"] in POOL_OF_CLASS]


def _worker(cls: str, actor_id: str, name: str | None, namespace: str | None, state: str, node_id: str | None,
            pid: int | None, job_id: str | None) -> dict:
    return {"pool": POOL_OF_CLASS[cls], "worker_id": name or None, "actor_id": actor_id, "name": name or None,
            "namespace": namespace or NAMESPACE, "state": state, "node_id": node_id or None, "node_ip": None,
            "pid": pid or None, "job_id": job_id, "healthy": None, "load": None, "runs": None, "error": None}


def _visible(workers: list[dict], include_dead: bool) -> list[dict]:
    """Live workers, plus the dead ones of servers (Ray jobs) that still have live workers."""
    if include_dead:
        return workers
    running = {w["job_id"] for w in workers if w["state"] != "DEAD"}
    return [w for w in workers if w["state"] != "DEAD" or w["job_id"] in running]


def _probe_loads(workers: list[dict], timeout_s: float) -> None:
    """Fill each live worker's `load`, `healthy` and `error` from one `load()` call, all at once; then
    `runs` (dtype, attention kernel, compiled or eager) from `info()` of those that answered."""
    import ray

    from router.types import Runtime

    handles = {}
    for i, w in enumerate(workers):
        if w["state"] != "ALIVE":
            continue
        if not w["name"]:
            w["error"] = "actor is unnamed: load and health need the workers named in namespace 'pdserve'"
            continue
        try:
            handles[i] = ray.get_actor(w["name"], namespace=w["namespace"])
        except ValueError as e:  # gone between listing and lookup
            w["healthy"], w["error"] = False, f"not found: {e}"
    for i, load, error in _call_all(handles, "load", timeout_s):
        w = workers[i]
        w["healthy"], w["load"], w["error"] = error is None, load, error
    answered = {i: h for i, h in handles.items() if workers[i]["healthy"]}
    for i, info, _ in _call_all(answered, "info", timeout_s):
        if info is not None:
            workers[i]["runs"] = Runtime.from_info(info).summary()


def _call_all(handles: dict, method: str, timeout_s: float) -> list[tuple[object, object, str | None]]:
    """`method()` on every handle at once, for at most `timeout_s`: (key, result or None, error or None)."""
    import ray

    pending = {getattr(h, method).remote(): key for key, h in handles.items()}
    out = []
    deadline = time.monotonic() + timeout_s
    refs = list(pending)
    while refs and time.monotonic() < deadline:
        done, refs = ray.wait(refs, num_returns=len(refs), timeout=max(0.0, deadline - time.monotonic()))
        for ref in done:
            try:
                out.append((pending[ref], ray.get(ref), None))
            except Exception as e:  # noqa: BLE001  the call failed on the actor, or the actor died
                out.append((pending[ref], None, f"{method}() failed: {type(e).__name__}"))
    out += [(pending[ref], None, f"{method}() did not answer within {timeout_s:g} s") for ref in refs]
    return out


def _nodes() -> list[dict]:
    import ray

    try:
        import ray._private.state as gcs

        available = gcs.available_resources_per_node()
    except Exception:  # noqa: BLE001  Ray Client: totals only
        available = {}
    out = []
    for n in ray.nodes():
        total, free = n.get("Resources", {}), available.get(n["NodeID"], {})
        res = {r: {"total": total[r], "available": free.get(r, 0.0) if n["NodeID"] in available else None}
               for r in RESOURCES if r in total}
        out.append({"node_id": n["NodeID"], "node_ip": n["NodeManagerAddress"], "alive": bool(n["Alive"]),
                    "is_head": "node:__internal_head__" in total, "resources": res})
    return out


# -- text ------------------------------------------------------------------------------------------
def status_json(status: dict, indent: int | None = 2) -> str:
    """`cluster_status` as JSON (load reports as objects of their fields)."""
    return json.dumps(status, indent=indent,
                      default=lambda o: dataclasses.asdict(o) if isinstance(o, LoadReport) else str(o))


def _load_text(pool: str, load: LoadReport | None) -> str:
    if load is None:
        return "-"
    kv = f"kv {load.num_blocks - load.free_blocks}/{load.num_blocks} blocks"
    if pool == "decode":
        return f"{kv}, {load.running} running, {load.receiving} receiving"
    return f"{kv}, {load.queued_tokens} queued tokens, {load.sending} sending"


def _res_text(r: dict | None) -> str:
    if r is None:
        return "-"
    free = "?" if r["available"] is None else f"{r['available']:g}"
    return f"{free}/{r['total']:g}"


def _table(rows: list[tuple]) -> list[str]:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
