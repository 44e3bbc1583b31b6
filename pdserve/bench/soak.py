"""`pdserve bench soak`: hours-long reliability in minutes: steady load while workers are killed.

1. Start a Ray head, then `pdserve serve --address` on it (2 prefill + 2 decode workers by default,
   so retries and migrations have somewhere to go).
2. Drive it open-loop (Poisson) at a fixed rate for `--minutes`, with the load generator.
3. Every `--kill-every` seconds, SIGKILL one worker process, prefill and decode in turn.
4. At the end: requests served, failed (by kind), recovered (retried, moved, migrated), workers
   replaced, and the memory of every pdserve process at the start and at the end.
Results go to JSON and a table into `BENCHMARKS.md` between the soak markers.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from loadtest.clients import make_client
from loadtest.metrics import summarize
from loadtest.runner import run_open_loop
from loadtest.workload import build_workload

MARK_START, MARK_END = "<!-- soak-bench:start -->", "<!-- soak-bench:end -->"


def _rss_mib(pattern: str) -> float:
    """Total resident memory of the processes whose command line contains `pattern`."""
    total = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if pattern in cmd:
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1])
        except OSError:
            continue
    return total / 1024


def _metric_total(base: str, name: str) -> dict[str, float]:
    """Sum of a counter's samples by label set, from the server's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name == name:
            for s in fam.samples:
                if s.name.endswith("_total"):
                    key = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) or "all"
                    out[key] = out.get(key, 0.0) + s.value
    return out


def _wait_port(port: int, proc: subprocess.Popen, timeout_s: float) -> None:
    import socket

    end = time.monotonic() + timeout_s
    while time.monotonic() < end and proc.poll() is None:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                time.sleep(3)  # the GCS listens before the node is fully up
                return
        time.sleep(0.5)
    raise RuntimeError(f"the Ray head did not come up on port {port}")


def _killer(address: str, every_s: float, stop: threading.Event, kills: list) -> None:
    """Kill one worker process every `every_s`, prefill and decode in turn (in a Ray driver of its own)."""
    code = ("import os, signal, sys, ray; ray.init(address=sys.argv[1], log_to_driver=False, namespace='pdserve');"
            "from ray.util.state import list_actors;"
            "names=[a.name for a in list_actors(filters=[('state','=','ALIVE')]) "
            "if a.class_name==sys.argv[2] and a.name];"
            "a=ray.get_actor(sorted(names)[0], namespace='pdserve'); pid=ray.get(a.pid.remote());"
            "os.kill(pid, signal.SIGKILL); print(sorted(names)[0], pid)")
    turn = 0
    while not stop.wait(every_s):
        cls = ("PrefillWorker", "DecodeWorker")[turn % 2]
        turn += 1
        res = subprocess.run([sys.executable, "-c", code, address, cls], check=False, capture_output=True,
                             text=True, timeout=120, env={**os.environ, "RAY_AUTH_MODE": "disabled"})
        kills.append({"t": time.time(), "class": cls, "out": res.stdout.strip(), "ok": res.returncode == 0})
        print(f"[soak] killed {cls}: {res.stdout.strip() or res.stderr[-300:]}", file=sys.stderr, flush=True)


def run_soak(args: argparse.Namespace) -> int:
    from pdserve.bench.serving import _free_port, _machine, _stop, _wait_http

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    gcs, http = _free_port(), _free_port()
    ray_cli = str(Path(sys.executable).parent / "ray")
    head = subprocess.Popen([ray_cli, "start", "--head", "--block", f"--port={gcs}", "--num-cpus=4",
                             "--disable-usage-stats", f"--temp-dir=/tmp/pdserve-soak-{gcs}",
                             f"--resources={json.dumps({'prefill_pool': args.prefill, 'decode_pool': args.decode})}"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    _wait_port(gcs, head, 120)
    address = f"127.0.0.1:{gcs}"
    cmd = [sys.executable, "-m", "pdserve", "serve", "--address", address, "--dtype", args.dtype,
           "--prefill", str(args.prefill), "--decode", str(args.decode), "--cpus-per-worker", "1",
           "--http-port", str(http), "--grpc-port", "0", "--served-model-name", "model", "--log-level", "warning",
           "--transfer-timeout", "10"]
    log = open(out.with_suffix(".log"), "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    base = f"http://127.0.0.1:{http}"
    stop, kills = threading.Event(), []
    try:
        _wait_http(base + "/v1/models", proc, 900)
        mem_start = {"router": _rss_mib("pdserve serve"), "workers": _rss_mib("ray::")}
        killer = threading.Thread(target=_killer, args=(address, args.kill_every, stop, kills), daemon=True)
        killer.start()
        n = int(args.rate * args.minutes * 60)
        specs = build_workload(f"fixed:{args.prompt}:{args.output}", n, seed=1, vocab_size=49152)

        async def drive():
            client = make_client("openai", base, model="model", timeout_s=300)
            try:
                return await run_open_loop(client, specs, args.rate, 1, args.minutes * 60 + 60)
            finally:
                await client.aclose()
        result = asyncio.run(drive())
        stop.set()
        killer.join(130)
        time.sleep(5)
        mem_end = {"router": _rss_mib("pdserve serve"), "workers": _rss_mib("ray::")}
        summary = summarize(result.records, result.wall_time_s)
        doc = {"command": " ".join(cmd), "machine": _machine(), "minutes": args.minutes, "rate": args.rate,
               "workload": f"{args.prompt}/{args.output}", "kills": kills, "summary": summary,
               "recoveries": _metric_total(base, "pdserve_request_recoveries"),
               "replacements": _metric_total(base, "pdserve_worker_replacements"),
               "outcomes": _metric_total(base, "pdserve_requests"), "memory_mib": {"start": mem_start, "end": mem_end}}
        out.write_text(json.dumps(doc, indent=1))
        _write_report(doc, Path(args.report))
        print(json.dumps({k: doc[k] for k in ("recoveries", "replacements", "outcomes", "memory_mib")}, indent=1))
    finally:
        stop.set()
        _stop(proc)
        log.close()
        os.killpg(head.pid, signal.SIGTERM)  # this head and what it started, nothing else on the machine
        head.wait(60)
    return 0


def _write_report(doc: dict, report: Path) -> None:
    s, m = doc["summary"], doc["memory_mib"]
    errors = ", ".join(f"{k}: {v}" for k, v in s["errors_by_kind"].items()) or "none"
    rec = ", ".join(f"{k.split('=')[1]}: {v:.0f}" for k, v in doc["recoveries"].items()) or "none"
    rep = ", ".join(f"{k.split('=')[1]}: {v:.0f}" for k, v in doc["replacements"].items()) or "none"
    lines = [MARK_START, "",
             (f"Machine: {doc['machine']}. Command: `pdserve bench soak --minutes {doc['minutes']}` "
              f"(`{doc['command']}`)."), "",
             ("| minutes | rate (req/s) | prompt/output | sent | served | failed | worker kills | recoveries | "
              "replaced | memory start → end (MiB) |"), "|---:|---:|---|---:|---:|---:|---:|---|---|---|",
             (f"| {doc['minutes']} | {doc['rate']} | {doc['workload']} | {s['requests']['total']} | "
              f"{s['requests']['ok']} | {s['requests']['errors']} ({errors}) | {len(doc['kills'])} | {rec} | {rep} | "
              f"router {m['start']['router']:.0f} → {m['end']['router']:.0f}, workers {m['start']['workers']:.0f} → "
              f"{m['end']['workers']:.0f} |"), "", MARK_END]
    text = "\n".join(lines)
    old = report.read_text() if report.exists() else ""
    if MARK_START in old and MARK_END in old:
        head, rest = old.split(MARK_START, 1)
        report.write_text(head + text + rest.split(MARK_END, 1)[1])
    else:
        report.write_text(old.rstrip() + "\n\n## Soak: steady load while workers are killed\n\n" + text + "\n")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--rate", type=float, default=0.3, help="requests/s (about 70%% of this machine's capacity)")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--output", type=int, default=64)
    p.add_argument("--kill-every", type=float, default=120.0, help="seconds between worker kills")
    p.add_argument("--prefill", type=int, default=2)
    p.add_argument("--decode", type=int, default=2)
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    p.add_argument("--out", default="bench/results/soak.json")
    p.add_argument("--report", default="BENCHMARKS.md")
