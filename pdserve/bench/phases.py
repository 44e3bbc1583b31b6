"""`pdserve bench phases`: where prefill dominates and where decode does, measured on a running server.

For each (prompt tokens, output tokens) of a grid, one request with exactly that many prompt
tokens (token ids) and fixed output length (`ignore_eos`) goes to the server's OpenAI API; the
server's own phase timings (`usage.pdserve_timings`) split its time into prefill and decode. The
router's calibrated cost model (`GET /pdserve/cost_model`) predicts the same split; the chart shows
both, so users see where the model is right and where decode dominates wall-clock time.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
import urllib.request
from pathlib import Path

from tqdm import tqdm


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def _complete(base: str, model: str, prompt: list[int], max_tokens: int) -> dict:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True}).encode()
    req = urllib.request.Request(base + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=1800) as r:
        out = json.loads(r.read())
    out["wall_s"] = time.perf_counter() - t0
    return out


def predict(cost: dict, prompt: int, output: int) -> tuple[float, float]:
    """(prefill seconds, decode seconds) the cost model predicts for one request alone on the remote path."""
    from router.cost_model import CostModel

    model = CostModel.from_dict(cost)
    return model.prefill_s(prompt) + model.exposed_transfer_s(prompt), max(0, output - 1) * model.step_s(1)


def run_phases(args: argparse.Namespace) -> int:
    base = args.target.rstrip("/")
    model = args.model or _get(base + "/v1/models")["data"][0]["id"]
    cost = _get(base + "/pdserve/cost_model")
    rng = random.Random(args.seed)
    rows = []
    grid = [(p, o) for p in args.prompt_lens for o in args.output_lens]
    for p, o in tqdm(grid, desc="phases", unit="req", file=sys.stderr):
        prompt = [rng.randrange(100, min(args.vocab_size, 30000)) for _ in range(p)]
        out = _complete(base, model, prompt, o)
        t = out["usage"]["pdserve_timings"]
        pred_prefill, pred_decode = predict(cost, p, o)
        rows.append({"prompt_tokens": p, "output_tokens": o, "path": t["path"], "queue_s": t["queue_s"],
                     "prefill_s": t["prefill_s"] + t["transfer_s"], "decode_s": t["decode_s"],
                     "wall_s": out["wall_s"], "predicted_prefill_s": pred_prefill,
                     "predicted_decode_s": pred_decode})
    result = {"target": base, "model": model, "cost_model": cost, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    if args.plot:
        plot_phases(result, args.plot)
    print(format_table(rows))
    return 0


def format_table(rows: list[dict]) -> str:
    lines = ["| prompt | output | prefill s (model) | decode s (model) | decode share (model) |",
             "|---:|---:|---:|---:|---:|"]
    for r in rows:
        share = r["decode_s"] / max(1e-9, r["decode_s"] + r["prefill_s"])
        pshare = r["predicted_decode_s"] / max(1e-9, r["predicted_decode_s"] + r["predicted_prefill_s"])
        lines.append(f"| {r['prompt_tokens']} | {r['output_tokens']} | {r['prefill_s']:.2f} "
                     f"({r['predicted_prefill_s']:.2f}) | {r['decode_s']:.2f} ({r['predicted_decode_s']:.2f}) | "
                     f"{share:.0%} ({pshare:.0%}) |")
    return "\n".join(lines)


def plot_phases(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(8, 5))
    outputs = sorted({r["output_tokens"] for r in rows})
    for o in outputs:
        sel = sorted((r for r in rows if r["output_tokens"] == o), key=lambda r: r["prompt_tokens"])
        xs = [r["prompt_tokens"] for r in sel]
        line, = ax.plot(xs, [r["decode_s"] / (r["decode_s"] + r["prefill_s"]) for r in sel], "o-",
                        label=f"{o} output tokens: measured")
        ax.plot(xs, [r["predicted_decode_s"] / (r["predicted_decode_s"] + r["predicted_prefill_s"]) for r in sel],
                "--", color=line.get_color(), label=f"{o} output tokens: cost model")
    ax.axhline(0.5, color="grey", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("decode share of request time")
    ax.set_ylim(0, 1)
    ax.set_title("Where decode dominates (above 0.5) and where prefill does")
    ax.legend(fontsize=7)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="http://127.0.0.1:8000", help="a running pdserve's HTTP address")
    p.add_argument("--model", default=None, help="model id (default: the server's first)")
    p.add_argument("--prompt-lens", type=lambda s: [int(x) for x in s.split(",")], default=[32, 256, 1024])
    p.add_argument("--output-lens", type=lambda s: [int(x) for x in s.split(",")], default=[8, 64, 256])
    p.add_argument("--vocab-size", type=int, default=49152)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench/results/phases.json")
    p.add_argument("--plot", default="bench/results/phases.png")
