"""`pdserve plan` flags and what each mode runs: a sweep (default), `--validate URL`, `--watch --address URL`
(with `--apply`: the recommended split pinned on the server, `planner.watch`).

A planned request starts as a line of the trace (`--trace`), is simulated on the profile (`--cost-model`
measured, or `--roofline` + `--device`) by `planner.sim`, for every candidate `planner.plan` sweeps.
The engine and router flags shared with `pdserve serve` come from the same config fields
(`pdserve.flags`), so their defaults and help are `serve`'s.

Boundary rule: never imports Ray, no torch.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from engine.config import EngineConfig
from loadtest.report import strict_json
from pdserve import flags
from planner.profiles import (
    AS_CALIBRATED,
    DEFAULT_EFFICIENCY,
    DEVICE_NAMES,
    ModelShape,
    ServingFactors,
    device,
    kv_memory_gib,
    roofline_cost_model,
)
from planner.traces import MOONCAKE_BLOCK_TOKENS, Trace, load_trace
from router.config import RouterConfig
from router.cost_model import load_cost_model
from router.policy import POLICIES

if TYPE_CHECKING:
    from planner.plan import Plan, Slo

# flags shared with `pdserve serve` (paths into its ServeConfig)
SHARED: tuple[flags.Path, ...] = (
    ("router", "ttft_target_s"), ("router", "tpot_target_s"), ("router", "max_queued"), ("router", "queue_timeout_s"),
    ("router", "prefix_aware"), ("engine", "max_num_batched_tokens"), ("engine", "prefill_chunk_tokens"),
    ("engine", "cache", "memory_gib"), ("engine", "cache", "block_size"), ("engine", "cache", "enable_prefix_caching"))


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def _policies(text: str) -> tuple[str, ...]:
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    bad = [n for n in names if n not in POLICIES]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"unknown policies {bad or text!r}; allowed: {', '.join(POLICIES)}")
    return names


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of `pdserve plan`."""
    from pdserve.serve import ServeConfig

    src = p.add_argument_group("trace")
    src.add_argument("--trace", default=None, help="a JSONL trace (timestamp ms / input_length / output_length / "
                     "optional hash_ids: the Mooncake format; or arrival_s / prompt_tokens / output_tokens), a load "
                     "generator results .json (replayed as measured), or a load generator workload (decode-heavy, "
                     "chat, fixed:P:O, prefix:K:P:S:O, ..., with --rate)")
    src.add_argument("--rate", type=float, default=None, help="a workload's arrival rate, requests/s (Poisson)")
    src.add_argument("--num-requests", type=int, default=1000, help="a workload's requests (default: %(default)s)")
    src.add_argument("--seed", type=int, default=0, help="a workload's seed, as the load generator's "
                     "(default: %(default)s)")
    src.add_argument("--run", type=int, default=0, help="which run of a results file (default: %(default)s)")
    src.add_argument("--hash-block-tokens", type=int, default=MOONCAKE_BLOCK_TOKENS,
                     help="prompt tokens per hash id of a JSONL trace (default: %(default)s, Mooncake's)")
    prof = p.add_argument_group("profile (one of)")
    prof.add_argument("--cost-model", default=None, help="a measured cost model: http://HOST:PORT of a running "
                      "pdserve (its /pdserve/cost_model) or a JSON file of one")
    prof.add_argument("--roofline", default=None, help="a model's config.json (or its directory): a roofline "
                      "profile on --device")
    prof.add_argument("--device", default="h100", help=f"--roofline's device: {', '.join(DEVICE_NAMES)} "
                      "(default: %(default)s)")
    prof.add_argument("--efficiency", default="", help="override the roofline's efficiency factors, e.g. "
                      "compute=0.5,memory=0.8 (fields: " + ", ".join(vars(DEFAULT_EFFICIENCY["gpu"])) + ")")
    prof.add_argument("--factors", default="", help="serving factors: how much longer than the cost model's "
                      "times served steps take, e.g. prefill=1.1,decode_step_s=0.02,prefill_beside=1.3 (what "
                      "--validate measured; default: as calibrated)")
    sw = p.add_argument_group("sweep")
    sw.add_argument("--budget", type=int, default=None, help="workers (devices) in all: every P:D split of them "
                    "(default: 4 unless --layouts)")
    sw.add_argument("--layouts", default=None, help="the splits to try instead, e.g. 1:3,2:2")
    sw.add_argument("--policies", type=_policies, default=POLICIES, help="placement policies to try (default: all)")
    sw.add_argument("--max-num-seqs", type=_ints, default=(EngineConfig.max_num_seqs,),
                    help="batch limits to try, comma-separated (default: %(default)s)")
    sw.add_argument("--jobs", type=int, default=1, help="simulations at once, one process each (default: 1)")
    flags.add_flags(p, SHARED, ServeConfig())
    p.set_defaults(kv_memory_gib=None)  # measured: serve's default; roofline: what the device leaves
    out = p.add_argument_group("output")
    out.add_argument("--out", default=None, help="write the plan as JSON here")
    out.add_argument("--plot", default=None, help="write a goodput-by-layout PNG here (needs matplotlib)")
    modes = p.add_argument_group("modes")
    modes.add_argument("--validate", default=None, metavar="URL", help="replay the trace on the running pdserve at "
                       "URL (started with the layout to check and --no-lend-threads) and print simulated vs "
                       "measured TTFT, TPOT and goodput")
    modes.add_argument("--vocab-size", type=int, default=49152, help="--validate: the model's vocabulary size "
                       "(token-id prompts; default: %(default)s, SmolLM2's)")
    modes.add_argument("--watch", action="store_true", help="read the live metrics of --address and recommend a "
                       "P:D split every --interval seconds")
    modes.add_argument("--address", default=None, help="--watch: http://HOST:PORT of a running pdserve")
    modes.add_argument("--interval", type=float, default=60.0, help="--watch: seconds per window (default: 60)")
    modes.add_argument("--rounds", type=int, default=None, help="--watch: windows to advise on (default: until "
                       "interrupted)")
    modes.add_argument("--apply", action="store_true", help="--watch: pin each recommended split on the server "
                       "(POST /pdserve/split) when it differs from the split now and the server can hold it (started "
                       "with --flip-roles; at most its prefill workers keep the prefill role); prints what was "
                       "applied or why not")
    modes.add_argument("--api-key", default=os.environ.get("PDSERVE_API_KEY"),
                       help="--watch: the server's API key (default: $PDSERVE_API_KEY)")


def _config(args: argparse.Namespace) -> tuple[RouterConfig, EngineConfig]:
    from pdserve.serve import ServeConfig

    memory = args.kv_memory_gib
    if memory is None:
        args.kv_memory_gib = ServeConfig().engine.cache.memory_gib
    cfg = flags.build(ServeConfig(), args, SHARED)
    args.kv_memory_gib = memory
    return cfg.router, cfg.engine


def _trace(args: argparse.Namespace) -> Trace:
    if not args.trace:
        raise ValueError("--trace is required (a JSONL trace, a results file, or a workload with --rate)")
    return load_trace(args.trace, num_requests=args.num_requests, rate=args.rate, seed=args.seed, run=args.run,
                      hash_block_tokens=args.hash_block_tokens)


def _profile(args: argparse.Namespace, trace: Trace, engine: EngineConfig):
    """The cost model and the KV GiB per worker."""
    if (args.cost_model is None) == (args.roofline is None):
        raise ValueError("give one profile: --cost-model (measured) or --roofline CONFIG --device NAME")
    if args.cost_model is not None:
        cost = load_cost_model(args.cost_model)
        return cost, args.kv_memory_gib or engine.cache.memory_gib
    shape, dev = ModelShape.from_config(args.roofline), device(args.device)
    eff = DEFAULT_EFFICIENCY[dev.kind].with_overrides(args.efficiency)
    n = len(trace.requests)
    context = max(1, round(sum(r.prompt_tokens + r.output_tokens / 2 for r in trace.requests) / n))
    cost = roofline_cost_model(shape, dev, eff, context, max(args.max_num_seqs), engine.prefill_chunk_tokens)
    return cost, args.kv_memory_gib or kv_memory_gib(shape, dev)


def run(args: argparse.Namespace) -> int:
    """Run the mode the flags ask for. Returns the exit status; raises ValueError for bad input."""
    from planner.plan import PlanSpec, Slo, layouts_within, parse_layouts, sweep
    from planner.sim import WorkerSpec

    router, engine = _config(args)
    slo = Slo(router.ttft_target_s, router.tpot_target_s)
    factors = AS_CALIBRATED.with_overrides(args.factors)
    if args.watch:
        from planner.watch import watch

        if not args.address:
            raise ValueError("--watch needs --address http://HOST:PORT of a running pdserve")
        watch(args.address, slo, args.policies, args.max_num_seqs[0], args.interval, args.rounds, pin=args.apply,
              api_key=args.api_key)
        return 0
    if args.apply:
        raise ValueError("--apply goes with --watch --address URL (it pins the split each round recommends)")
    trace = _trace(args)
    if args.validate:
        return _validate(args, trace, slo, factors)
    cost, memory = _profile(args, trace, engine)
    worker = WorkerSpec.from_memory(cost, memory, block_size=engine.cache.block_size,
                                    max_num_batched_tokens=engine.max_num_batched_tokens,
                                    prefill_chunk_tokens=engine.prefill_chunk_tokens,
                                    enable_prefix_caching=engine.cache.enable_prefix_caching)
    layouts = parse_layouts(args.layouts) if args.layouts else layouts_within(args.budget or 4)
    if args.layouts and args.budget:
        raise ValueError("give --budget or --layouts, not both")
    spec = PlanSpec(trace, cost, slo, layouts, args.policies, args.max_num_seqs, worker, router=router,
                    factors=factors)
    print(f"[plan] {len(spec.candidates())} simulations of {trace.describe()}", file=sys.stderr, flush=True)
    plan = sweep(spec, args.jobs, progress=lambda e: print(
        f"[plan] {e.candidate.layout.label} {e.candidate.policy} seqs {e.candidate.max_num_seqs}: goodput "
        f"{e.summary.goodput_rps:.3f} req/s ({e.sim_s:.2f} s)", file=sys.stderr, flush=True))
    print(plan.table())
    _write(args, plan)
    return 0


def _write(args: argparse.Namespace, plan: Plan) -> None:
    from planner.plan import plot

    if args.out:
        path = Path(args.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(strict_json(plan.to_json()), indent=1) + "\n")
        print(f"plan: {path}")
    if args.plot:
        png = plot(plan, args.plot)
        print(f"plot: {png}" if png else "plot: none (matplotlib is not installed: pip install 'pdserve[bench]')")


def _validate(args: argparse.Namespace, trace: Trace, slo: Slo, factors: ServingFactors) -> int:
    from dataclasses import asdict

    from planner.traces import from_workload
    from planner.validate import WorkloadRef, validate

    workload = None
    if not args.trace.endswith((".json", ".jsonl")) or args.trace.startswith("jsonl:"):
        workload = WorkloadRef(args.trace, args.num_requests, args.rate, args.seed)
        trace = from_workload(args.trace, args.num_requests, args.rate, args.seed)
    cmp = validate(args.validate, trace, slo, args.max_num_seqs[0], args.vocab_size, workload,
                   fallback_policy=args.policies[0], factors=factors)
    print(trace.describe())
    print(cmp.table())
    if args.out:
        Path(args.out).write_text(json.dumps(strict_json({"trace": trace.describe(), "slo": asdict(slo),
                                                      "layout": cmp.layout.label, "policy": cmp.policy,
                                                      "simulated": asdict(cmp.simulated),
                                                      "measured": asdict(cmp.measured),
                                                      "factors": asdict(cmp.factors),
                                                      "simulated_factors_1": asdict(cmp.plain) if cmp.plain else None,
                                                      "served_steps": asdict(cmp.served) if cmp.served else None,
                                                      "simulated_served_steps": asdict(cmp.at_served) if (
                                                          cmp.at_served) else None,
                                                      "measured_factors": asdict(fitted) if (
                                                          fitted := cmp.measured_factors()) else None,
                                                      "by_class": [asdict(c) for c in cmp.classes],
                                                      "requests": {
                                                          "simulated": [r.to_dict() for r in cmp.simulated_records],
                                                          "measured": [r.to_dict() for r in cmp.measured_records]}}),
                                        indent=1) + "\n")
    return 0
