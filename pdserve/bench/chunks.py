"""`pdserve bench chunks`: what the prefill chunk size costs and buys, on one engine, in one run.

For each chunk size (and whole prompts: one chunk as large as the step's token budget):
1. a long prompt arrives while a batch of sequences decodes: the longest gap between two of the
   running sequences' tokens while it prefills, their mean gap, the decode tokens they got in
   that time, and the long prompt's time to its first token;
2. the same prompt on an idle engine: prefill tokens per second (what chunking costs a prefill).
Writes raw JSON and prints a markdown table (for BENCHMARKS.md) naming the machine class.
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from pdserve.bench.engine import THREADS, log, machine_info, save_results

WHOLE = 0  # the chunk-size label of "whole prompts" (one chunk up to the step's token budget)


def _prompt(n: int, seed: int, vocab: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(100, vocab) for _ in range(n)]  # random: no prefix-cache hits


def _engine(args: argparse.Namespace, chunk: int) -> Any:
    from engine import CacheConfig, EngineConfig, LLMEngine

    budget = EngineConfig.max_num_batched_tokens
    cfg = EngineConfig(model=args.model, dtype=args.dtype, num_threads=THREADS, compile=not args.no_compile,
                       max_num_batched_tokens=budget, prefill_chunk_tokens=chunk or budget,
                       cache=CacheConfig(memory_gib=0.5, enable_prefix_caching=False))
    return LLMEngine(cfg)


def _arrival(eng: Any, args: argparse.Namespace) -> dict[str, float]:
    """The long prompt arrives while `args.batch` sequences decode."""
    from engine import SamplingParams

    vocab = eng.vocab_size
    running = SamplingParams(max_tokens=100_000, ignore_eos=True)
    for i in range(args.batch):
        eng.add_request(_prompt(args.context, i, vocab), running, request_id=f"run-{i}")
    while eng.scheduler.has_prefill_work():
        eng.step()
    steps = []
    for _ in range(4):  # decode steps before the arrival: the baseline gap
        t0 = time.perf_counter()
        eng.step()
        steps.append(time.perf_counter() - t0)
    eng.add_request(_prompt(args.prompt_len, 99, vocab), SamplingParams(max_tokens=1, ignore_eos=True),
                    request_id="long")
    gaps, decoded, t_arrival = [], 0, time.perf_counter()
    while True:
        t0 = time.perf_counter()
        outs = eng.step()
        gaps.append(time.perf_counter() - t0)
        decoded += sum(1 for o in outs if o.request_id != "long")
        if any(o.request_id == "long" for o in outs):
            break
    ttft = time.perf_counter() - t_arrival
    for i in range(args.batch):
        eng.abort(f"run-{i}")
    return {"decode_step_s": statistics.median(steps), "worst_gap_s": max(gaps), "mean_gap_s": statistics.mean(gaps),
            "steps": len(gaps), "decode_tokens": decoded, "ttft_s": ttft,
            "decode_tok_s": decoded / ttft}


def _alone(eng: Any, args: argparse.Namespace) -> dict[str, float]:
    from engine.profiling import time_prefill

    time_prefill(eng, 64, seed=1)  # warm-up
    seconds = statistics.median(time_prefill(eng, args.prompt_len, seed=2 + i) for i in range(2))
    return {"prefill_s": seconds, "prefill_tok_s": args.prompt_len / seconds}


def run_chunks(args: argparse.Namespace) -> int:
    import torch

    torch.set_num_threads(THREADS)
    chunks = [int(c) for c in args.chunks.split(",")]
    res: dict[str, Any] = {"machine": machine_info(), "batch": args.batch, "context": args.context,
                           "prompt_len": args.prompt_len, "compile": not args.no_compile, "runs": {}}
    for chunk in chunks:
        eng = _engine(args, chunk)
        res["dtype"] = eng.config.dtype
        label = str(chunk) if chunk else "whole"
        run = _arrival(eng, args) | _alone(eng, args)
        res["runs"][label] = run
        log(f"chunk {label}: worst gap {run['worst_gap_s']:.2f} s, mean gap {run['mean_gap_s']:.2f} s, "
            f"long prompt TTFT {run['ttft_s']:.2f} s, alone {run['prefill_tok_s']:.0f} tok/s")
        del eng
    out = save_results(res, "chunks", args.out)
    print(render(res))
    log(f"wrote {out}")
    return 0


def render(res: dict[str, Any]) -> str:
    m = res["machine"]
    lines = [(f"{m['machine_class']} ({m['cpu']}), {res['dtype']}, {THREADS} threads, decode step "
              f"{'compiled' if res['compile'] else 'eager'}; {res['batch']} sequences of {res['context']} tokens "
              f"decoding when a {res['prompt_len']}-token prompt arrives. Command: `{m['command']}`"), "",
             ("| chunk (tokens) | decode step before (s) | worst gap (s) | mean gap (s) | decode tok/s meanwhile "
              "| long prompt TTFT (s) | prefill alone (tok/s) |"), "|---|---|---|---|---|---|---|"]
    for label, r in res["runs"].items():
        lines.append(f"| {label} | {r['decode_step_s']:.3f} | {r['worst_gap_s']:.2f} | {r['mean_gap_s']:.2f} | "
                     f"{r['decode_tok_s']:.1f} | {r['ttft_s']:.2f} | {r['prefill_tok_s']:.0f} |")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from engine.config import DTYPES, EngineConfig

    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default=EngineConfig.dtype, choices=[d for d in DTYPES if d != "float16"])
    p.add_argument("--chunks", default=f"64,128,{EngineConfig.prefill_chunk_tokens},512,{WHOLE}",
                   help="chunk sizes to compare, tokens; 0: whole prompts (default: %(default)s)")
    p.add_argument("--batch", type=int, default=16, help="sequences decoding when the long prompt arrives")
    p.add_argument("--context", type=int, default=128, help="their prompt length")
    p.add_argument("--prompt-len", type=int, default=1536, help="the long prompt's length")
    p.add_argument("--no-compile", action="store_true", help="eager decode steps")
    p.add_argument("--out", default=None, help="JSON results (default: bench/results/chunks-CLASS.json)")
