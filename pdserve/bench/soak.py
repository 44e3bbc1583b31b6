"""`pdserve bench soak`: hours-long reliability in minutes: steady load while workers and the router fail.

1. Start a Ray head, then `pdserve serve --address --deployment soak` on it (2 prefill + 2 decode
   workers by default, so retries and migrations have somewhere to go).
2. Drive it open-loop (Poisson) at a fixed rate for `--minutes`, with the load generator.
3. Every `--fault-every` seconds, the next fault of the cycle (`--faults`): SIGKILL a prefill worker,
   SIGKILL a decode worker, SIGSTOP a prefill worker, SIGSTOP a decode worker (hung: the router kills
   and replaces it after `--hang-timeout`), SIGKILL the router and start it again (it adopts the
   deployment's workers; requests in flight through the old router are lost with it, and requests
   sent while it is down are refused).
4. At the end: requests served, failed (by kind), recovered (retried, moved, migrated), workers
   replaced, the router's downtime per restart, and the memory of every pdserve process at the start
   and at the end. The router's counters are read before each restart and summed.
Results go to JSON and a table into `BENCHMARKS.md` between the soak markers.
"""
from __future__ import annotations

import argparse
import asyncio
import bisect
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
from loadtest.runner import gamma_arrivals, run_open_loop
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
    """Sum of a counter's samples by label set (but `model_name`: the soak serves one), from the server's
    /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name == name:
            for s in fam.samples:
                if s.name.endswith("_total"):
                    key = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name") or "all"
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


FAULTS = ("kill-prefill", "kill-decode", "hang-prefill", "hang-decode", "restart-router")
COUNTERS = ("request_recoveries", "worker_replacements", "requests")  # the router's, summed across its restarts
_WORKER_CLASS = {"prefill": "PrefillWorker", "decode": "DecodeWorker"}


def _signal_worker(address: str, fault: str) -> tuple[bool, str]:
    """SIGKILL (kill-*) or SIGSTOP (hang-*) one live worker of the fault's pool, from a Ray driver of
    its own. Returns (done, what it said)."""
    code = ("import os, signal, sys, ray; ray.init(address=sys.argv[1], log_to_driver=False, namespace='pdserve');"
            "from ray.util.state import list_actors;"
            "names=[a.name for a in list_actors(filters=[('state','=','ALIVE')]) "
            "if a.class_name==sys.argv[2] and a.name];"
            "a=ray.get_actor(sorted(names)[0], namespace='pdserve'); pid=ray.get(a.pid.remote(), timeout=30);"
            "os.kill(pid, getattr(signal, sys.argv[3])); print(sorted(names)[0], pid)")
    kind, pool = fault.split("-")
    res = subprocess.run([sys.executable, "-c", code, address, _WORKER_CLASS[pool],
                          "SIGKILL" if kind == "kill" else "SIGSTOP"], check=False, capture_output=True, text=True,
                         timeout=120, env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    return res.returncode == 0, res.stdout.strip() or res.stderr[-300:]


class _Router:
    """The `pdserve serve` process under test: started, and SIGKILLed and started again (same ports, same
    deployment), its counters read before each restart so that none is lost with it."""

    def __init__(self, cmd: list[str], env: dict, log, base: str) -> None:
        self.cmd, self.env, self.log, self.base = cmd, env, log, base
        self.proc = self._start()
        self.counters: list[dict[str, dict[str, float]]] = []  # one per router process that was killed

    def _start(self) -> subprocess.Popen:
        return subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, env=self.env,
                                start_new_session=True)

    def counters_now(self) -> dict[str, dict[str, float]]:
        return {name: _metric_total(self.base, f"pdserve_{name}") for name in COUNTERS}

    def restart(self) -> float:
        """Kill the router and start it again. Returns: seconds until it served /v1/models again."""
        from pdserve.bench.serving import _wait_http

        try:
            self.counters.append(self.counters_now())
        except OSError:  # it did not answer: its counters are lost with it
            self.counters.append({})
        t0 = time.monotonic()
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.proc = self._start()
        _wait_http(self.base + "/v1/models", self.proc, 300)
        return time.monotonic() - t0

    def totals(self) -> dict[str, dict[str, float]]:
        """Every counter summed over the killed routers and the live one."""
        out: dict[str, dict[str, float]] = {}
        for snapshot in [*self.counters, self.counters_now()]:
            for name, values in snapshot.items():
                for key, v in values.items():
                    out.setdefault(name, {})[key] = out.get(name, {}).get(key, 0.0) + v
        return {name: out.get(name, {}) for name in COUNTERS}



def _faulter(address: str, router: _Router, faults: tuple[str, ...], every_s: float, stop: threading.Event,
             events: list) -> None:
    """One fault of the cycle every `every_s`."""
    turn = 0
    while not stop.wait(every_s):
        fault = faults[turn % len(faults)]
        turn += 1
        event: dict = {"t": time.time(), "fault": fault}
        try:
            if fault == "restart-router":
                event["downtime_s"] = router.restart()
                event["ok"], event["out"] = True, f"serving again after {event['downtime_s']:.1f} s"
            else:
                event["ok"], event["out"] = _signal_worker(address, fault)
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            event["ok"], event["out"] = False, str(e)
        events.append(event)
        print(f"[soak] {fault}: {event['out']}", file=sys.stderr, flush=True)


def status_line(elapsed_s: float, minutes: float, sent: int, ok: int, failed: int, events: list[dict]) -> str:
    """The soak's periodic status: minutes run of the total, requests sent and ended (ok, failed), faults done."""
    done = sum(1 for e in events if e["ok"])
    return (f"[soak] {elapsed_s / 60:.1f}/{minutes:g} min | {sent} requests sent, {ok + failed} ended: {ok} ok, "
            f"{failed} failed | {len(events)} faults done ({done} took effect"
            f"{', last: ' + events[-1]['fault'] if events else ''})")


def _reporter(stop: threading.Event, every_s: float, minutes: float, arrivals: list[float], ended: dict[str, int],
              events: list[dict]) -> None:
    """A status line every `every_s` until `stop` (requests sent: the load's arrivals due so far)."""
    t0 = time.monotonic()
    while not stop.wait(every_s):
        elapsed = time.monotonic() - t0
        print(status_line(elapsed, minutes, bisect.bisect_right(arrivals, elapsed), ended["ok"], ended["failed"],
                          list(events)), file=sys.stderr, flush=True)


def machine() -> str:
    """This machine, for the report: CPU, cores, class and flags, torch."""
    from pdserve.bench.engine import machine_info

    m = machine_info()
    return f"{m['cpu']}, {m['cores']} cores, {m['machine_class']} ({m['isa']}), torch {m['torch']}"


def run_soak(args: argparse.Namespace) -> int:
    from pdserve.bench.serving import _stop, _wait_http, free_port

    faults = tuple(args.faults)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    gcs, http = free_port(), free_port()
    ray_cli = str(Path(sys.executable).parent / "ray")
    head = subprocess.Popen([ray_cli, "start", "--head", "--block", f"--port={gcs}", "--num-cpus=4",
                             "--disable-usage-stats", f"--temp-dir=/tmp/pdserve-soak-{gcs}",
                             f"--resources={json.dumps({'prefill_pool': args.prefill, 'decode_pool': args.decode})}"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    _wait_port(gcs, head, 120)
    address = f"127.0.0.1:{gcs}"
    cmd = [sys.executable, "-m", "pdserve", "serve", "--address", address, "--deployment", "soak", "--dtype",
           args.dtype, "--prefill", str(args.prefill), "--decode", str(args.decode), "--cpus-per-worker", "1",
           "--http-port", str(http), "--grpc-port", "0", "--served-model-name", "model", "--log-level", "warning",
           "--transfer-timeout", "10", "--hang-timeout", str(args.hang_timeout)]
    log = open(out.with_suffix(".log"), "w")  # noqa: SIM115 - closed below
    base = f"http://127.0.0.1:{http}"
    router = _Router(cmd, env, log, base)
    stop, events = threading.Event(), []
    try:
        _wait_http(base + "/v1/models", router.proc, 900)
        mem_start = {"router": _rss_mib("pdserve serve"), "workers": _rss_mib("ray::")}
        faulter = threading.Thread(target=_faulter, args=(address, router, faults, args.fault_every, stop, events),
                                   daemon=True)
        faulter.start()
        n = int(args.rate * args.minutes * 60)
        specs = build_workload(f"fixed:{args.prompt}:{args.output}", n, seed=1, vocab_size=49152)
        ended = {"ok": 0, "failed": 0}

        def count(rec) -> None:
            ended["ok" if rec.ok else "failed"] += 1

        async def drive():
            client = make_client("openai", base, model="model", timeout_s=300)
            try:  # a bar only on a terminal: a log gets the status lines
                return await run_open_loop(client, specs, args.rate, 1, args.minutes * 60 + 60,
                                           progress=sys.stderr.isatty(), on_record=count)
            finally:
                await client.aclose()
        reporter = threading.Thread(target=_reporter, args=(stop, args.status_every, args.minutes,
                                                            gamma_arrivals(args.rate, n, 1), ended, events),
                                    daemon=True)
        reporter.start()
        t_run = time.time()
        result = asyncio.run(drive())
        stop.set()
        faulter.join(400)
        time.sleep(5)
        mem_end = {"router": _rss_mib("pdserve serve"), "workers": _rss_mib("ray::")}
        summary = summarize(result.records, result.wall_time_s)
        totals = router.totals()
        doc = {"command": " ".join(cmd), "machine": machine(), "minutes": args.minutes, "rate": args.rate,
               "workload": f"{args.prompt}/{args.output}", "faults": events, "summary": summary,
               "recoveries": totals["request_recoveries"], "replacements": totals["worker_replacements"],
               "outcomes": totals["requests"], "memory_mib": {"start": mem_start, "end": mem_end},
               "failures": failures_by_cause(result.records, events, t_run)}
        out.write_text(json.dumps(doc, indent=1))
        _write_report(doc, Path(args.report))
        print(json.dumps({k: doc[k] for k in ("recoveries", "replacements", "outcomes", "memory_mib")}, indent=1))
    finally:
        stop.set()
        _stop(router.proc)
        log.close()
        os.killpg(head.pid, signal.SIGTERM)  # this head and what it started, nothing else on the machine
        head.wait(60)
    return 0


def failures_by_cause(records: list, events: list[dict], t_run: float) -> dict[str, int]:
    """The failed requests by what was happening: sent while the router was down (`router_down`),
    in flight through a router that was killed (`router_killed`), or neither (`other`).

    Args:
        records: the load generator's `RequestRecord`s; events: the faults (`downtime_s` on restarts);
        t_run: the wall-clock time the records' `start_s` count from.
    """
    windows = [(e["t"] - t_run, e["t"] - t_run + e["downtime_s"]) for e in events if "downtime_s" in e]
    out = {"router_down": 0, "router_killed": 0, "other": 0}
    for r in records:
        if r.error is None:
            continue
        end = None if r.e2e_s is None else r.start_s + r.e2e_s
        if any(a <= r.start_s <= b for a, b in windows):
            out["router_down"] += 1
        elif any(r.start_s < a and (end is None or end >= a - 1.0) for a, _ in windows):
            out["router_killed"] += 1
        else:
            out["other"] += 1
    return out


def _write_report(doc: dict, report: Path) -> None:
    s, m = doc["summary"], doc["memory_mib"]
    errors = ", ".join(f"{k}: {v}" for k, v in s["errors_by_kind"].items()) or "none"
    if s["requests"]["errors"]:
        f = doc["failures"]
        errors += (f"; sent while the router was down: {f['router_down']}, in flight when it was killed: "
                   f"{f['router_killed']}, other: {f['other']}")
    rec = ", ".join(f"{k.split('=')[1]}: {v:.0f}" for k, v in doc["recoveries"].items()) or "none"
    rep = ", ".join(f"{k.split('=')[1]}: {v:.0f}" for k, v in doc["replacements"].items()) or "none"
    done = [e for e in doc["faults"] if e["ok"]]
    counts = {f: sum(e["fault"] == f for e in done) for f in FAULTS}
    faults = ", ".join(f"{f}: {n}" for f, n in counts.items() if n)
    downtime = [e["downtime_s"] for e in done if "downtime_s" in e]
    down = f"{min(downtime):.0f}–{max(downtime):.0f} s" if downtime else "—"
    lines = [MARK_START, "",
             (f"Machine: {doc['machine']}. Command: `pdserve bench soak --minutes {doc['minutes']}` "
              f"(`{doc['command']}`)."), "",
             ("| minutes | rate (req/s) | prompt/output | sent | served | failed | faults | router down per "
              "restart | recoveries | replaced | memory start → end (MiB) |"),
             "|---:|---:|---|---:|---:|---:|---|---|---|---|---|",
             (f"| {doc['minutes']} | {doc['rate']} | {doc['workload']} | {s['requests']['total']} | "
              f"{s['requests']['ok']} | {s['requests']['errors']} ({errors}) | {faults or 'none'} | {down} | {rec} | "
              f"{rep} | router {m['start']['router']:.0f} → {m['end']['router']:.0f}, workers "
              f"{m['start']['workers']:.0f} → {m['end']['workers']:.0f} |"), "", MARK_END]
    text = "\n".join(lines)
    old = report.read_text() if report.exists() else ""
    if MARK_START in old and MARK_END in old:
        head, rest = old.split(MARK_START, 1)
        report.write_text(head + text + rest.split(MARK_END, 1)[1])
    else:
        report.write_text(old.rstrip() + "\n\n## Soak: steady load while workers and the router fail\n\n" + text + "\n")


def _faults(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [n for n in names if n not in FAULTS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown fault(s) {', '.join(unknown) or '(none given)'}; "
                                         f"choose from {', '.join(FAULTS)}")
    return names


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--rate", type=float, default=0.3, help="requests/s (about 70%% of this machine's capacity)")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--output", type=int, default=64)
    p.add_argument("--fault-every", type=float, default=120.0, help="seconds between faults")
    p.add_argument("--status-every", type=float, default=60.0, help="seconds between status lines on stderr "
                   "(minutes run, requests sent, ended ok and failed, faults done)")
    p.add_argument("--faults", type=_faults, default=list(FAULTS), help="the cycle of faults, comma-separated "
                   f"(default: {','.join(FAULTS)})")
    p.add_argument("--hang-timeout", type=float, default=20.0, help="the router's --hang-timeout: how long a "
                   "stopped worker goes unanswered before it is killed and replaced")
    p.add_argument("--prefill", type=int, default=2)
    p.add_argument("--decode", type=int, default=2)
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    p.add_argument("--out", default="bench/results/soak.json")
    p.add_argument("--report", default="BENCHMARKS.md")
