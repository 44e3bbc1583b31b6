"""`pdserve` command line: serve, generate, model, plan, bench. Thin: parses flags, calls the packages."""
from __future__ import annotations

import argparse
import os
import sys
import time

from pdserve import flags


def _generate_defaults() -> ServeConfig:  # noqa: F821
    """`generate` runs one prompt: a plain `EngineConfig` (decode steps eager: compiling would not pay)."""
    from engine import EngineConfig
    from pdserve.serve import ServeConfig

    return ServeConfig(engine=EngineConfig())


def _engine_config(args: argparse.Namespace) -> EngineConfig:  # noqa: F821
    return flags.build(_generate_defaults(), args, flags.ENGINE).engine


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
        ca = _read_ca(args.tls_ca) if args.tls_ca else None
        for resp in generate_stream(args.server, args.prompt, not args.no_chat, args.max_tokens, args.temperature,
                                    args.top_p, args.top_k, args.seed, args.stop or [], metadata=metadata,
                                    root_certificates=ca):
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


def _read_ca(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"tls_ca: cannot read {path}: {e.strerror or e}") from None


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
            if out.error is not None:
                print(f"\npdserve generate: error: {out.error}", file=sys.stderr)
                return 1
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
    from dataclasses import replace

    from kv_transfer.config import operator_secret
    from pdserve.serve import ServeConfig, run
    from router.auth import load_api_keys

    cfg = flags.build(ServeConfig(), args, flags.ENGINE + flags.SERVE)
    if cfg.engine.num_threads is None:  # one torch thread per Ray CPU the worker claims
        cfg = replace(cfg, engine=replace(cfg.engine, num_threads=max(1, int(cfg.cpus_per_worker))))
    keys = load_api_keys(args.api_key, args.api_key_file, os.environ)
    secret = operator_secret(args.transfer_secret_file, os.environ)
    if secret is not None:
        cfg = replace(cfg, transfer=replace(cfg.transfer, secret=secret))
    return run(replace(cfg, api_keys=keys), args.log_level)


# `serve` flags that are no config field: where keys and settings come from, and logging.
def _serve_cli_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="YAML file of flag values, keys as the flags with _ for - "
                   "(http_port: 8000); flags given on the command line win")
    p.add_argument("--api-key", action="append", default=None,
                   help="require this API key (HTTP Authorization: Bearer, gRPC metadata); repeatable. Also "
                   "$PDSERVE_API_KEYS (comma-separated) and --api-key-file")
    p.add_argument("--api-key-file", default=None, help="file of API keys, one per line (# comments)")
    p.add_argument("--transfer-secret-file", default=None,
                   help="file holding the secret KV transfers between workers authenticate with (also "
                   "$PDSERVE_TRANSFER_SECRET; default: a fresh random one per deployment)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


# what a YAML file may set besides config fields
_SERVE_CLI_DESTS = {"api_key", "api_key_file", "transfer_secret_file", "log_level"}


def _yaml_defaults(path: str) -> dict:
    """The YAML file's flag values, keyed by argparse name. Raises ValueError naming unknown keys."""
    import yaml

    from pdserve.serve import ServeConfig

    try:
        with open(path) as f:
            values = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"config: cannot read {path}: {e}") from None
    if not isinstance(values, dict):
        raise ValueError(f"config: {path} must hold a mapping of flag names to values")  # noqa: TRY004 - a usage error
    known = flags.dests(flags.ENGINE + flags.SERVE, ServeConfig()) | _SERVE_CLI_DESTS
    values = {str(k).replace("-", "_"): v for k, v in values.items()}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"config: unknown keys {unknown}; allowed: {sorted(known)}")
    return values


def _apply_yaml(args: argparse.Namespace, argv: list[str] | None) -> argparse.Namespace:
    """Parse again with the YAML file's values as `serve`'s defaults, so command-line flags still win."""
    return build_parser(serve_defaults=_yaml_defaults(args.config)).parse_args(argv)


def cmd_status(args: argparse.Namespace) -> int:
    from pdserve.status import cluster_status, format_status, status_json

    try:
        status = cluster_status(args.address, timeout_s=args.timeout, include_dead=args.all)
    except ConnectionError as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2
    if args.router:
        from pdserve.status import router_split

        status["router"] = router_split(args.router, args.api_key)
    print(status_json(status) if args.json else format_status(status))
    return 0 if status["healthy"] else 1


def cmd_stop(args: argparse.Namespace) -> int:
    from pdserve.serve import stop_deployment

    n = stop_deployment(args.address, args.deployment)
    print(f"pdserve: stopped {n} workers of deployment {args.deployment!r}" if n else
          f"pdserve: deployment {args.deployment!r} has no workers on this cluster", file=sys.stderr)
    return 0 if n else 1


def cmd_plan(args: argparse.Namespace) -> int:
    from planner.cli import run

    return run(args)


def build_parser(serve_defaults: dict | None = None) -> argparse.ArgumentParser:
    """The `pdserve` parser; `serve_defaults` (from a YAML file) replace `serve`'s flag defaults."""
    from pdserve.serve import ServeConfig

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
    gen.add_argument("--tls-ca", default=None, help="for --server over TLS: the PEM CA certificate (or the "
                     "server's self-signed one) to trust")
    flags.add_flags(gen, flags.ENGINE, _generate_defaults())
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--no-chat", action="store_true", help="send the prompt raw, without the chat template")
    gen.set_defaults(func=cmd_generate)

    serve = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API and gRPC on Ray pools")
    flags.add_flags(serve, flags.ENGINE + flags.SERVE, ServeConfig())
    _serve_cli_flags(serve)
    if serve_defaults:
        serve.set_defaults(**serve_defaults)
    serve.set_defaults(func=cmd_serve)

    st = sub.add_parser("status", help="pdserve's workers on a Ray cluster: pool, node, state, load, health")
    st.add_argument("--address", default=None, help="Ray cluster: auto, HOST:PORT or ray://HOST:PORT "
                    "(default: $RAY_ADDRESS, else auto)")
    st.add_argument("--json", action="store_true", help="print the snapshot as JSON")
    st.add_argument("--timeout", type=float, default=5.0, help="seconds each worker gets to answer load()")
    st.add_argument("--all", action="store_true", help="also list dead workers of servers that have stopped")
    st.add_argument("--router", default=None, metavar="URL", help="also show the role split of the router at "
                    "http://HOST:PORT (how many prefill workers prefill, pinned or automatic)")
    st.add_argument("--api-key", default=os.environ.get("PDSERVE_API_KEY"),
                    help="--router: its API key (default: $PDSERVE_API_KEY)")
    st.set_defaults(func=cmd_status)

    stop = sub.add_parser("stop", help="end the workers of a named deployment (`serve --deployment`)")
    stop.add_argument("--address", required=True, help="its Ray cluster: auto, HOST:PORT or ray://HOST:PORT")
    stop.add_argument("--deployment", required=True, help="the deployment's name")
    stop.set_defaults(func=cmd_stop)

    from planner.cli import add_arguments as add_plan_arguments

    plan = sub.add_parser("plan", help="how many prefill and decode workers: simulate a trace on a profile over "
                          "P:D splits, policies and batch limits, and recommend one")
    add_plan_arguments(plan)
    plan.set_defaults(func=cmd_plan)

    from pdserve.bench.cli import add_bench_parser

    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from engine.model_store import ModelError  # light import: no torch

    if getattr(args, "config", None):
        try:
            args = _apply_yaml(args, argv)
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
