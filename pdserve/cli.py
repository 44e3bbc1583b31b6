"""`pdserve` command line: model, generate, bench. Thin: parses flags, calls the packages."""
from __future__ import annotations

import argparse
import sys
import time


def _engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="local Hugging Face model directory (default: the embedded model)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--kv-memory-gib", type=float, default=1.0, help="memory budget of the paged KV pool")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--compile", action="store_true", help="torch.compile the decode step (faster decode, ~15 s start)")


def _engine_config(args: argparse.Namespace) -> "EngineConfig":  # noqa: F821
    from engine import CacheConfig, EngineConfig

    return EngineConfig(model=args.model, dtype=args.dtype, device=args.device, num_threads=args.threads,
                        compile=args.compile,
                        cache=CacheConfig(block_size=args.block_size, memory_gib=args.kv_memory_gib))


def cmd_model(args: argparse.Namespace) -> int:
    from engine.model_store import default_model_dir, fetch_default_model, resolve_model

    if args.model_cmd == "fetch":
        path = fetch_default_model(force=args.force)
        print(path)
    else:
        print(resolve_model(None) if args.check else default_model_dir())
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from engine import LLMEngine, SamplingParams

    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                              top_k=args.top_k, seed=args.seed, stop=tuple(args.stop or ()))
    t0 = time.perf_counter()
    engine = LLMEngine(_engine_config(args))
    load_s = time.perf_counter() - t0
    engine.add_request(args.prompt, sampling, chat=not args.no_chat)
    reason, n_out, n_prompt = None, 0, 0
    while engine.has_unfinished():
        for out in engine.step():
            sys.stdout.write(out.new_text)
            sys.stdout.flush()
            n_out += len(out.new_token_ids)
            n_prompt = out.num_prompt_tokens
            reason = out.finish_reason
    s = engine.stats
    decode_tps = s.decode_tokens / s.decode_seconds if s.decode_seconds else 0.0
    print(f"\n\n[pdserve] model load {load_s:.2f} s | prompt {n_prompt} tokens, prefill {s.prefill_seconds * 1e3:.1f} ms "
          f"({s.prefill_tokens / max(s.prefill_seconds, 1e-9):.0f} tok/s) | {n_out} output tokens, decode "
          f"{s.decode_seconds:.2f} s ({decode_tps:.1f} tok/s) | finish: {reason}", file=sys.stderr)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from pdserve.bench_engine import run_engine_bench

    run_engine_bench(args)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated prefill/decode LLM serving")
    sub = parser.add_subparsers(dest="cmd", required=True)

    model = sub.add_parser("model", help="the embedded default model")
    msub = model.add_subparsers(dest="model_cmd", required=True)
    fetch = msub.add_parser("fetch", help="download and convert the embedded model into the cache (once)")
    fetch.add_argument("--force", action="store_true", help="fetch again even if the cache holds it")
    path = msub.add_parser("path", help="print where the embedded model lives")
    path.add_argument("--check", action="store_true", help="fail unless it has been fetched and is valid")
    model.set_defaults(func=cmd_model)

    gen = sub.add_parser("generate", help="run one prompt in-process and show the prefill/decode split")
    gen.add_argument("prompt")
    _engine_flags(gen)
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--no-chat", action="store_true", help="send the prompt raw, without the chat template")
    gen.set_defaults(func=cmd_generate)

    bench = sub.add_parser("bench", help="benchmarks")
    bsub = bench.add_subparsers(dest="bench_cmd", required=True)
    eng = bsub.add_parser("engine", help="engine throughput vs transformers generate and this machine's limits")
    eng.add_argument("--model", default=None)
    eng.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    eng.add_argument("--quick", action="store_true", help="smaller workloads (a smoke run)")
    eng.add_argument("--no-compile", action="store_true", help="measure the eager decode path instead")
    eng.add_argument("--out", default="bench/results/engine.json")
    eng.add_argument("--report", default="BENCHMARKS.md")
    bench.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from engine.model_store import ModelError  # light import: no torch

    try:
        return args.func(args)
    except (ModelError, ValueError) as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
