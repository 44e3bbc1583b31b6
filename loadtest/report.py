"""Results as JSON and as text.

A results file (format "pdserve-loadtest/1"):
  {"format", "label", "created_unix", "meta": {target, api, endpoint, model, workload, ..., warmup},
   "runs": [{"config": RunResult.config, "summary": metrics.summarize(...), "records": [RequestRecord...]}]}
One file holds one run, or one run per rate of a sweep. `plots.plot_goodput_vs_rate` reads several.
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from loadtest.metrics import PercentileSelection, percentile_key, summarize
from loadtest.records import RequestRecord
from loadtest.runner import RunResult, WarmupResult

FORMAT = "pdserve-loadtest/1"
LAG_WARN_S = 0.1


def results_document(label: str, meta: dict[str, Any], runs: list[RunResult], ttft_target_s: float | None,
                     tpot_target_s: float | None, percentiles: PercentileSelection | None = None) -> dict[str, Any]:
    """Returns: the JSON-ready document of these runs, each summarized against the targets with the
    selected percentiles (None: the default selection)."""
    return {"format": FORMAT, "label": label, "created_unix": time.time(), "meta": meta,
            "runs": [{"config": r.config,
                      "summary": summarize(r.records, max(r.wall_time_s, 1e-9), ttft_target_s, tpot_target_s,
                                           percentiles),
                      "records": [rec.to_dict() for rec in r.records]} for r in runs]}


def warmup_meta(warmup: WarmupResult) -> dict[str, Any]:
    """The results file's `meta.warmup`: requests, ok, errors_by_kind, wall_time_s."""
    return {"requests": warmup.requests, "ok": warmup.ok, "errors_by_kind": dict(warmup.errors_by_kind),
            "wall_time_s": warmup.wall_time_s}


def format_warmup(warmup: WarmupResult) -> str:
    """One line: how many warm-up requests ran before the measured runs (none of them is in any metric)."""
    if warmup.requests == 0:
        return "warm-up: none"
    errors = warmup.requests - warmup.ok
    kinds = ", ".join(f"{k}={v}" for k, v in warmup.errors_by_kind.items())
    return (f"warm-up: {warmup.requests} requests before the measured runs, {warmup.ok} ok"
            + (f", {errors} errors ({kinds})" if errors else "") + f", {warmup.wall_time_s:.2f} s; not in any metric")


def write_results(path: str | Path, doc: dict[str, Any]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(strict_json(doc), indent=1, allow_nan=False) + "\n")
    return path


def strict_json(obj: Any) -> Any:
    """`obj` with non-finite floats (an unlimited max duration, rate inf) as the strings "inf" / "nan",
    for strict JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: strict_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [strict_json(v) for v in obj]
    return obj


def load_results(path: str | Path) -> dict[str, Any]:
    """Args: a results file. Returns: its document. Raises: ValueError when it is not one."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read results file {path}: {e}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("runs"), list):
        raise ValueError(f"{path} is not a loadtest results file (format {FORMAT!r})")
    return doc


def run_records(run: dict[str, Any]) -> list[RequestRecord]:
    """The RequestRecords of one run of a loaded document."""
    return [RequestRecord.from_dict(d) for d in run.get("records", [])]


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.1f}"


def _burstiness(config: dict[str, Any]) -> str:
    b = config.get("burstiness", 1.0)
    return "" if b in (None, 1.0) else f", burstiness {float(b):g} (gamma arrivals)"


def _mode(config: dict[str, Any]) -> str:
    if config.get("mode") == "open":
        return f"open loop, {float(config['rate']):g} req/s{_burstiness(config)}"
    if config.get("mode") == "conversations":
        return (f"{config['conversations']} conversations at {float(config['rate']):g}/s{_burstiness(config)}, "
                f"think {config['think_s']:g} s")
    return f"closed loop, concurrency {config.get('concurrency')}"


def format_summary(config: dict[str, Any], summary: dict[str, Any]) -> str:
    """A few human-readable lines for one run."""
    mode = _mode(config)
    req, thr, gp = summary["requests"], summary["throughput"], summary["goodput"]
    lines = [f"== {mode}: {req['total']} requests, {req['ok']} ok, {req['errors']} errors "
             f"in {summary['wall_time_s']:.2f} s" + (" (stopped by max duration)"
                                                       if config.get("stopped_by_max_duration") else "")]
    if summary["errors_by_kind"]:
        lines.append("   errors: " + ", ".join(f"{k}={v}" for k, v in summary["errors_by_kind"].items()))
    if req.get("short_outputs"):
        lines.append(f"   {req['short_outputs']} successful requests got fewer tokens than asked for")
    sel = summary.get("percentiles") or {}  # files from before the selection: the default table
    columns = ["mean"] + [percentile_key(p) for p in sel.get("percentiles", PercentileSelection.percentiles)]
    shown = sel.get("metrics", PercentileSelection.metrics)
    lines.append(f"   {'ms':<6}" + "".join(f"{c:>9}" for c in columns))
    for metric, key, name in (("ttft", "ttft_s", "TTFT"), ("itl", "itl_s", "ITL"), ("tpot", "tpot_s", "TPOT"),
                              ("e2el", "e2e_s", "E2E")):
        if metric in shown:
            s = summary[key]
            lines.append(f"   {name:<6}" + "".join(f"{_ms(s.get(k)):>9}" for k in columns))
    if summary.get("turns"):
        for key, name in (("first_ttft_s", "TTFT turn 1"), ("later_ttft_s", "TTFT turns 2+")):
            t = summary["turns"][key]
            lines.append(f"   {name:<14} p50 {_ms(t['p50'])} ms, p90 {_ms(t['p90'])} ms ({t['count']} requests)")
    tokens = summary.get("prompt_tokens") or {}
    if tokens.get("server") is not None and tokens["server"] != tokens.get("workload"):
        lines.append(f"   prompt tokens: {tokens['server']} counted by the server, {tokens['workload']} by the "
                     "workload")
    if summary.get("prefix_cache"):
        pc = summary["prefix_cache"]
        lines.append(f"   prefix cache: {pc['cached_tokens']} of {pc['prompt_tokens']} prompt tokens "
                     f"({pc['fraction']:.0%})")
    lag = summary.get("send_lag_s", {}).get("max")
    if lag is not None and lag > LAG_WARN_S:
        lines.append(f"   warning: requests were sent up to {lag * 1000:.0f} ms behind schedule (client-bound)")
    lines.append(f"   throughput {thr['requests_per_s']:.3f} req/s, {thr['output_tokens_per_s']:.1f} output tok/s")
    targets = ", ".join(f"{n} <= {t:g} s" for n, t in (("TTFT", gp["ttft_target_s"]), ("TPOT", gp["tpot_target_s"]))
                        if t is not None) or "no targets"
    lines.append(f"   goodput {gp['requests_per_s']:.3f} req/s ({gp['good_requests']} requests, "
                 f"{gp['fraction']:.0%}; {targets})")
    return "\n".join(lines)
