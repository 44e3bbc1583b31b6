"""pdserve joining an existing multi-node Ray cluster, started the way infra/k8s deploys it.

Three `ray start` nodes on this machine take their flags from the RayCluster manifest
(infra/k8s/base/raycluster.yaml): a head with no CPUs, a prefill node advertising `prefill_pool`, a
decode node advertising `decode_pool` (CPUs cut to one each: this machine has two cores). A real
`pdserve serve` runs with the manifest's serve config (infra/k8s/base/serve.yaml; the model, ports
and sizes given on the command line win) and `--address` of the head, as the router Deployment does.
A request crosses both nodes and equals transformers' greedy output; `pdserve.status` finds each
worker on its node, answering, and finds none once the server stopped.

Each node runs `ray start --block` in a process group of its own (tests/integration/ray_nodes.py).
"""
from __future__ import annotations

import json
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import pytest
import yaml

from pdserve.status import NAMESPACE, POOL_OF_CLASS, RESOURCES, _check_reachable, format_status, status_json
from tests.conftest import greedy_reference, random_prompt, tiny_model
from tests.integration.ray_nodes import ENV, free_port, start_node, stop_group
from worker_core.protocol import LoadReport, StepTotals

ROOT = Path(__file__).parents[2]
BASE = ROOT / "infra" / "k8s" / "base"


def ray_flags(params: dict[str, str], **overrides: str) -> list[str]:
    """`ray start` flags from a KubeRay rayStartParams map (values as KubeRay pastes them into a shell)."""
    merged = {**params, **overrides}
    return [f"--{k}={shlex.split(v)[0]}" for k, v in merged.items()]


@pytest.fixture(scope="module")
def cluster():
    """(GCS address, {role: node process}, Ray Client port) of a head, a prefill node and a decode node."""
    rc = yaml.safe_load((BASE / "raycluster.yaml").read_text())["spec"]
    groups = {g["groupName"]: g["rayStartParams"] for g in rc["workerGroupSpecs"]}
    tmp = Path(tempfile.mkdtemp(prefix="pdd-", dir="/tmp"))  # short: Ray's socket paths must fit 107 bytes
    port, client_port = free_port(), free_port()
    nodes: dict[str, subprocess.Popen] = {}
    try:
        nodes["head"] = start_node(
            ["--head", f"--port={port}", f"--temp-dir={tmp / 'ray'}", f"--ray-client-server-port={client_port}",
             f"--dashboard-port={free_port()}", "--include-dashboard=true",
             *ray_flags(rc["headGroupSpec"]["rayStartParams"], **{"metrics-export-port": str(free_port()),
                                                                 "dashboard-host": "127.0.0.1"})],
            tmp / "head.log")
        for role in ("prefill", "decode"):
            nodes[role] = start_node([f"--address=127.0.0.1:{port}",
                                      *ray_flags(groups[role], **{"num-cpus": "1"})], tmp / f"{role}.log")
        yield f"127.0.0.1:{port}", nodes, client_port
    finally:
        for proc in reversed(list(nodes.values())):
            stop_group(proc)
        shutil.rmtree(tmp, ignore_errors=True)


def start_serve(address: str, model_dir: Path, log: list[str]) -> tuple[subprocess.Popen, int, int]:
    cmd = [sys.executable, "-m", "pdserve", "serve", "--config", str(BASE / "serve.yaml"), "--address", address,
           "--model", str(model_dir), "--dtype", "float32", "--no-compile", "--kv-memory-gib", "0.02",
           "--cpus-per-worker", "1",
           "--policy", "always_remote", "--host", "127.0.0.1", "--http-port", "0", "--grpc-port", "0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV, cwd=ROOT,
                            start_new_session=True)
    ready: list[str] = []

    def pump() -> None:
        for line in proc.stdout:
            log.append(line)
            if line.startswith("READY "):
                ready.append(line)
    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + 240
    while not ready:
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_group(proc)
            raise RuntimeError("pdserve serve did not start:\n" + "".join(log[-60:]))
        time.sleep(0.3)
    fields = dict(kv.split("=") for kv in ready[0].split()[1:])
    return proc, int(fields["http"]), int(fields["grpc"])


def sigterm(proc: subprocess.Popen) -> int | None:
    """Stop a server as an operator does; its exit status (None: it had to be killed)."""
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(60)
    except subprocess.TimeoutExpired:
        stop_group(proc)
        return None


def status_of(address: str) -> tuple[dict, str]:
    """`cluster_status` and `format_status` from a fresh process (a Ray driver connects once per process)."""
    code = ("import sys; from pdserve.status import cluster_status, format_status, status_json; "
            "s = cluster_status(sys.argv[1]); print(format_status(s)); print(status_json(s, indent=None))")
    res = subprocess.run([sys.executable, "-c", code, address], check=False, capture_output=True, text=True,
                         timeout=120, env=ENV, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    *text, last = res.stdout.strip().splitlines()
    return json.loads(last), "\n".join(text)


def generate_ids(grpc_port: int, prompt: list[int], max_tokens: int) -> tuple[list[int], object]:
    from protos.pdserve.v1 import pdserve_pb2, pdserve_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        stub = pdserve_pb2_grpc.GenerationServiceStub(channel)
        request = pdserve_pb2.GenerateRequest(token_ids=pdserve_pb2.TokenIds(ids=prompt),
                                              sampling=pdserve_pb2.SamplingParams(max_tokens=max_tokens))
        out = list(stub.Generate(request, timeout=120))
    return [t for r in out for t in r.token_ids], out[-1].timings


@pytest.mark.slow
def test_serve_on_an_existing_cluster_places_pools_by_node_resources(cluster, tmp_path):
    address, _, _ = cluster
    ref = tiny_model("llama", seed=4)
    ref.save_pretrained(tmp_path)  # no tokenizer: token-id prompts over gRPC
    log: list[str] = []
    proc, _, grpc_port = start_serve(address, tmp_path, log)
    try:
        prompt = random_prompt(70, 8)
        ids, timings = generate_ids(grpc_port, prompt, 16)
        assert ids == greedy_reference(ref, prompt, 16)
        assert timings.path == "remote"

        status, text = status_of(address)
        nodes = {("prefill" if "prefill_pool" in n["resources"] else "decode" if "decode_pool" in n["resources"]
                  else "head"): n for n in status["nodes"] if n["alive"]}
        assert set(nodes) == {"head", "prefill", "decode"} and nodes["head"]["is_head"]
        assert "CPU" not in nodes["head"]["resources"] or nodes["head"]["resources"]["CPU"]["total"] == 0
        live = {w["pool"]: w for w in status["workers"] if w["state"] == "ALIVE"}
        assert sorted(w["pool"] for w in status["workers"] if w["state"] == "ALIVE") == ["decode", "prefill"]
        for pool in ("prefill", "decode"):
            w = live[pool]
            assert w["node_id"] == nodes[pool]["node_id"], f"the {pool} worker is not on the {pool} node"
            assert w["healthy"] is True and w["load"]["num_blocks"] > 0, w
            assert nodes[pool]["resources"][f"{pool}_pool"] == {"total": 1.0, "available": 0.0}
        assert (live["prefill"]["worker_id"], live["decode"]["worker_id"]) == (timings.prefill_worker,
                                                                               timings.decode_worker)
        assert status["healthy"] and status["pools"] == {"prefill": {"alive": 1, "healthy": 1},
                                                         "decode": {"alive": 1, "healthy": 1}}
        assert timings.prefill_worker in text and timings.decode_worker in text
        assert "pdserve: healthy" in text
    finally:
        code = sigterm(proc)
    assert code == 0, "".join(log[-40:])

    deadline = time.monotonic() + 30
    while True:  # the server's workers left with it, and gave their nodes' resources back
        status, text = status_of(address)
        held = [(n["node_id"][:8], k, r) for n in status["nodes"] for k, r in n["resources"].items()
                if r["available"] != r["total"]]
        if not held or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert not [w for w in status["workers"] if w["state"] != "DEAD"]
    assert not status["healthy"] and "no pdserve workers" in text
    assert not held, f"resources still held after the server stopped: {held}"


# -- without a cluster ------------------------------------------------------------------------------
def test_status_names_match_the_workers_and_pools():
    from decode_worker import DecodeWorker
    from prefill_worker import PrefillWorker
    from router import pools

    assert POOL_OF_CLASS == {PrefillWorker.__name__: "prefill", DecodeWorker.__name__: "decode"}
    assert {pools.PREFILL_RESOURCE, pools.DECODE_RESOURCE} <= set(RESOURCES)
    assert getattr(pools, "NAMESPACE", NAMESPACE) == NAMESPACE


def test_format_status_flags_silent_and_dead_workers():
    def worker(pool, wid, state, healthy, load=None, error=None):
        return {"pool": pool, "worker_id": wid, "actor_id": "ab" * 16, "name": wid, "namespace": NAMESPACE,
                "state": state, "node_id": "n1" * 28, "node_ip": "10.0.0.7", "pid": 1, "job_id": "01000000",
                "healthy": healthy, "load": load, "error": error}

    status = {"address": "10.0.0.1:6379", "healthy": False,
              "pools": {"prefill": {"alive": 1, "healthy": 0}, "decode": {"alive": 1, "healthy": 1}},
              "workers": [worker("prefill", "prefill-0-aaaaaa", "ALIVE", False,
                                 error="load() did not answer within 5 s"),
                          worker("decode", "decode-0-bbbbbb", "ALIVE", True,
                                 LoadReport(free_blocks=60, num_blocks=100, running=3, receiving=1,
                                            steps=StepTotals(decode_seconds=1.5, decode_steps=10, decode_rows=30))),
                          worker("decode", "decode-1-cccccc", "DEAD", None)],
              "nodes": [{"node_id": "h" * 56, "node_ip": "10.0.0.1", "alive": True, "is_head": True, "resources": {}},
                        {"node_id": "n1" * 28, "node_ip": "10.0.0.7", "alive": True, "is_head": False,
                         "resources": {"decode_pool": {"total": 2.0, "available": 1.0},
                                       "CPU": {"total": 4.0, "available": None}}}]}
    text = format_status(status)
    lines = text.splitlines()
    row = next(ln for ln in lines if "prefill-0-aaaaaa" in ln)
    assert "NO ANSWER" in row and "ALIVE" in row
    assert "kv 40/100 blocks, 3 running, 1 receiving" in next(ln for ln in lines if "decode-0-bbbbbb" in ln)
    assert "DEAD" in next(ln for ln in lines if "decode-1-cccccc" in ln)
    assert "did not answer within 5 s" in text
    node = next(ln for ln in lines if ln.startswith("n1n1"))
    assert "1/2" in node and "?/4" in node
    assert "pdserve: UNHEALTHY: prefill 0/1 and decode 1/1" in text
    as_json = json.loads(status_json(status))  # `pdserve status --json`: load reports as plain objects
    steps = {"decode_seconds": 1.5, "decode_steps": 10, "decode_rows": 30, "prefill_seconds": 0.0, "prefill_steps": 0,
             "mixed_steps": 0, "ride_rows": 0, "prefill_tokens": 0, "busy_seconds": 0.0, "decode_context": 0}
    assert as_json["workers"][1]["load"] == {"free_blocks": 60, "num_blocks": 100, "running": 3, "receiving": 1,
                                             "queued_tokens": 0, "sending": 0, "threads": 0, "preemptions": 0,
                                             "steps": steps}


@pytest.mark.parametrize("address,says", [("127.0.0.1:{port}", "no Ray cluster at"), ("ray://127.0.0.1:{port}",
                                          "no Ray cluster at"), ("head-svc", "HOST:PORT")])
def test_status_fails_fast_without_a_cluster(address, says):
    t0 = time.monotonic()
    with pytest.raises(ConnectionError, match=says):
        _check_reachable(address.format(port=free_port()))
    assert time.monotonic() - t0 < 10


@pytest.mark.slow
def test_serve_through_a_ray_client_address(cluster, tmp_path):
    """`--address ray://...`: Ray Client drivers cannot take streamed results; the router pulls tokens."""
    _, _, client_port = cluster
    ref = tiny_model("llama", seed=6)
    ref.save_pretrained(tmp_path)
    log: list[str] = []
    proc, _, grpc_port = start_serve(f"ray://127.0.0.1:{client_port}", tmp_path, log)
    try:
        prompt = random_prompt(40, 3)
        ids, timings = generate_ids(grpc_port, prompt, 12)
        assert ids == greedy_reference(ref, prompt, 12)
        assert timings.path == "remote"
    finally:
        code = sigterm(proc)
    assert code == 0, "".join(log[-40:])
