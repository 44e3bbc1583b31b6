"""Re-simulate saved `bench/validate_planner.sh` runs offline, with the serving factors fitted two ways
from each layout's light run: a factor on the decode rows (`decode`) and a time per step
(`decode_step_s`, decode 1), each with the light run's `prefill` factor and `latency_s` refitted as
`--validate` fits them; then each workload's TTFT p50, TPOT p50 and goodput against what it measured.

Usage (from the repository): .venv/bin/python bench/replan_saved.py RESULTS_DIR LAYOUT... \\
    [--ttft 1.2 --tpot 0.06 --calib-rate 0.5 --decode-rate 1.0 --prompt-rate 0.6 --prompt-requests 40
     --calib-trace fixed:256:64]
(the environment `bench/validate_planner.sh` ran with; RESULTS_DIR holds mixed.jsonl and LAYOUT/).
Writes RESULTS_DIR/replan-<layouts>.txt."""
from __future__ import annotations

import argparse
import json
from dataclasses import replace
from functools import partial
from pathlib import Path

from engine.config import EngineConfig
from planner.plan import Slo
from planner.profiles import ServingFactors
from planner.traces import load_trace
from planner.validate import ServedSteps, server_layout, simulate_server
from router.config import RouterConfig
from router.cost_model import load_cost_model

FIELDS = ("ttft_p50_s", "tpot_p50_s", "goodput_rps")
WORKLOADS = ("decode", "prompt", "mixed")


def fits(served: ServedSteps) -> dict[str, ServingFactors]:
    """The light run's factors both ways (latency still 0)."""
    prefill = served.prefill_factor or 1.0
    return {"factor": ServingFactors(prefill=prefill, decode=served.factor),
            "per step": served.factors(ServingFactors())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", type=Path)
    ap.add_argument("layouts", nargs="+")
    for name, default in (("ttft", 1.2), ("tpot", 0.06), ("calib-rate", 0.5), ("decode-rate", 1.0),
                          ("prompt-rate", 0.6), ("prompt-requests", 40), ("calib-trace", "fixed:256:64")):
        ap.add_argument(f"--{name}", type=type(default), default=default)
    args = ap.parse_args()
    slo = Slo(args.ttft, args.tpot)
    traces = {"calib": load_trace(args.calib_trace, num_requests=16, rate=args.calib_rate, seed=5),
              "decode": load_trace("fixed:128:128", num_requests=40, rate=args.decode_rate, seed=0),
              "prompt": load_trace("fixed:1024:16", num_requests=args.prompt_requests, rate=args.prompt_rate, seed=0),
              "mixed": load_trace(str(args.dir / "mixed.jsonl"))}
    out, within = [], {}
    for layout in args.layouts:
        d = args.dir / layout
        cost = load_cost_model(str(d / "cost_model.json"))
        lay = server_layout((d / "calib.metrics").read_text())
        sim = partial(simulate_server, cost=cost, server=lay, policy=lay.policy or RouterConfig().policy, slo=slo,
                      max_num_seqs=EngineConfig.max_num_seqs)
        calib = json.loads((d / "calib.json").read_text())
        models = fits(ServedSteps(**calib["served_steps"]))
        for label, f in models.items():
            late = calib["measured"]["ttft_p50_s"] - sim(traces["calib"], factors=f).ttft_p50_s
            models[label] = replace(f, latency_s=max(0.0, late))
            out.append(f"{layout}, {label}: {models[label].describe()}")
        for name in WORKLOADS:
            if not (d / f"{name}.json").exists():
                continue
            meas = json.loads((d / f"{name}.json").read_text())["measured"]
            row = []
            for label, f in models.items():
                s = sim(traces[name], factors=f)
                ratios = [getattr(s, k) / meas[k] if meas[k] else float(getattr(s, k) == meas[k]) for k in FIELDS]
                within[label] = within.get(label, 0) + sum(abs(r - 1) <= 0.15 for r in ratios)
                row.append(f"{label}: " + " ".join(f"{r:.2f}" for r in ratios))
            out.append(f"  {layout} {name} (TTFT p50, TPOT p50, goodput, sim / meas) | " + " | ".join(row))
    cells = len([1 for line in out if line.startswith("  ")]) * len(FIELDS)
    out.append(f"within 15%, of {cells}: " + ", ".join(f"{k} {v}" for k, v in within.items()))
    text = "\n".join(out)
    print(text)
    (args.dir / f"replan-{'-'.join(args.layouts)}.txt").write_text(text + "\n")


if __name__ == "__main__":
    main()
