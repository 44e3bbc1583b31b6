"""Turns the serving benchmark's result files into tables, plots and the `BENCHMARKS.md` section."""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from loadtest.metrics import summarize
from loadtest.plots import plot_goodput_vs_rate, plot_phase_breakdown
from loadtest.records import RequestRecord
from loadtest.report import write_results
from pdserve.bench.report import write_report as write_section
from pdserve.bench.serving import saturated_counts

LABELS = {"ratio": "pdserve ratio", "always_remote": "pdserve always_remote", "colocated": "pdserve colocated",
          "single": "pdserve one worker, both cores", "fixed": "pdserve ratio, no lending",
          "flip": "pdserve ratio, flips", "vllm": "vLLM-CPU"}
ATTAINMENT = 0.9  # the share of requests within the SLO that makes a rate sustainable


def _f(v: float | None, fmt: str = "{:.2f}") -> str:
    return "–" if v is None else fmt.format(v)


def _docs(out: Path, slos: dict) -> list[dict]:
    """Every result file in `out`, each run summarized (again) against its workload's SLO now: a server
    measured in an earlier report counts against the same targets as the peer measured last."""
    docs = []
    for path in sorted(out.glob("*--*.json")):
        doc = json.loads(path.read_text())
        slo = slos.get(doc["meta"]["workload"])
        if slo is not None:
            for run in doc["runs"]:
                records = [RequestRecord.from_dict(r) for r in run["records"]]
                run["summary"] = summarize(records, run["summary"]["wall_time_s"], slo.ttft_s, slo.tpot_s)
            doc["meta"]["slo_basis"] = slo.basis
            write_results(path, doc)
        docs.append(doc)
    return docs


def _open_table(docs: list[dict], workload: str) -> list[str]:
    lines = [("| server | rate (req/s) | ok / sent | goodput (req/s) | within SLO | TTFT p50 / p99 (s) | "
              "ITL p50 / p99 / max (s) | TPOT p50 (s) | output tok/s |"), "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for doc in docs:
        if doc["meta"]["workload"] != workload:
            continue
        for run in doc["runs"]:
            c, s = run["config"], run["summary"]
            if c["mode"] != "open":
                continue
            lines.append(f"| {LABELS.get(doc['meta']['server'], doc['meta']['server'])} | {c['rate']:g} | "
                         f"{s['requests']['ok']} / {c['sent']} | {_f(s['goodput']['requests_per_s'], '{:.3f}')} | "
                         f"{100 * s['goodput']['fraction']:.0f}% | {_f(s['ttft_s']['p50'])} / {_f(s['ttft_s']['p99'])} | "
                         f"{_f(s['itl_s']['p50'], '{:.3f}')} / "
                         f"{_f(s['itl_s']['p99'], '{:.3f}')} / {_f(s['itl_s']['max'], '{:.2f}')} | "
                         f"{_f(s['tpot_s']['p50'], '{:.3f}')} | "
                         f"{_f(s['throughput']['output_tokens_per_s'], '{:.1f}')} |")
    return lines


def capacities(docs: list[dict], workload: str, attainment: float = ATTAINMENT) -> dict[str, float | None]:
    """Per server: the highest open-loop rate it ran `workload` at such that at that rate and every lower
    one it ran, at least `attainment` of the requests sent met the SLO: the rate it sustains (a rate met
    above one missed says more about that run's requests than about the server). None: its lowest rate
    missed. Only as fine as the rates run."""
    runs: dict[str, list[tuple[float, float]]] = {}
    for doc in docs:
        if doc["meta"]["workload"] == workload:
            runs.setdefault(doc["meta"]["server"], []).extend(
                (r["config"]["rate"], r["summary"]["goodput"]["fraction"]) for r in doc["runs"]
                if r["config"]["mode"] == "open")
    best: dict[str, float | None] = {}
    for server, points in runs.items():
        best[server] = None
        for rate, fraction in sorted(points):
            if fraction < attainment:
                break
            best[server] = rate
    return best


def _capacity_line(docs: list[dict], workload: str) -> list[str]:
    caps = capacities(docs, workload)
    if not caps:
        return []
    text = ", ".join(f"{LABELS.get(k, k)} {'none of its rates' if v is None else f'{v:g} req/s'}"
                     for k, v in caps.items())
    return [(f"Rate sustained (the highest up to which every rate run had ≥ {100 * ATTAINMENT:.0f}% of requests "
             f"within the SLO): {text}."), ""]


def _closed_table(docs: list[dict]) -> list[str]:
    lines = ["| server | concurrency | ok / sent | output tok/s | TPOT p50 (s) | TTFT p50 (s) |",
             "|---|---:|---:|---:|---:|---:|"]
    for doc in docs:
        for run in doc["runs"]:
            c, s = run["config"], run["summary"]
            if c["mode"] == "closed":
                lines.append(f"| {LABELS.get(doc['meta']['server'], doc['meta']['server'])} | {c['concurrency']} | "
                             f"{s['requests']['ok']} / {c['sent']} | "
                             f"{_f(s['throughput']['output_tokens_per_s'], '{:.1f}')} | "
                             f"{_f(s['tpot_s']['p50'], '{:.3f}')} | {_f(s['ttft_s']['p50'])} |")
    return lines


def _plots(out: Path, docs: list[dict], workloads: list, report: Path) -> list[str]:
    """The plots, written into `out`, as Markdown images linked relative to the `report` file."""
    def link(path: Path | str) -> str:
        return Path(os.path.relpath(Path(path).resolve(), report.resolve().parent)).as_posix()
    lines = []
    for w in workloads:
        sel = [d for d in docs if d["meta"]["workload"] == w.name]
        try:
            path = plot_goodput_vs_rate(sel, out / f"goodput--{w.name}.png")
            lines.append(f"![goodput vs rate, {w.name}]({link(path)})")
        except ValueError:
            pass
    for d in docs:
        if d["meta"]["server"] == "ratio" and d["meta"]["workload"] == "mixed":
            path = plot_phase_breakdown(d, out / "phases--ratio--mixed.png")
            if path is not None:
                lines.append(f"![per-request phases, ratio, mixed]({link(path)})")
    return lines


TOLD = ", started for each workload with its SLO as the ratio policy's targets (`--ttft-target`, `--tpot-target`)"


def write_report(out: Path, args: argparse.Namespace, workloads: list, machine: dict, slos: dict) -> str:
    """Build the section, write it into the report file as this machine class's serving section (the other
    classes' stay). `machine`: `pdserve.bench.engine.machine_info()`. `slos`: each workload's `Slo` (its
    goodput targets and where they come from). Returns the section."""
    docs = _docs(out, slos)
    cls = machine["machine_class"]
    section = [f"## Serving: pdserve vs vLLM-CPU ({cls}, {args.dtype})", "",
               (f"Machine: {machine['cpu']}, {machine['cores']} cores, CPU flags {machine['isa']}, torch "
                f"{machine['torch']}, {machine['date']}. Model: `{Path(args.model_dir).name}`, {args.dtype}. "
                f"pdserve with its defaults{TOLD if args.tell_slo else ''}. "
                f"{args.num_requests} requests per run. "
                "Command: `make bench` (`pdserve bench report`)."), ""]
    for w in workloads:
        parts = " + ".join(f"{p}/{o}" for p, o in w.parts)
        slo = slos[w.name]
        section += [(f"**{w.name}** (prompt/output tokens: {parts}; open loop, Poisson). Goodput: TTFT ≤ "
                     f"{slo.ttft_s:.2f} s and TPOT ≤ {slo.tpot_s * 1e3:.0f} ms ({slo.basis})"), ""]
        section += _open_table(docs, w.name) + [""] + _capacity_line(docs, w.name)
    if any(w.name == "decode-heavy" for w in workloads):
        warm, measured = saturated_counts(args.num_requests, args.concurrency)
        title = (f"**Saturated throughput**, decode-heavy, closed loop: {measured} requests measured after a wave "
                 f"of {warm}")
        section += [f"{title} that warms up", ""] + _closed_table(docs) + [""]
    section += _plots(out, docs, workloads, Path(args.report)) + [""]
    text = "\n".join(section)
    write_section(Path(args.report), text, cls, "serving")
    return text
