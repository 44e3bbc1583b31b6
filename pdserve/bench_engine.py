"""`pdserve bench engine`: pdserve vs transformers `generate` vs this machine's limits, in one run.

Measures memory bandwidth and matmul throughput, an overhead-free bound per batch size (every
nn.Linear alone with `F.linear` plus one read of the batch's KV cache), then the same decode,
prefill and long-request workloads on pdserve and on transformers. Writes raw JSON and a
section of BENCHMARKS.md. Timings are noisy: medians, one run, ratios side by side.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F

THREADS = 2
START, END = "<!-- engine-bench:start -->", "<!-- engine-bench:end -->"
DECODE_TARGETS = {1: (0.80, 1.5), 32: (0.70, 3.0)}  # batch: (fraction of bound, × transformers)


@dataclasses.dataclass(frozen=True)
class Plan:
    batches: tuple[int, ...] = (1, 8, 32)
    prompt_len: int = 200
    new_tokens: int = 128
    prefill_lens: tuple[int, ...] = (200, 2000)
    long_in: int = 200
    long_out: int = 1000
    reps: int = 5  # micro-benchmark repetitions (median)


FULL, QUICK = Plan(), Plan(prompt_len=32, new_tokens=8, prefill_lens=(32, 256), long_in=32, long_out=48, reps=3)
Stats = dict[str, float]


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def median_time(fn: Callable[[], Any], reps: int) -> float:
    fn()  # warm-up
    return statistics.median(timed(fn) for _ in range(reps))


# -- machine limits and the overhead-free bound --------------------------------------------------
def measure_limits(reps: int) -> Stats:
    x = torch.ones(64 << 20)  # 256 MB of fp32
    out = {"read_bandwidth_gb_s": x.numel() * 4 / median_time(x.sum, max(2 * reps, 5)) / 1e9}
    for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        a, b = torch.randn(2048, 2048, dtype=dt), torch.randn(2048, 2048, dtype=dt)
        out[f"matmul_gflop_s_{name}"] = 2 * 2048**3 / median_time(lambda: a @ b, reps) / 1e9
    return out


def geometry(model: torch.nn.Module) -> dict[str, int]:
    cfg = model.config.get_text_config()
    params = list(model.parameters())  # tied weights counted once
    return {"layers": cfg.num_hidden_layers, "kv_heads": cfg.num_key_value_heads,
            "head_dim": getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
            "dtype_bytes": params[0].element_size(), "params": sum(p.numel() for p in params),
            "weight_bytes": sum(p.numel() * p.element_size() for p in params),
            "linear_params": sum(w.numel() for w in linear_weights(model))}


def linear_weights(model: torch.nn.Module) -> list[torch.Tensor]:
    """Every nn.Linear weight in forward order; the lm_head is the last."""
    return [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]


@torch.inference_mode()
def time_linears(weights: list[torch.Tensor], batch: int, reps: int) -> float:
    inputs = {w.shape[1]: torch.randn(batch, w.shape[1], dtype=w.dtype) for w in weights}

    def run() -> None:
        for w in weights:
            F.linear(inputs[w.shape[1]], w)
    return median_time(run, reps)


def bound(model: torch.nn.Module, geo: dict[str, int], bw_gb_s: float, plan: Plan) -> dict[int, Stats]:
    kv_tok = 2 * geo["layers"] * geo["kv_heads"] * geo["head_dim"] * geo["dtype_bytes"]
    avg_ctx = plan.prompt_len + plan.new_tokens / 2
    out = {}
    for b in plan.batches:
        lin = time_linears(linear_weights(model), b, plan.reps)
        kv = kv_tok * b * avg_ctx / (bw_gb_s * 1e9)
        out[b] = {"linear_s": lin, "kv_read_s": kv, "avg_context": avg_ctx, "tok_s": b / (lin + kv)}
        log(f"bound B={b}: linears {lin * 1e3:.1f} ms + KV {kv * 1e3:.2f} ms -> {out[b]['tok_s']:.1f} tok/s")
    return out


# -- workloads ---------------------------------------------------------------------------------
class Prompts:
    """Fresh random prompts from the vocabulary, special ids excluded, so no prefix cache helps."""

    def __init__(self, vocab: int, special: list[int], seed: int = 0) -> None:
        self.pool = np.setdiff1d(np.arange(vocab), np.array(special, dtype=np.int64))
        self.rng = np.random.default_rng(seed)

    def __call__(self, batch: int, length: int) -> list[list[int]]:
        return self.rng.choice(self.pool, size=(batch, length)).tolist()


def engine_run(engine: Any, prompts: list[list[int]], max_tokens: int) -> Stats:
    from engine import SamplingParams

    before = dataclasses.replace(engine.stats)
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    for p in prompts:
        engine.add_request(p, sp)
    while engine.has_unfinished():
        engine.step()
    out: Stats = {f.name: getattr(engine.stats, f.name) - getattr(before, f.name)
                  for f in dataclasses.fields(before)}
    out["wall_s"] = time.perf_counter() - t0
    out["decode_tok_s"] = out["decode_tokens"] / out["decode_seconds"] if out["decode_seconds"] else 0.0
    out["prefill_tok_s"] = out["prefill_tokens"] / out["prefill_seconds"] if out["prefill_seconds"] else 0.0
    out["e2e_tok_s"] = len(prompts) * max_tokens / out["wall_s"]
    return out


@torch.inference_mode()
def hf_time(model: Any, prompts: list[list[int]], new: int) -> float:
    ids = torch.tensor(prompts)
    t0 = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                         min_new_tokens=new, do_sample=False, pad_token_id=0)
    wall = time.perf_counter() - t0
    assert out.shape[1] == ids.shape[1] + new, f"generate returned {out.shape[1] - ids.shape[1]} tokens"
    return wall


def hf_run(model: Any, prompts: Prompts, batch: int, length: int, new: int) -> Stats:
    """Prefill from a 1-token run, decode from the difference to a `new`-token run."""
    hf_time(model, prompts(batch, length), min(new, 2))  # warm-up
    t1 = hf_time(model, prompts(batch, length), 1)
    out: Stats = {"prefill_s": t1, "prefill_tok_s": batch * length / t1}
    if new > 1:
        tn = hf_time(model, prompts(batch, length), new)
        out.update(wall_s=tn, decode_s=tn - t1, decode_tok_s=(new - 1) * batch / (tn - t1),
                   e2e_tok_s=batch * new / tn)
    return out


def decode_workloads(eng: Any, hf: Any, prompts: Prompts, plan: Plan) -> dict[int, dict[str, Stats]]:
    out = {}
    for b in plan.batches:
        engine_run(eng, prompts(b, plan.prompt_len), 4)  # warm-up
        pd = engine_run(eng, prompts(b, plan.prompt_len), plan.new_tokens)
        tf = hf_run(hf, prompts, b, plan.prompt_len, plan.new_tokens)
        out[b] = {"pdserve": pd, "transformers": tf}
        log(f"decode B={b}: pdserve {pd['decode_tok_s']:.1f} tok/s (wall {pd['wall_s']:.1f} s), "
            f"transformers {tf['decode_tok_s']:.1f} tok/s (wall {tf['wall_s']:.1f} s)")
    return out


def prefill_workloads(eng: Any, hf: Any, prompts: Prompts, plan: Plan) -> dict[int, dict[str, Stats]]:
    out = {}
    for n in plan.prefill_lens:
        reps = plan.reps if n <= plan.prompt_len else 1
        engine_run(eng, prompts(1, n), 1)  # warm-up
        pd = statistics.median(engine_run(eng, prompts(1, n), 1)["prefill_tok_s"] for _ in range(reps))
        tf = statistics.median(hf_run(hf, prompts, 1, n, 1)["prefill_tok_s"] for _ in range(reps))
        out[n] = {"pdserve": {"prefill_tok_s": pd}, "transformers": {"prefill_tok_s": tf}}
        log(f"prefill {n} tokens: pdserve {pd:.0f} tok/s, transformers {tf:.0f} tok/s")
    return out


def long_workload(eng: Any, hf: Any, prompts: Prompts, plan: Plan) -> dict[str, Stats]:
    engine_run(eng, prompts(1, plan.long_in), 4)  # warm-up
    pd = engine_run(eng, prompts(1, plan.long_in), plan.long_out)
    pd.update(prefill_s=pd["prefill_seconds"], decode_s=pd["decode_seconds"])
    tf = hf_run(hf, prompts, 1, plan.long_in, plan.long_out)
    for r in (pd, tf):
        r["decode_pct_of_wall"] = 100 * r["decode_s"] / r["wall_s"]
    log(f"{plan.long_in}/{plan.long_out}: pdserve wall {pd['wall_s']:.1f} s, transformers wall {tf['wall_s']:.1f} s")
    return {"pdserve": pd, "transformers": tf}


# -- report ------------------------------------------------------------------------------------
def machine_info() -> dict[str, Any]:
    import transformers

    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), "unknown")
    argv0 = Path(sys.argv[0]).name
    cmd = " ".join(["pdserve" if argv0.endswith(".py") else argv0] + sys.argv[1:])
    return {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "command": cmd, "loadavg_start": os.getloadavg()}


def table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def check(value: float, target: float | None, fmt: str) -> str:
    if target is None:
        return fmt.format(value)
    return f"{fmt.format(value)} (≥ {fmt.format(target)} {'✅ met' if value >= target else '❌ missed'})"


def render(r: dict[str, Any]) -> str:
    m, lim, geo = r["machine"], r["limits"], r["geometry"]
    head = (f"## Engine benchmark ({r['dtype']}{', quick' if r['quick'] else ''})\n\n"
            f"Command: `{m['command']}` · {m['date']} · total {r['total_s']:.0f} s\n\n"
            f"Machine: {m['cpu']}, {m['cores']} cores, torch threads {m['torch_threads']} · "
            f"torch {m['torch']} · transformers {m['transformers']} · load avg at start {m['loadavg_start'][0]:.2f}\n")
    limits = table(["limit", "value"], [
        ["memory read bandwidth (`sum`, 256 MB)", f"{lim['read_bandwidth_gb_s']:.1f} GB/s"],
        ["matmul 2048³ fp32", f"{lim['matmul_gflop_s_fp32']:.0f} GFLOP/s"],
        ["matmul 2048³ bf16", f"{lim['matmul_gflop_s_bf16']:.0f} GFLOP/s"],
        [f"weights ({geo['params'] / 1e6:.1f}M params, {r['dtype']})", f"{geo['weight_bytes'] / 1e6:.0f} MB"],
        ["bandwidth limit, batch 1 (weights / bandwidth)", f"{r['bandwidth_limit_tok_s']:.1f} tok/s"],
        ["compute limit (matmul FLOP/s / 2·linear params)", f"{r['compute_limit_tok_s']:.0f} tok/s"]])
    rows = []
    for b, w in r["decode"].items():
        pd, tf, bd = w["pdserve"], w["transformers"], r["bound"][b]
        frac, speed = DECODE_TARGETS.get(int(b), (None, None))
        rows.append([str(b), f"{pd['decode_tok_s']:.1f}", f"{tf['decode_tok_s']:.1f}", f"{bd['tok_s']:.1f}",
                     check(100 * pd["decode_tok_s"] / bd["tok_s"], frac and 100 * frac, "{:.0f}%"),
                     check(pd["decode_tok_s"] / tf["decode_tok_s"], speed, "{:.2f}×"),
                     f"{pd['e2e_tok_s']:.1f} / {tf['e2e_tok_s']:.1f}", f"{pd['wall_s']:.1f} / {tf['wall_s']:.1f}"])
    p = r["plan"]
    decode = table(["batch", "pdserve decode tok/s", "transformers decode tok/s", "bound tok/s", "% of bound",
                    "× transformers", "e2e tok/s pd / tf", "wall s pd / tf"], rows)
    b1 = r["decode"].get(1) or r["decode"].get("1")
    bw_pct = f"\n\nBatch 1 vs the bandwidth limit: {100 * b1['pdserve']['decode_tok_s'] / r['bandwidth_limit_tok_s']:.0f}%" \
        if b1 else ""
    prefill = table(["prompt tokens (batch 1)", "pdserve tok/s", "transformers tok/s", "× transformers",
                     "compute limit tok/s"],
                    [[str(n), f"{w['pdserve']['prefill_tok_s']:.0f}", f"{w['transformers']['prefill_tok_s']:.0f}",
                      f"{w['pdserve']['prefill_tok_s'] / w['transformers']['prefill_tok_s']:.2f}×",
                      f"{r['compute_limit_tok_s']:.0f}"] for n, w in r["prefill"].items()])
    lw = r["long"]
    split = table(["", "prefill s", "decode s", "decode tok/s", "wall s", "decode % of wall"],
                  [[k, f"{v['prefill_s']:.2f}", f"{v['decode_s']:.2f}", f"{v['decode_tok_s']:.1f}",
                    f"{v['wall_s']:.2f}", f"{v['decode_pct_of_wall']:.0f}%"] for k, v in lw.items()])
    return (f"{head}\n### Limits\n\n{limits}\n\n### Decode: {p['prompt_len']}-token random prompts, "
            f"{p['new_tokens']} new tokens\n\nDecode tok/s = decode tokens / decode seconds (pdserve stats); "
            f"transformers = {p['new_tokens'] - 1}·B / (t({p['new_tokens']} new) − t(1 new)). Bound = every "
            f"nn.Linear + lm_head alone with `F.linear` + one KV read at measured bandwidth (avg context "
            f"{r['bound'][next(iter(r['bound']))]['avg_context']:.0f}).\n\n{decode}{bw_pct}\n\n"
            f"### Prefill\n\n{prefill}\n\n### {p['long_in']}-in / {p['long_out']}-out request, batch 1\n\n{split}\n")


def write_report(path: Path, section: str) -> None:
    block = f"{START}\n{section}{END}\n"
    text = path.read_text() if path.exists() else "# pdserve benchmarks\n\n"
    if START in text and END in text:
        text = text[:text.index(START)] + block + text[text.index(END) + len(END):].lstrip("\n")
    else:
        text = text.rstrip("\n") + "\n\n" + block
    path.write_text(text)


# -- entry point -------------------------------------------------------------------------------
def run_engine_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Run every measurement, print the tables, write `args.out` (JSON) and `args.report`."""
    import transformers
    from engine import CacheConfig, EngineConfig, LLMEngine
    from engine.model_loader import load_model

    t_start = time.perf_counter()
    torch.set_num_threads(THREADS)
    transformers.logging.set_verbosity_error()
    plan = QUICK if args.quick else FULL
    log(f"plan: {plan}")
    limits = measure_limits(plan.reps)
    log(f"limits: {', '.join(f'{k} {v:.1f}' for k, v in limits.items())}")
    hf, tok = load_model(args.model, args.dtype, "cpu")
    geo = geometry(hf)
    peak = limits["matmul_gflop_s_bf16" if args.dtype == "bfloat16" else "matmul_gflop_s_fp32"]
    res: dict[str, Any] = {"dtype": args.dtype, "quick": bool(args.quick), "plan": dataclasses.asdict(plan),
                           "machine": machine_info(), "limits": limits, "geometry": geo,
                           "attn_implementation_transformers": hf.config._attn_implementation,
                           "bandwidth_limit_tok_s": limits["read_bandwidth_gb_s"] * 1e9 / geo["weight_bytes"],
                           "compute_limit_tok_s": peak * 1e9 / (2 * geo["linear_params"])}
    res["bound"] = bound(hf, geo, limits["read_bandwidth_gb_s"], plan)
    kv_tok = 2 * geo["layers"] * geo["kv_heads"] * geo["head_dim"] * geo["dtype_bytes"]
    need = max(max(plan.batches) * (plan.prompt_len + plan.new_tokens), max(plan.prefill_lens) + 1,
               plan.long_in + plan.long_out) * kv_tok
    cache = CacheConfig(memory_gib=max(0.25, 1.5 * need / (1 << 30)), enable_prefix_caching=False)
    eng = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, num_threads=THREADS, max_num_seqs=64,
                                 cache=cache))
    prompts = Prompts(min(len(tok), geo_vocab(hf)), tok.all_special_ids)
    res["decode"] = decode_workloads(eng, hf, prompts, plan)
    res["prefill"] = prefill_workloads(eng, hf, prompts, plan)
    res["long"] = long_workload(eng, hf, prompts, plan)
    res["machine"]["loadavg_end"] = os.getloadavg()
    res["total_s"] = time.perf_counter() - t_start
    section = render(res)
    print("\n" + section)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2, default=str) + "\n")
    write_report(Path(args.report), section)
    log(f"done in {res['total_s']:.0f} s; wrote {out} and {args.report}")
    return res


def geo_vocab(model: torch.nn.Module) -> int:
    return model.get_output_embeddings().weight.shape[0]
