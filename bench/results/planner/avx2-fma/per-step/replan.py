"""Re-simulate the saved AVX2 + FMA validation runs (run 3, `../1p1d`, `../0p1d`) offline: with the
factors each run was validated with (the light run's decode factor) and with the light run's decode
time per step (`ServingFactors.decode_step_s`, decode 1), against what each run measured.
Usage (from the repository): .venv/bin/python bench/results/planner/avx2-fma/per-step/replan.py"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from planner.profiles import ServingFactors, load_cost_model
from planner.sim import WorkerSpec, simulate
from planner.traces import load_trace
from planner.validate import ServedSteps, server_layout
from router.config import RouterConfig

HERE = Path(__file__).resolve().parent
RUNS = HERE.parent
SLO = (10.0, 0.15)  # TTFT=10 TPOT=0.15, as the runs
TRACES = {"calib": ("fixed:256:64", 0.3, 16, 5), "decode": ("fixed:128:128", 0.5, 40, 0),
          "prompt": ("fixed:1024:16", 0.08, 20, 0), "mixed": (str(RUNS / "mixed.jsonl"), None, 1000, 0)}
FIELDS = (("TTFT p50", "ttft_p50_s"), ("TPOT p50", "tpot_p50_s"), ("goodput", "goodput_rps"))


def sim(layout_dir: Path, name: str, factors: ServingFactors):
    cost = load_cost_model(str(layout_dir / "cost_model.json"))
    spec, rate, n, seed = TRACES[name]
    trace = load_trace(spec, num_requests=n, rate=rate, seed=seed)
    lay = server_layout((layout_dir / "calib.metrics").read_text())
    chunk = cost.prefill_chunk_tokens or WorkerSpec.prefill_chunk_tokens
    decode = WorkerSpec(lay.decode_blocks, max_num_seqs=64, prefill_chunk_tokens=chunk)
    prefill = WorkerSpec(lay.prefill_blocks, max_num_seqs=64, prefill_chunk_tokens=chunk) if lay.prefill_blocks else None
    router = RouterConfig(policy=lay.policy or "ratio", ttft_target_s=SLO[0], tpot_target_s=SLO[1])
    return simulate(trace, cost, lay.layout, decode, router, prefill_worker=prefill, factors=factors).summary(*SLO)


def ratio(a, b):
    return a / b if a and b else (1.0 if a == b else 0.0)


def main() -> None:
    out, within = [], {"factor": 0, "per step": 0}
    for layout in ("1p1d", "0p1d"):
        d = RUNS / layout
        calib = json.loads((d / "calib.json").read_text())
        served = ServedSteps(**calib["served_steps"])
        run_factors = ServingFactors(**json.loads((d / "decode.json").read_text())["factors"])
        per_step = served.factors(ServingFactors())
        at = sim(d, "calib", per_step)  # the light run's latency, as --validate fits it
        per_step = replace(per_step, latency_s=max(0.0, calib["measured"]["ttft_p50_s"] - at.ttft_p50_s))
        out.append(f"{layout}: run 3's factors {run_factors.describe()}; per step {per_step.describe()}")
        for name in ("decode", "prompt", "mixed"):
            meas = json.loads((d / f"{name}.json").read_text())["measured"]
            row = [f"{layout} {name}"]
            for label, factors in (("factor", run_factors), ("per step", per_step)):
                s = sim(d, name, factors)
                cells = []
                for _, field in FIELDS:
                    r = ratio(getattr(s, field), meas[field])
                    within[label] += abs(r - 1) <= 0.15
                    cells.append(f"{r:.2f}")
                row.append(f"{label}: " + " ".join(cells))
            out.append("  " + " | ".join(row))
    out.append(f"within 15% (TTFT p50, TPOT p50, goodput; 18 each): {within}")
    text = "\n".join(out)
    print(text)
    (HERE / "result.txt").write_text(text + "\n")


if __name__ == "__main__":
    main()
