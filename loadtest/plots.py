"""PNG charts of results documents (see `loadtest.report`), with matplotlib's Agg backend.

  plot_latency_cdfs      empirical CDFs of TTFT, ITL and TPOT, one line per run.
  plot_goodput_vs_rate   goodput (solid) and throughput (dashed) vs offered rate, one colour per document
                         (server / label), from open-loop runs.
  plot_phase_breakdown   per request, stacked bars of pdserve's queue / prefill / transfer / decode seconds.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from loadtest.metrics import request_itls, request_tpot
from loadtest.records import PHASES
from loadtest.report import run_records

MAX_BARS = 200


def _run_name(run: dict[str, Any]) -> str:
    c = run["config"]
    return f"{c['rate']} req/s" if c.get("mode") == "open" else f"concurrency {c.get('concurrency')}"


def _ecdf(ax: Any, values: list[float], label: str) -> None:
    if values:
        xs = sorted(v * 1000 for v in values)
        ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=label)


def plot_latency_cdfs(doc: dict[str, Any], path: str | Path) -> Path:
    """Writes the TTFT / ITL / TPOT CDFs (milliseconds) of every run in doc. Returns: path."""
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for run in doc["runs"]:
        ok = [r for r in run_records(run) if r.ok]
        name = _run_name(run)
        _ecdf(axes[0], [r.ttft_s for r in ok if r.ttft_s is not None], name)
        _ecdf(axes[1], [g for r in ok for g in request_itls(r)], name)
        _ecdf(axes[2], [t for t in map(request_tpot, ok) if t is not None], name)
    for ax, title, unit in zip(axes, ("TTFT", "inter-token (chunk) latency", "TPOT"), ("requests", "gaps", "requests")):
        ax.set(title=title, xlabel="ms", ylabel=f"fraction of {unit}")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize="small")
    fig.suptitle(f"{doc.get('label', '')}: latency CDFs")
    return _save(fig, path)


def plot_goodput_vs_rate(docs: list[dict[str, Any]], path: str | Path) -> Path:
    """Writes goodput and throughput (req/s) vs offered rate, one colour per document, from its open-loop
    runs with a finite rate. Returns: path. Raises: ValueError when no document has such a run."""
    fig, ax = plt.subplots(figsize=(7.5, 5))
    top = 0.0
    for i, doc in enumerate(docs):
        pts = sorted((float(r["config"]["rate"]), r["summary"]["goodput"]["requests_per_s"],
                      r["summary"]["throughput"]["requests_per_s"]) for r in doc["runs"]
                     if r["config"].get("mode") == "open" and _finite_rate(r["config"].get("rate")))
        if not pts:
            continue
        color = f"C{i % 10}"
        rates = [p[0] for p in pts]
        ax.plot(rates, [p[1] for p in pts], "o-", color=color, label=f"{doc.get('label', i)} goodput")
        ax.plot(rates, [p[2] for p in pts], "x--", color=color, alpha=0.6, label=f"{doc.get('label', i)} throughput")
        top = max(top, *rates)
    if not ax.lines:
        plt.close(fig)
        raise ValueError("no open-loop runs with a finite rate to plot goodput against")
    ax.plot([0, top], [0, top], ":", color="grey", label="offered rate")
    gp = docs[0]["runs"][0]["summary"]["goodput"]
    ax.set(xlabel="offered rate (req/s)", ylabel="req/s",
           title=f"goodput (TTFT <= {gp['ttft_target_s']} s, TPOT <= {gp['tpot_target_s']} s) vs rate")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return _save(fig, path)


def _finite_rate(rate: Any) -> bool:
    return isinstance(rate, (int, float)) and rate != float("inf")


def plot_phase_breakdown(doc: dict[str, Any], path: str | Path, run_index: int = -1) -> Path | None:
    """Writes, for one run (default: the last), stacked bars of pdserve's queue / prefill / transfer / decode
    seconds per successful request with timings (the first MAX_BARS, in workload order), remote-path requests
    marked "r". Returns: path, or None (nothing written) when no request of the run has timings."""
    run = doc["runs"][run_index]
    rows = [r for r in run_records(run) if r.ok and r.timings][:MAX_BARS]
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(max(7.0, min(20.0, len(rows) * 0.12)), 5))
    xs = list(range(len(rows)))
    bottom = [0.0] * len(rows)
    for j, phase in enumerate(PHASES):
        vals = [float(r.timings.get(phase, 0.0)) for r in rows]
        ax.bar(xs, vals, bottom=bottom, width=0.85, color=f"C{j}", label=phase.removesuffix("_s"))
        bottom = [b + v for b, v in zip(bottom, vals)]
    for x, r in zip(xs, rows):
        if r.timings.get("path") == "remote":
            ax.text(x, bottom[x], "r", ha="center", va="bottom", fontsize=6)
    ticks = xs[:: max(1, -(-len(xs) // 15))]
    ax.set_xticks(ticks, [str(rows[x].index) for x in ticks])
    ax.set(xlabel="request (r: remote prefill)", ylabel="seconds",
           title=f"{doc.get('label', '')}, {_run_name(run)}: phase breakdown")
    ax.legend(fontsize="small")
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, path)


def _save(fig: Any, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_plots(doc: dict[str, Any], out_dir: str | Path) -> list[Path]:
    """Every chart one document supports, into out_dir: latency_cdf.png; with pdserve timings phases.png
    (one run) or phases_<i>.png (run i of several); with open-loop runs goodput_vs_rate.png.
    Returns: the files written."""
    out = Path(out_dir)
    written = [plot_latency_cdfs(doc, out / "latency_cdf.png")]
    n = len(doc["runs"])
    for i in range(n):
        phases = plot_phase_breakdown(doc, out / ("phases.png" if n == 1 else f"phases_{i}.png"), i)
        if phases is not None:
            written.append(phases)
    if any(r["config"].get("mode") == "open" and _finite_rate(r["config"].get("rate")) for r in doc["runs"]):
        written.append(plot_goodput_vs_rate([doc], out / "goodput_vs_rate.png"))
    return written
