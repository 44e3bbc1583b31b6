"""`pdserve bench split`: a node's cores as one engine with all their threads, or as one engine per
core: what each gives decode and prefill, on this machine, in one run.

This is the measurement behind how pdserve moves compute between roles on a node. Lending a prefill
worker's threads to the decode worker beside it (`--lend-threads`) pays only if a decode step gets
faster with more threads; a second decode engine (a prefill worker serving decode, a role flip)
pays if decode throughput grows with engines. Layouts, each in fresh processes (a process's torch
thread count is process-wide), run one after the other and interleaved over `--reps`:
1. `one engine x N threads`: one process, N threads, decode batch B;
2. `N engines x 1 thread`: N processes at once, 1 thread each, decode batch B / N each (the same
   B sequences in all), started together at a barrier before every timed part.
For each batch: median decode step over `--steps` steps, tokens per second summed over engines.
Then prefill of one `--prompt-len` prompt: one engine with N threads (a prefill worker with a loan
of the node's threads), one with 1 thread (without it), and N single-thread engines at once (their
summed tokens per second). Writes raw JSON and prints a markdown table naming the machine class.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import random
import statistics
import time
from typing import Any

from pdserve.bench.engine import THREADS, log, machine_info, save_results


def _engine_process(cfg: dict[str, Any], threads: int, index: int, barrier: Any, results: Any) -> None:
    """One engine with `threads` threads: every timed part starts at `barrier` with its siblings'."""
    import torch

    from engine import CacheConfig, EngineConfig, LLMEngine, SamplingParams

    torch.set_num_threads(threads)
    cache = CacheConfig(memory_gib=1.0, enable_prefix_caching=False)
    eng = LLMEngine(EngineConfig(model=cfg["model"], dtype=cfg["dtype"], num_threads=threads, compile=cfg["compile"],
                                 cache=cache))
    rng = random.Random(index)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, eng.vocab_size) for _ in range(n)]  # random: no prefix-cache hits

    out: dict[str, Any] = {"dtype": eng.config.dtype, "decode_step_s": {}}
    steps = cfg["steps"]
    for batch in cfg["batches"]:
        ids = [eng.add_request(prompt(cfg["context"]), SamplingParams(max_tokens=steps + 4, ignore_eos=True))
               for _ in range(batch)]
        while eng.scheduler.has_prefill_work():  # untimed: the batch's prompts
            eng.step()
        eng.step()  # a first decode step at this batch size, untimed (its rows' first touch)
        barrier.wait()
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            eng.step()
            times.append(time.perf_counter() - t0)
        out["decode_step_s"][batch] = statistics.median(times)
        for rid in ids:
            eng.abort(rid)
        barrier.wait()  # nobody's untimed prefill overlaps another's timed steps
    eng.add_request(prompt(64), SamplingParams(max_tokens=1))  # warm-up of the prefill path
    while eng.has_unfinished():
        eng.step()
    barrier.wait()
    t0 = time.perf_counter()
    eng.add_request(prompt(cfg["prompt_len"]), SamplingParams(max_tokens=1))
    while eng.has_unfinished():
        eng.step()
    out["prefill_s"] = time.perf_counter() - t0
    results.put((index, out))


def _run_layout(cfg: dict[str, Any], engines: int, threads: int, batch_of: dict[int, int]) -> list[dict[str, Any]]:
    """Run `engines` processes of `threads` threads each at once; `batch_of`: node batch -> each engine's."""
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(engines), ctx.Queue()
    procs = [ctx.Process(target=_engine_process, args=(dict(cfg, batches=list(batch_of.values())), threads, i,
                                                         barrier, results), daemon=True) for i in range(engines)]
    for p in procs:
        p.start()
    outs = [results.get(timeout=1800) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        if p.exitcode != 0:
            raise RuntimeError(f"an engine process of the {engines} x {threads} layout exited with {p.exitcode}")
    return [o for _, o in sorted(outs, key=lambda x: x[0])]


def _summary(outs: list[dict[str, Any]], batch_of: dict[int, int], prompt_len: int) -> dict[str, Any]:
    """Summed decode tokens per second for each node batch, and summed prefill tokens per second."""
    return {"decode_tok_s": {b: sum(each / o["decode_step_s"][each] for o in outs) for b, each in batch_of.items()},
            "decode_step_s": {b: max(o["decode_step_s"][each] for o in outs) for b, each in batch_of.items()},
            "prefill_tok_s": sum(prompt_len / o["prefill_s"] for o in outs)}


def run_split(args: argparse.Namespace) -> int:
    n = args.threads
    batches = [int(b) for b in args.batches.split(",")]
    if n < 2 or any(b % n for b in batches):
        raise ValueError(f"--threads must be >= 2 and divide every batch in --batches; got {n} and {batches}")
    cfg = {"model": args.model, "dtype": args.dtype, "compile": not args.no_compile, "steps": args.steps,
           "context": args.context, "prompt_len": args.prompt_len}
    layouts = {f"one engine x {n} threads": (1, n, {b: b for b in batches}),
               f"{n} engines x 1 thread": (n, 1, {b: b // n for b in batches}),
               "one engine x 1 thread": (1, 1, {})}  # prefill only: a prefill worker without a loan
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in layouts}
    for rep in range(args.reps):
        for name, (engines, threads, batch_of) in layouts.items():
            if not batch_of and rep:  # one prefill figure of a lone 1-thread engine is enough
                continue
            log(f"rep {rep + 1}/{args.reps}: {name}")
            outs = _run_layout(cfg, engines, threads, batch_of)
            cfg["dtype"] = outs[0]["dtype"]  # auto settled: every later layout runs the same
            runs[name].append(_summary(outs, batch_of, args.prompt_len))
    res: dict[str, Any] = {"machine": machine_info(), "dtype": cfg["dtype"], "threads": n, "context": args.context,
                           "prompt_len": args.prompt_len, "steps": args.steps, "reps": args.reps,
                           "compile": cfg["compile"], "batches": batches, "runs": runs}
    out = save_results(res, "split", args.out)
    print(render(res))
    log(f"wrote {out}")
    return 0


def _median(runs: list[dict[str, Any]], *keys: Any) -> float:
    vals = []
    for r in runs:
        for k in keys:
            r = r[k]
        vals.append(r)
    return statistics.median(vals)


def render(res: dict[str, Any]) -> str:
    """The markdown table for BENCHMARKS.md: medians over the reps."""
    m, n, runs = res["machine"], res["threads"], res["runs"]
    one, split, alone = f"one engine x {n} threads", f"{n} engines x 1 thread", "one engine x 1 thread"
    lines = [(f"{m['machine_class']} ({m['cpu']}), {res['dtype']}, decode step "
              f"{'compiled' if res['compile'] else 'eager'}, sequences of {res['context']} tokens, median of "
              f"{res['reps']} interleaved runs. Command: `{m['command']}`"), "",
             f"| decode batch (node) | {one}: tok/s (step) | {split}: tok/s (slowest step) | {split} / {one} |",
             "|---|---|---|---|"]
    for b in res["batches"]:
        a, s = _median(runs[one], "decode_tok_s", b), _median(runs[split], "decode_tok_s", b)
        lines.append(f"| {b} | {a:.1f} ({_median(runs[one], 'decode_step_s', b) * 1e3:.0f} ms) | {s:.1f} "
                     f"({_median(runs[split], 'decode_step_s', b) * 1e3:.0f} ms) | {s / a:.2f}x |")
    lines += ["", f"| prefill of {res['prompt_len']} tokens | tok/s |", "|---|---|"]
    for name, label in ((one, f"one engine x {n} threads (a loan)"), (alone, "one engine x 1 thread"),
                        (split, f"{n} engines x 1 thread at once (summed)")):
        lines.append(f"| {label} | {_median(runs[name], 'prefill_tok_s'):.0f} |")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from engine.config import DTYPES, EngineConfig

    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default=EngineConfig.dtype, choices=[d for d in DTYPES if d != "float16"])
    p.add_argument("--threads", type=int, default=THREADS, help="the node's cores to split (default: %(default)s)")
    p.add_argument("--batches", default="8,16,32", help="decode batch sizes of the node (default: %(default)s)")
    p.add_argument("--context", type=int, default=256, help="tokens per decoding sequence")
    p.add_argument("--steps", type=int, default=8, help="timed decode steps per batch")
    p.add_argument("--prompt-len", type=int, default=1024, help="the prefill prompt's length")
    p.add_argument("--reps", type=int, default=2, help="interleaved repetitions of each layout")
    p.add_argument("--no-compile", action="store_true", help="eager decode steps")
    p.add_argument("--out", default=None, help="JSON results (default: bench/results/split-CLASS.json)")
