"""`pdserve bench linear`: decode steps and a prefill with plain linear layers and with the ways
`linear="auto"` picks per group (packed for oneDNN, pdserve's kernel on the weight or on a blocked
copy), side by side on this machine.

For each thread count (one core, as a worker of the default layout computes, and the node's
`--threads`), one fresh process (torch's thread count is process-wide) holds two engines of the
same model: `linear="plain"` and `linear="auto"` (which measures every way and swaps the groups that
win, `engine.packed_linear`). For each decode batch both engines hold the same number of running
sequences; their timed windows of `--steps` steps alternate over `--reps` rounds, so both see the
same machine (this VM's speed drifts by tens of percent within minutes). Then one prefill of
`--prompt-len` tokens each, alternating too. Writes raw JSON and prints the markdown table.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import random
import statistics
import time
from typing import Any

from pdserve.bench.engine import THREADS, log, machine_info, save_results

SETTINGS = ("plain", "auto")


def _engines_process(cfg: dict[str, Any], threads: int, results: Any) -> None:
    import torch

    from engine import CacheConfig, EngineConfig, LLMEngine, SamplingParams

    torch.set_num_threads(threads)
    cache = CacheConfig(memory_gib=1.0, enable_prefix_caching=False)
    engines = {s: LLMEngine(EngineConfig(model=cfg["model"], dtype=cfg["dtype"], num_threads=threads,
                                         compile=cfg["compile"], linear=s, cache=cache)) for s in SETTINGS}
    rng = random.Random(threads)
    vocab = engines["plain"].vocab_size

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(n)]  # random: no prefix-cache hits

    out: dict[str, Any] = {"dtype": engines["plain"].config.dtype, "choice": engines["auto"].describe()["linear"],
                           "reason": engines["auto"].linear_choice.reason, "decode_step_s": {}, "prefill_s": {}}
    steps, reps = cfg["steps"], cfg["reps"]
    for batch in cfg["batches"]:
        held: dict[str, list[str]] = {}
        prompts = [prompt(cfg["context"]) for _ in range(batch)]
        for s, eng in engines.items():
            held[s] = [eng.add_request(p, SamplingParams(max_tokens=steps * reps + 8, ignore_eos=True))
                       for p in prompts]
            while eng.scheduler.has_prefill_work():  # untimed: the batch's prompts
                eng.step()
            eng.step()  # a first decode step at this batch size, untimed (its rows' first touch)
        times: dict[str, list[float]] = {s: [] for s in SETTINGS}
        for _ in range(reps):
            for s, eng in engines.items():
                for _ in range(steps):
                    t0 = time.perf_counter()
                    eng.step()
                    times[s].append(time.perf_counter() - t0)
        for s, eng in engines.items():
            out["decode_step_s"].setdefault(s, {})[batch] = statistics.median(times[s])
            for rid in held[s]:
                eng.abort(rid)
    prefill: dict[str, list[float]] = {s: [] for s in SETTINGS}
    long_prompt = prompt(cfg["prompt_len"])
    for _ in range(cfg["prefill_reps"]):
        for s, eng in engines.items():
            t0 = time.perf_counter()
            eng.add_request(long_prompt, SamplingParams(max_tokens=1))
            while eng.has_unfinished():
                eng.step()
            prefill[s].append(time.perf_counter() - t0)
    out["prefill_s"] = {s: statistics.median(v) for s, v in prefill.items()}
    results.put(out)


def _run(cfg: dict[str, Any], threads: int) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=_engines_process, args=(cfg, threads, results), daemon=True)
    proc.start()
    out = results.get(timeout=3600)
    proc.join(timeout=60)
    if proc.exitcode != 0:
        raise RuntimeError(f"the engines' process with {threads} threads exited with {proc.exitcode}")
    return out


def run_linear(args: argparse.Namespace) -> int:
    batches = [int(b) for b in args.batches.split(",")]
    if any(b < 1 for b in batches) or args.reps < 1 or args.steps < 1:
        raise ValueError(f"--batches, --reps and --steps must be >= 1; got {batches}, {args.reps}, {args.steps}")
    cfg = {"model": args.model, "dtype": args.dtype, "compile": not args.no_compile, "steps": args.steps,
           "reps": args.reps, "prefill_reps": 2, "context": args.context, "prompt_len": args.prompt_len,
           "batches": batches}
    runs: dict[int, dict[str, Any]] = {}
    for threads in sorted({1, args.threads}):
        log(f"{threads} thread(s): plain and auto engines, interleaved")
        runs[threads] = _run(cfg, threads)
        cfg["dtype"] = runs[threads]["dtype"]  # auto settled: every later run uses the same
    res: dict[str, Any] = {"machine": machine_info(), **cfg, "runs": runs}
    out = save_results(res, "linear", args.out)
    print(render(res))
    log(f"wrote {out}")
    return 0


def render(res: dict[str, Any]) -> str:
    """The markdown table for BENCHMARKS.md, and what `auto` packed at each thread count and why."""
    m = res["machine"]
    lines = [(f"{m['machine_class']} ({m['cpu']}), {res['dtype']}, decode step "
              f"{'compiled' if res['compile'] else 'eager'}, sequences of {res['context']}+ tokens, median step of "
              f"{res['reps']} alternating windows of {res['steps']}. Command: `{m['command']}`"), "",
             "| threads | decode batch | plain: step (tok/s) | auto: step (tok/s) | auto / plain |",
             "|---|---|---|---|---|"]
    for threads, run in res["runs"].items():
        for b in res["batches"]:
            p, a = run["decode_step_s"]["plain"][b], run["decode_step_s"]["auto"][b]
            lines.append(f"| {threads} | {b} | {p * 1e3:.0f} ms ({b / p:.1f}) | {a * 1e3:.0f} ms ({b / a:.1f}) | "
                         f"{p / a:.2f}x |")
        p, a = run["prefill_s"]["plain"], run["prefill_s"]["auto"]
        n = res["prompt_len"]
        lines.append(f"| {threads} | prefill {n} | {p:.2f} s ({n / p:.0f}) | {a:.2f} s ({n / a:.0f}) | {p / a:.2f}x |")
    lines.append("")
    for threads, run in res["runs"].items():
        lines.append(f"- {threads} thread(s): auto chose linear {run['choice']}; {run['reason']}.")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from engine.config import DTYPES, EngineConfig

    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default=EngineConfig.dtype, choices=[d for d in DTYPES if d != "float16"])
    p.add_argument("--threads", type=int, default=THREADS, help="the node's cores (default: %(default)s)")
    p.add_argument("--batches", default="1,4,10,16", help="decode batch sizes (default: %(default)s)")
    p.add_argument("--context", type=int, default=128, help="prompt tokens per decoding sequence")
    p.add_argument("--steps", type=int, default=6, help="decode steps per timed window")
    p.add_argument("--reps", type=int, default=3, help="alternating windows per engine and batch")
    p.add_argument("--prompt-len", type=int, default=1024, help="the prefill prompt's length")
    p.add_argument("--no-compile", action="store_true", help="eager decode steps")
    p.add_argument("--out", default=None, help="JSON results (default: bench/results/linear-CLASS.json)")
