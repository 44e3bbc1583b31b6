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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from engine.progress import Steps
from pdserve.bench.cpu_watch import CpuMonitor
from pdserve.bench.report import class_slug, render, write_report

THREADS = 2
WARM_LEN = 16  # prompt length of the warm-up before each decode workload


@dataclasses.dataclass(frozen=True)
class Plan:
    batches: tuple[int, ...] = (1, 8, 32)
    prompt_len: int = 200
    new_tokens: int = 128
    prefill_lens: tuple[int, ...] = (200, 2000)
    long_in: int = 200
    long_out: int = 1000
    reps: int = 5  # micro-benchmark repetitions (median)
    decode_reps: int = 3  # runs of each decode workload and its bound, interleaved (see `decode_workload`)


FULL, QUICK = Plan(), Plan(prompt_len=32, new_tokens=8, prefill_lens=(32, 256), long_in=32, long_out=48, reps=3,
                           decode_reps=1)
Stats = dict[str, float]


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def median_time(fn: Callable[[], Any], reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# -- machine limits and the overhead-free bound --------------------------------------------------
def measure_limits(reps: int) -> Stats:
    x = torch.ones(64 << 20)  # 256 MB of fp32
    out = {"read_bandwidth_gb_s": x.numel() * 4 / median_time(x.sum, max(2 * reps, 5)) / 1e9}
    for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        n = _matmul_size(dt)
        a = torch.randn(n, n, dtype=dt)
        out[f"matmul_gflop_s_{name}"] = 2 * n**3 / median_time(lambda a=a: a @ a, reps) / 1e9
        out[f"matmul_n_{name}"] = n
    return out


def _matmul_size(dtype: torch.dtype, budget_s: float = 0.5) -> int:
    """2048, or less where the dtype is so slow (bf16 without native instructions: hundreds of times
    slower) that a 2048³ product would take more than `budget_s`; a rough 256³ probe decides."""
    a = torch.randn(256, 256, dtype=dtype)
    a @ a
    t0 = time.perf_counter()
    a @ a
    rate = 2 * 256**3 / max(time.perf_counter() - t0, 1e-9)
    n = 2048
    while n > 256 and 2 * n**3 / rate > budget_s:
        n //= 2
    return n


def geometry(model: torch.nn.Module) -> dict[str, int]:
    cfg = model.config.get_text_config()
    params = list(model.parameters())  # tied weights counted once
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    layers, kv_heads, nbytes = cfg.num_hidden_layers, cfg.num_key_value_heads, params[0].element_size()
    return {"layers": layers, "kv_heads": kv_heads, "head_dim": head_dim, "dtype_bytes": nbytes,
            "params": sum(p.numel() for p in params), "weight_bytes": sum(p.numel() * nbytes for p in params),
            "linear_params": sum(w.numel() for w in linear_weights(model)),
            "kv_bytes_per_token": 2 * layers * kv_heads * head_dim * nbytes,
            "vocab": model.get_output_embeddings().weight.shape[0]}


def linear_weights(model: torch.nn.Module) -> list[torch.Tensor]:
    """Every nn.Linear weight in forward order; the lm_head is the last."""
    return [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]


def bound_linears(model: torch.nn.Module, choice: Any) -> list[torch.nn.Module]:
    """The bound's linear layers, computed as the engine computes them: each layer as the engine's
    `choice` (its `hardware.LinearChoice`) swaps it (`packed_linear.swapped`: a packed, kernel or
    blocked copy, or the plain layer)."""
    from engine.packed_linear import group_of, swapped

    return [swapped(m, group_of(name, m), choice) for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear)]


@torch.inference_mode()
def time_linears(layers: list[torch.nn.Module], batch: int, reps: int) -> float:
    dtypes = [m.weight.dtype if isinstance(m, torch.nn.Linear) else m.weight_dtype for m in layers]
    inputs = {(m.in_features, d): torch.randn(batch, m.in_features, dtype=d) for m, d in zip(layers, dtypes)}

    def run() -> None:
        for m, d in zip(layers, dtypes):
            m(inputs[m.in_features, d])
    return median_time(run, reps)


def bound(layers: list[torch.nn.Module], geo: dict[str, int], bw_gb_s: float, b: int, plan: Plan) -> Stats:
    avg_ctx = plan.prompt_len + plan.new_tokens / 2
    lin = time_linears(layers, b, plan.reps)
    kv = geo["kv_bytes_per_token"] * b * avg_ctx / (bw_gb_s * 1e9)
    log(f"bound B={b}: linears {lin * 1e3:.1f} ms + KV {kv * 1e3:.2f} ms -> {b / (lin + kv):.1f} tok/s")
    return {"linear_s": lin, "kv_read_s": kv, "avg_context": avg_ctx, "tok_s": b / (lin + kv)}


# -- workloads ---------------------------------------------------------------------------------
class Prompts:
    """Fresh random prompts from the vocabulary, special ids excluded, so no prefix cache helps."""

    def __init__(self, vocab: int, special: list[int], seed: int = 0) -> None:
        self.pool = np.setdiff1d(np.arange(vocab), np.array(special, dtype=np.int64))
        self.rng = np.random.default_rng(seed)

    def __call__(self, batch: int, length: int) -> list[list[int]]:
        return self.rng.choice(self.pool, size=(batch, length)).tolist()


@dataclasses.dataclass
class Bench:
    """What the workloads share: the plan, the CPU guard, both engines and the prompt source."""

    plan: Plan
    mon: CpuMonitor
    eng: Any  # pdserve LLMEngine
    hf: Any  # transformers model, its own copy
    prompts: Prompts
    geo: dict[str, int]  # the model's geometry
    bw_gb_s: float  # measured read bandwidth
    linears: list[torch.nn.Module]  # the bound's linear layers, packed where the engine's are


def engine_run(bn: Bench, batch: int, length: int, max_tokens: int) -> Stats:
    """One pdserve run of `batch` fresh prompts; the engine-stats deltas plus wall time."""
    from engine import SamplingParams

    eng, before = bn.eng, dataclasses.replace(bn.eng.stats)
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    ids = [eng.add_request(p, sp) for p in bn.prompts(batch, length)]
    try:
        while eng.has_unfinished():
            eng.step()
            bn.mon.check()
    except BaseException:
        for rid in ids:
            eng.abort(rid)
        raise
    out: Stats = {f.name: getattr(eng.stats, f.name) - getattr(before, f.name) for f in dataclasses.fields(before)}
    out["wall_s"] = time.perf_counter() - t0
    out["decode_tok_s"] = out["decode_tokens"] / out["decode_seconds"] if out["decode_seconds"] else 0.0
    out["prefill_tok_s"] = out["prefill_tokens"] / out["prefill_seconds"] if out["prefill_seconds"] else 0.0
    out["e2e_tok_s"] = batch * max_tokens / out["wall_s"]
    return out


class _Watch(StoppingCriteria):
    """Never stops generation; aborts it (Contended) when another process takes the CPU."""

    def __init__(self, mon: CpuMonitor) -> None:
        self.mon = mon

    def __call__(self, input_ids: torch.LongTensor, scores: Any, **kwargs: Any) -> torch.BoolTensor:
        self.mon.check()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


@torch.inference_mode()
def hf_time(bn: Bench, batch: int, length: int, new: int) -> float:
    ids = torch.tensor(bn.prompts(batch, length))
    t0 = time.perf_counter()
    out = bn.hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                         min_new_tokens=new, do_sample=False, pad_token_id=0,
                         stopping_criteria=StoppingCriteriaList([_Watch(bn.mon)]))
    wall = time.perf_counter() - t0
    assert out.shape[1] == ids.shape[1] + new, f"generate returned {out.shape[1] - ids.shape[1]} tokens"
    return wall


def hf_run(bn: Bench, batch: int, length: int, new: int, warm_len: int = WARM_LEN) -> Stats:
    """Prefill from a 1-token run, decode from the difference to a `new`-token run."""
    hf_time(bn, batch, min(length, warm_len), 2)  # warm-up
    t1 = hf_time(bn, batch, length, 1)
    out: Stats = {"prefill_s": t1, "prefill_tok_s": batch * length / t1}
    if new > 1:
        tn = hf_time(bn, batch, length, new)
        dt = tn - t1 if tn > t1 else float("nan")  # noise can make the difference negative
        out.update(wall_s=tn, decode_s=dt, decode_tok_s=(new - 1) * batch / dt, e2e_tok_s=batch * new / tn)
    return out


def pd_run(bn: Bench, batch: int, length: int, new: int, warm_len: int = WARM_LEN) -> Stats:
    engine_run(bn, batch, min(length, warm_len), min(new, 2))  # warm-up (short prompts: the batch shape matters)
    return engine_run(bn, batch, length, new)


def median_run(runs: list[Stats], key: str) -> Stats:
    """The run whose `key` is the median (NaNs, from noise, count as slowest), with every run's value."""
    ranked = sorted(runs, key=lambda r: (r[key] == r[key], r[key]))  # NaN first
    return {**ranked[len(ranked) // 2], "reps": len(runs), f"{key}_runs": [r[key] for r in runs]}


def decode_workload(bn: Bench, b: int) -> dict[str, Stats]:
    """pdserve, transformers and the overhead-free bound at batch `b`, each measured `decode_reps` times,
    interleaved (bound, pdserve, transformers, then again): the engines report their median run, the bound
    its best. The ratios the targets read (`paired`) are the medians of each round's own: pdserve over the
    bound and over transformers measured beside it, so a slow spell of a shared machine, which takes all
    three of a round alike, cancels out of them (one round's bound 25% faster than the next's has been seen)."""
    p = bn.plan
    bounds, pd_runs, tf_runs = [], [], []
    for _ in range(p.decode_reps):
        bounds.append(bn.mon.run(lambda: bound(bn.linears, bn.geo, bn.bw_gb_s, b, p)))
        pd_runs.append(bn.mon.run(lambda: pd_run(bn, b, p.prompt_len, p.new_tokens)))
        tf_runs.append(bn.mon.run(lambda: hf_run(bn, b, p.prompt_len, p.new_tokens)))
    pd, tf = median_run(pd_runs, "decode_tok_s"), median_run(tf_runs, "decode_tok_s")
    paired = paired_ratios([r["decode_tok_s"] for r in pd_runs], [r["tok_s"] for r in bounds],
                           [r["decode_tok_s"] for r in tf_runs])
    log(f"decode B={b}: pdserve {pd['decode_tok_s']:.1f} tok/s (wall {pd['wall_s']:.1f} s), "
        f"transformers {tf['decode_tok_s']:.1f} tok/s (wall {tf['wall_s']:.1f} s); round by round "
        f"{paired['of_bound']:.0%} of the bound, {paired['x_transformers']:.2f}x transformers")
    best = max(bounds, key=lambda r: r["tok_s"])  # a bound is the best the linears did, not a typical run
    return {"pdserve": pd, "transformers": tf, "paired": paired,
            "bound": {**best, "reps": len(bounds), "tok_s_runs": [r["tok_s"] for r in bounds]}}


def paired_ratios(pd: list[float], bound: list[float], tf: list[float]) -> dict[str, Any]:
    """Round i's pdserve tok/s over its bound and over its transformers (NaN, from noise, where a figure
    is not finite), and the median of each: what `decode_workload` reports the targets with."""
    def ratios(den: list[float]) -> list[float]:
        return [a / d if d > 0 and np.isfinite(a) and np.isfinite(d) else float("nan") for a, d in zip(pd, den)]

    def median(xs: list[float]) -> float:
        ok = [x for x in xs if not np.isnan(x)]
        return statistics.median(ok) if ok else float("nan")
    of_bound, x_tf = ratios(bound), ratios(tf)
    return {"of_bound": median(of_bound), "x_transformers": median(x_tf), "of_bound_runs": of_bound,
            "x_transformers_runs": x_tf}


def prefill_workload(bn: Bench, n: int) -> dict[str, Stats]:
    reps = bn.plan.reps if n == min(bn.plan.prefill_lens) else 1  # the long prompt is slow: one timed run

    def med(fn: Callable[[], Stats]) -> Stats:
        runs = [fn() for _ in range(reps)]
        return {"prefill_tok_s": statistics.median(r["prefill_tok_s"] for r in runs), "reps": reps}
    pd = bn.mon.run(lambda: med(lambda: pd_run(bn, 1, n, 1, warm_len=n)))
    tf = bn.mon.run(lambda: med(lambda: hf_run(bn, 1, n, 1, warm_len=n)))
    log(f"prefill {n} tokens: pdserve {pd['prefill_tok_s']:.0f} tok/s, transformers {tf['prefill_tok_s']:.0f} tok/s")
    return {"pdserve": pd, "transformers": tf}


def long_workload(bn: Bench) -> dict[str, Stats]:
    p = bn.plan
    pd = bn.mon.run(lambda: pd_run(bn, 1, p.long_in, p.long_out))
    pd.update(prefill_s=pd["prefill_seconds"], decode_s=pd["decode_seconds"])
    tf = bn.mon.run(lambda: hf_run(bn, 1, p.long_in, p.long_out))
    for r in (pd, tf):
        r["decode_pct_of_wall"] = 100 * r["decode_s"] / r["wall_s"]
    log(f"{p.long_in}/{p.long_out}: pdserve wall {pd['wall_s']:.1f} s, transformers wall {tf['wall_s']:.1f} s")
    return {"pdserve": pd, "transformers": tf}


def machine_info() -> dict[str, Any]:
    import transformers

    from engine import hardware

    info = hardware.this_cpu()
    kernel = hardware.choose_kernel(info, hardware.forced_kernel())
    argv0 = Path(sys.argv[0]).name
    cmd = " ".join(["pdserve" if argv0.endswith(".py") else argv0] + sys.argv[1:])
    return {"cpu": info.model, "isa": info.isa_summary(), "machine_class": info.machine_class(),
            "kernel_build": kernel.build.name if kernel.build else hardware.TORCH_KERNEL, "cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "command": cmd, "loadavg_start": os.getloadavg()}


# -- entry point -------------------------------------------------------------------------------
def save_results(res: dict[str, Any], kind: str, out: str | None) -> Path:
    """Write a benchmark's raw results as JSON to `out`, by default `bench/results/KIND-CLASS.json`
    (CLASS this machine's class, e.g. avx2-fma). Returns the path."""
    cls = res["machine"]["machine_class"]
    path = Path(out or f"bench/results/{kind}-{class_slug(cls)}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=2, default=str) + "\n")
    return path


def build_engine(args: argparse.Namespace, plan: Plan, geo: dict[str, int], dtype: str) -> Any:
    from engine import CacheConfig, EngineConfig, LLMEngine

    need = max(max(plan.batches) * (plan.prompt_len + plan.new_tokens), max(plan.prefill_lens) + 1,
               plan.long_in + plan.long_out) * geo["kv_bytes_per_token"]
    cache = CacheConfig(memory_gib=max(0.25, 1.5 * need / (1 << 30)), enable_prefix_caching=False)
    return LLMEngine(EngineConfig(model=args.model, dtype=dtype, num_threads=THREADS, max_num_seqs=64,
                                  compile=not args.no_compile, cache=cache))


def measure(args: argparse.Namespace, plan: Plan, res: dict[str, Any]) -> None:
    """Fill `res` with every measurement, each tagged with the CPU share other processes took."""
    from engine.auto_dtype import load_for

    mon = CpuMonitor(patience_s=5 if args.quick else 300, log=log)
    steps = Steps("engine benchmark", 3 + len(plan.batches) + len(plan.prefill_lens) + 1, log)
    steps.step("the machine's limits (memory bandwidth, matmul)")
    res["limits"] = lim = mon.run(lambda: measure_limits(plan.reps))
    log("limits: " + ", ".join(f"{k} {v:.2f}" for k, v in lim.items()))
    steps.step("loading the model for transformers")
    hf, tok, choice = load_for(args.dtype, args.model, "cpu")  # transformers' own copy, default (sdpa) attention
    res["dtype"] = choice.dtype  # both engines run it (`auto` resolved once, here)
    res["dtype_reason"] = choice.reason
    log(f"dtype {choice.dtype} ({'auto: ' if args.dtype == 'auto' else ''}{choice.reason})")
    geo = res["geometry"] = geometry(hf)
    bw, peak = lim["read_bandwidth_gb_s"], lim[f"matmul_gflop_s_{'bf16' if choice.dtype == 'bfloat16' else 'fp32'}"]
    res.update(attn_implementation_transformers=hf.config._attn_implementation,
               bandwidth_limit_tok_s=bw * 1e9 / geo["weight_bytes"],
               compute_limit_tok_s=peak * 1e9 / (2 * geo["linear_params"]))
    steps.step("starting pdserve's engine" + ("" if args.no_compile else " (its decode step compiles)"))
    eng = build_engine(args, plan, geo, choice.dtype)
    res.update(attention_kernel=eng.runner.attention_kernel, compiled=eng.runner.compiled,
               linear=eng.linear_choice.summary(), linear_reason=eng.linear_choice.reason)
    log(f"pdserve: decode attention {eng.runner.attention_kernel}, linear {eng.linear_choice.summary()}, "
        f"decode step {'compiled' if eng.runner.compiled else 'eager'}")
    bn = Bench(plan, mon, eng, hf, Prompts(min(len(tok), geo["vocab"]), tok.all_special_ids),
               geo, bw, bound_linears(hf, eng.linear_choice))
    res["decode"] = {}
    for b in plan.batches:
        steps.step(f"decode at batch {b} ({plan.decode_reps} runs of each engine and the bound)")
        res["decode"][b] = decode_workload(bn, b)
    res["bound"] = {b: res["decode"][b].pop("bound") for b in plan.batches}
    res["prefill"] = {}
    for n in plan.prefill_lens:
        steps.step(f"prefill of {n} tokens")
        res["prefill"][n] = prefill_workload(bn, n)
    steps.step(f"a long request ({plan.long_in} prompt tokens, {plan.long_out} output tokens)")
    res["long"] = long_workload(bn)
    res.update(waited_for_quiet_s=mon.waited_s, contended_retries=mon.retries)


def run_engine_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Run every measurement, print the tables, write `args.out` (JSON) and `args.report`."""
    import transformers

    t_start = time.perf_counter()
    torch.set_num_threads(THREADS)
    transformers.logging.set_verbosity_error()
    plan = QUICK if args.quick else FULL
    if args.decode_rounds is not None:
        plan = dataclasses.replace(plan, decode_reps=args.decode_rounds)
    log(f"plan: {plan}")
    res: dict[str, Any] = {"dtype": args.dtype, "quick": bool(args.quick), "compile": not args.no_compile,
                           "plan": dataclasses.asdict(plan),
                           "machine": machine_info()}
    measure(args, plan, res)
    res["machine"]["loadavg_end"] = os.getloadavg()
    res["total_s"] = time.perf_counter() - t_start
    section = render(res)
    print("\n" + section)
    cls = res["machine"]["machine_class"]
    out = save_results(res, "engine", args.out)
    write_report(Path(args.report), section, cls)
    log(f"done in {res['total_s']:.0f} s; wrote {out} and {args.report}")
    return res
