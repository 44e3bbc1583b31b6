"""Command line: `python -m loadtest ...` (also `pdserve bench serve`) and `python -m loadtest compare ...`.

  python -m loadtest --target http://127.0.0.1:8000 --api openai --workload decode-heavy --rates 0.5,1,2 \\
      --num-requests 50 --ttft-target 2 --tpot-target 0.15 --vocab-size 49152 --out r.json --plots plots/
  python -m loadtest --target http://127.0.0.1:8000 --endpoint chat --workload fixed:512:128 --rate 4 \\
      --burstiness 0.5 --num-warmups 8 --metric-percentiles 50,90,99,99.9 --percentile-metrics ttft,tpot,itl
  python -m loadtest compare a.json b.json --out goodput.png
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path
from typing import Any

from loadtest.clients import APIS, ENDPOINTS, make_client
from loadtest.metrics import PERCENTILE_METRICS, PercentileSelection
from loadtest.report import (
    format_summary,
    format_warmup,
    load_results,
    results_document,
    warmup_meta,
    write_results,
)
from loadtest.runner import (
    REPLIES,
    STAND_IN,
    RunResult,
    WarmupResult,
    run_closed_loop,
    run_conversations,
    run_open_loop,
    warm_up,
)
from loadtest.workload import (
    RequestSpec,
    WorkloadError,
    build_workload,
    load_token_counter,
    run_seed,
    warmup_seed,
)

API_KEY_ENV = "PDSERVE_API_KEY"


def positive_float(text: str) -> float:
    """argparse type: a number > 0 (inf allowed: a rate of inf sends all at once)."""
    try:
        v = float(text)
    except ValueError:
        v = -1.0
    if not v > 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return v


def _non_negative_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        v = -1
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return v


def _endpoint(text: str) -> str:
    """An endpoint's name (completions, chat) or its path (/v1/completions, /v1/chat/completions: vLLM's
    --endpoint) → its name."""
    by_path = {path: name for name, path in ENDPOINTS.items()}
    name = by_path.get(text.rstrip("/") or text, text)
    if name not in ENDPOINTS:
        allowed = ", ".join(f"{n} ({p})" for n, p in ENDPOINTS.items())
        raise argparse.ArgumentTypeError(f"expected one of {allowed}, got {text!r}")
    return name


def _percentiles(text: str) -> tuple[float, ...]:
    try:
        return PercentileSelection.parse(percentiles=text).percentiles
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _percentile_metrics(text: str) -> tuple[str, ...]:
    try:
        return PercentileSelection.parse(metrics=text).metrics
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _rates(text: str) -> list[float]:
    return [positive_float(t.strip()) for t in text.split(",") if t.strip()] or _rates("x")


def _token_range(text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(t) for t in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO:HI (token ids in [LO, HI)), got {text!r}") from None
    if not 0 <= lo < hi:
        raise argparse.ArgumentTypeError(f"token range {text!r} must have 0 <= LO < HI")
    return lo, hi


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Adds the load-test flags to a parser (for `pdserve bench serve`)."""
    p.add_argument("--target", required=True, help="server: base URL for --api openai (http://HOST:PORT), "
                   "HOST:PORT for --api grpc")
    p.add_argument("--api", choices=APIS, default="openai", help="openai: POST /v1/completions or "
                   "/v1/chat/completions (any OpenAI-compatible server); grpc: pdserve's GenerationService "
                   "(default: openai)")
    p.add_argument("--endpoint", type=_endpoint, default="completions", help="--api openai: completions (POST "
                   "/v1/completions, the prompt as is) or chat (POST /v1/chat/completions, the prompt as one user "
                   "message, a multi-turn workload's history as its messages; text prompts only); the paths are "
                   "accepted too, as vLLM's --endpoint (default: completions)")
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV) or None, help="API key, sent as a Bearer "
                   f"token (default: ${API_KEY_ENV}; none when unset)")
    p.add_argument("--model", default=None, help="model name to send (default: none; the server's own)")
    p.add_argument("--workload", default="decode-heavy", help="fixed:P:O, prompt-heavy (2000/50), decode-heavy "
                   "(200/1000), chat, mixed[:F], mix:P:O,P:O..., multi-turn[:TURNS:SYSTEM:USER:OUTPUT] (the "
                   "requests as conversations; rates are conversations/s), prefix:K:P:S:O (K shared prefixes), "
                   "or a JSONL file (default: decode-heavy)")
    load = p.add_mutually_exclusive_group(required=True)
    load.add_argument("--rate", "--request-rate", type=positive_float, help="open loop: Poisson arrivals "
                      "(gamma with --burstiness), requests/s (inf: all at once)")
    load.add_argument("--rates", type=_rates, help="open-loop sweep: comma-separated rates, one run each")
    load.add_argument("--concurrency", type=int, help="closed loop: requests kept in flight")
    p.add_argument("--burstiness", type=positive_float, default=1.0, help="open loop: shape of the gamma "
                   "distribution of the gaps between arrivals, mean 1/rate: 1 is Poisson, < 1 burstier, > 1 more "
                   "uniform, inf constant gaps (default: %(default)g)")
    p.add_argument("--num-requests", "--num-prompts", type=int, default=50, help="requests per run (default: 50)")
    p.add_argument("--num-warmups", "--warmup", type=_non_negative_int, default=0, help="requests sent and "
                   "awaited before the measured runs (all at once, or at --concurrency), counted in no metric; "
                   "prompts of the same workload drawn with their own seed (default: %(default)s)")
    p.add_argument("--think-time", type=float, default=1.0, help="multi-turn: seconds between a turn's end and "
                   "the conversation's next turn (default: 1)")
    p.add_argument("--replies", choices=REPLIES, default=STAND_IN, help="multi-turn: the history's replies: the "
                   "workload's seeded stand-ins, the same prompts for every server (stand-in, the default), or the "
                   "server's own answers, as a chat client resends them (answered; a token-id prompt resends their "
                   "ids, asked with return_token_ids)")
    p.add_argument("--max-duration", type=positive_float, default=600.0, help="seconds per run; then in-flight "
                   "requests are cancelled (default: 600)")
    p.add_argument("--timeout", type=positive_float, default=300.0, help="per-request timeout, s (default: 300)")
    p.add_argument("--ttft-target", type=positive_float, default=2.0, help="goodput: TTFT target, s (default: 2)")
    p.add_argument("--tpot-target", type=positive_float, default=0.15,
                   help="goodput: TPOT target, s (default: 0.15)")
    p.add_argument("--metric-percentiles", "--percentiles", type=_percentiles, default=None, help="comma-"
                   "separated percentiles in [0, 100] to report (e.g. 50,90,99,99.9); the results JSON keeps p50, "
                   "p90 and p99 of every metric besides (default: "
                   f"{','.join(f'{p:g}' for p in PercentileSelection.percentiles)})")
    p.add_argument("--percentile-metrics", type=_percentile_metrics, default=None, help="comma-separated metrics "
                   f"that get --metric-percentiles and are shown: {', '.join(PERCENTILE_METRICS)} (default: "
                   f"{','.join(PercentileSelection.metrics)})")
    p.add_argument("--vocab-size", type=int, default=None, help="send token-id prompts of exact lengths, ids in a "
                   "range free of special tokens (e.g. 49152 for SmolLM2)")
    p.add_argument("--token-range", type=_token_range, default=None, help="token-id prompts with ids in [LO, HI)")
    p.add_argument("--tokenizer", default=None, help="tokenizer.json or a model directory: text prompts "
                   "calibrated to exact lengths")
    p.add_argument("--max-context", type=int, default=8192, help="most prompt + output tokens per request "
                   "(default: 8192)")
    p.add_argument("--seed", type=int, default=0, help="seeds lengths, prompts and arrivals (default: 0)")
    p.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos (servers that refuse "
                   "it); outputs may then stop early")
    p.add_argument("--label", default=None, help="name of this server/config in results and plots "
                   "(default: API@TARGET)")
    p.add_argument("--out", default=None, help="write the results JSON here")
    p.add_argument("--plots", default=None, help="write PNG charts into this directory")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _specs(args: argparse.Namespace, seed: int, n: int | None = None) -> list[RequestSpec]:
    """n requests of the workload (None: --num-requests) drawn with `seed`."""
    counter = load_token_counter(args.tokenizer) if args.tokenizer else None
    if seed == args.seed and args.vocab_size is None and args.token_range is None and counter is None:
        print("loadtest: no --vocab-size, --token-range or --tokenizer: text prompts of about one token per "
              "word (prompt lengths approximate)", file=sys.stderr)
    return build_workload(args.workload, args.num_requests if n is None else n, seed, args.max_context,
                          args.vocab_size, args.token_range, counter)


async def _run_all(args: argparse.Namespace, specs: list[RequestSpec]) -> tuple[WarmupResult, list[RunResult]]:
    """The warm-up, then one run per rate (or the closed loop); `specs` are the first run's, each later run
    draws its own."""
    client = make_client(args.api, args.target, args.model, args.timeout, not args.no_ignore_eos, args.api_key,
                         args.endpoint)
    progress = not args.no_progress
    try:
        if args.num_warmups and progress:
            print(f"loadtest: warming up with {args.num_warmups} requests", file=sys.stderr)
        warmup = await warm_up(client, _specs(args, warmup_seed(args.seed), args.num_warmups) if args.num_warmups
                               else [], args.concurrency, args.max_duration)
        if args.concurrency is not None:
            return warmup, [await run_closed_loop(client, specs, args.concurrency, args.max_duration, progress)]
        runs = []
        for i, rate in enumerate(args.rates if args.rates is not None else [args.rate]):
            seed = run_seed(args.seed, i)
            run_specs = specs if i == 0 else _specs(args, seed)
            if any(s.conversation is not None for s in run_specs):
                runs.append(await run_conversations(client, run_specs, rate, args.think_time, seed, args.max_duration,
                                                    progress, args.burstiness, args.replies))
            else:
                runs.append(await run_open_loop(client, run_specs, rate, seed, args.max_duration, progress,
                                                args.burstiness))
        return warmup, runs
    finally:
        await client.aclose()


def _flag_errors(args: argparse.Namespace, specs: list[RequestSpec]) -> str | None:
    """What is wrong with a combination of flags (each alone already parsed), or None."""
    if args.out and Path(args.out).is_dir():  # found now, not after the run has been measured
        return f"--out {args.out} is a directory; give the results file's path, e.g. {Path(args.out) / 'results.json'}"
    if args.concurrency is not None and args.burstiness != 1.0:
        return ("--burstiness shapes open-loop arrivals (--rate or --rates); a closed loop (--concurrency) has "
                "none")
    if args.endpoint != "completions" and args.api != "openai":
        return f"--endpoint {args.endpoint} is an OpenAI HTTP endpoint; use it with --api openai"
    if args.endpoint == "chat" and any(s.prompt_text is None for s in specs):
        return ("--endpoint chat sends text messages, and this workload's prompts are token ids (--vocab-size, "
                "--token-range or a JSONL file's prompt_token_ids); use --tokenizer for text of exact lengths, "
                "or neither for approximate ones")
    return None


def _percentile_selection(args: argparse.Namespace) -> PercentileSelection:
    given = {"percentiles": args.metric_percentiles, "metrics": args.percentile_metrics}
    return PercentileSelection(**{k: v for k, v in given.items() if v is not None})


def run(args: argparse.Namespace) -> int:
    """Runs the load test the flags describe, prints summaries, writes JSON and plots.
    Returns: 0, 1 when every request failed, 2 for a bad workload or flag."""
    if args.num_requests < 1 or (args.concurrency is not None and args.concurrency < 1):
        print("loadtest: error: --num-requests and --concurrency must be >= 1", file=sys.stderr)
        return 2
    if args.think_time < 0:
        print("loadtest: error: --think-time must be >= 0 s", file=sys.stderr)
        return 2
    try:
        specs = _specs(args, args.seed)
    except WorkloadError as e:
        print(f"loadtest: error: {e}", file=sys.stderr)
        return 2
    if args.concurrency is not None and any(s.conversation is not None for s in specs):
        print("loadtest: error: a multi-turn workload runs conversations at a rate (--rate or --rates, "
              "conversations/s; inf: all at once), not --concurrency", file=sys.stderr)
        return 2
    problem = _flag_errors(args, specs)
    if problem:
        print(f"loadtest: error: {problem}", file=sys.stderr)
        return 2
    warmup, runs = asyncio.run(_run_all(args, specs))
    meta: dict[str, Any] = {"target": args.target, "api": args.api, "endpoint": args.endpoint,
                            "model": args.model, "workload": args.workload, "ignore_eos": not args.no_ignore_eos,
                            "prompt_form": "token_ids" if specs[0].prompt_token_ids is not None else "text",
                            "timeout_s": args.timeout, "warmup": warmup_meta(warmup)}
    doc = results_document(args.label or f"{args.api}@{args.target}", meta, runs, args.ttft_target,
                           args.tpot_target, _percentile_selection(args))
    if warmup.requests:
        print(format_warmup(warmup))
    for r in doc["runs"]:
        print(format_summary(r["config"], r["summary"]))
    if args.out:
        print(f"results: {write_results(args.out, doc)}")
    if args.plots:
        from loadtest.plots import write_plots

        for path in write_plots(doc, args.plots):
            print(f"plot: {path}")
    return 1 if all(r["summary"]["requests"]["ok"] == 0 for r in doc["runs"]) else 0


def add_compare_arguments(p: argparse.ArgumentParser) -> None:
    """Adds the flags of `compare` (goodput vs rate of several results files on one chart)."""
    p.add_argument("results", nargs="+", help="results JSON files (from --out), one label each")
    p.add_argument("--out", default="goodput_vs_rate.png", help="the PNG to write (default: goodput_vs_rate.png)")


def run_compare(args: argparse.Namespace) -> int:
    """Plots goodput vs rate of the given results files. Returns: 0, or 2 when a file is unusable."""
    from loadtest.plots import plot_goodput_vs_rate

    try:
        docs = [load_results(p) for p in args.results]
        print(f"plot: {plot_goodput_vs_rate(docs, args.out)}")
    except ValueError as e:
        print(f"loadtest: error: {e}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["compare"]:
        p = argparse.ArgumentParser(prog="python -m loadtest compare",
                                    description="goodput vs rate of several load-test results on one chart")
        add_compare_arguments(p)
        return run_compare(p.parse_args(argv[1:]))
    p = argparse.ArgumentParser(prog="python -m loadtest", description="load test an LLM server (pdserve gRPC or "
                                "any OpenAI-compatible HTTP server); `python -m loadtest compare -h` for charts")
    add_arguments(p)
    return run(p.parse_args(argv))

