"""Markdown for `pdserve bench engine`: the tables and the BENCHMARKS.md section it replaces."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

DECODE_TARGETS = {1: (0.80, 1.5), 32: (0.70, 3.0)}  # batch: (fraction of the bound, × transformers)
PREFILL_TARGET = (2000, 0.70)  # prompt length: fraction of the compute limit


def markers(machine_class: str, kind: str = "engine") -> tuple[str, str]:
    """BENCHMARKS.md keeps one section per benchmark kind ("engine", "serving") and machine class, between
    these two lines."""
    return f"<!-- {kind}-bench:{machine_class}:start -->", f"<!-- {kind}-bench:{machine_class}:end -->"


def class_slug(machine_class: str) -> str:
    """A machine class as a path component: "AVX2 + FMA" -> "avx2-fma"."""
    return re.sub("[^a-z0-9]+", "-", machine_class.lower()).strip("-")


def table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def check(value: float, target: float | None, fmt: str) -> str:
    if target is None:
        return fmt.format(value)
    return f"{fmt.format(value)} (≥ {fmt.format(target)} {'✅ met' if value >= target else '❌ missed'})"


def max_other(*parts: Any) -> float:
    """Largest CPU share other processes took during any workload found in `parts` (nested dicts)."""
    found = [0.0]
    for p in parts:
        if isinstance(p, dict):
            found += [v if k == "other_cpu" else max_other(v) for k, v in p.items()]
    return max(found)


def pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def decode_runs(plan: dict) -> str:
    n = plan.get("decode_reps", 1)
    return "Decode figures are from one run of each engine." if n == 1 else \
        f"Bound, pdserve and transformers each ran {n} times, interleaved; the engines' figures are their " \
        "median run, the bound its best. % of bound and × transformers are the medians of each round's own " \
        "ratio (pdserve over the bound and transformers measured beside it), so a slow spell of the machine " \
        "cancels out; in brackets, the median run over the best bound."


def render_limits(r: dict[str, Any]) -> str:
    lim, geo = r["limits"], r["geometry"]
    return table(["limit", "value"], [
        ["memory read bandwidth (`sum`, 256 MB)", f"{lim['read_bandwidth_gb_s']:.1f} GB/s"],
        *([f"matmul {lim.get(f'matmul_n_{d}', 2048)}³ {d}", f"{lim[f'matmul_gflop_s_{d}']:.3g} GFLOP/s"]
          for d in ("fp32", "bf16")),
        [f"weights ({geo['params'] / 1e6:.1f}M params, {r['dtype']})", f"{geo['weight_bytes'] / 1e6:.0f} MB"],
        ["bandwidth limit, batch 1 (weights / bandwidth)", f"{r['bandwidth_limit_tok_s']:.1f} tok/s"],
        ["compute limit (matmul FLOP/s / 2·linear params)", f"{r['compute_limit_tok_s']:.0f} tok/s"]])


def render_decode(r: dict[str, Any]) -> str:
    rows = []
    for b, w in r["decode"].items():
        pd, tf, bd = w["pdserve"], w["transformers"], r["bound"][b]
        frac, speed = DECODE_TARGETS.get(int(b), (None, None))
        runs = (100 * pd["decode_tok_s"] / bd["tok_s"], pd["decode_tok_s"] / tf["decode_tok_s"])
        # round by round where the run has them (JSON written before it did: the median run over the best bound)
        paired = (100 * w["paired"]["of_bound"], w["paired"]["x_transformers"]) if "paired" in w else runs
        both = "paired" in w and pd.get("reps", 1) > 1  # one round: the two are the same figure
        rows.append([str(b), f"{pd['decode_tok_s']:.1f}", f"{tf['decode_tok_s']:.1f}",
                     f"{bd['tok_s']:.1f} ({bd['linear_s'] * 1e3:.0f} ms)",
                     check(paired[0], frac and 100 * frac, "{:.0f}%") + f" [{runs[0]:.0f}%]" * both,
                     check(paired[1], speed, "{:.2f}×") + f" [{runs[1]:.2f}×]" * both,
                     f"{pd['e2e_tok_s']:.1f} / {tf['e2e_tok_s']:.1f}", f"{pd['wall_s']:.1f} / {tf['wall_s']:.1f}",
                     pct(max_other(w, bd))])
    b1 = r["decode"][min(r["decode"])]
    bw = f"\n\nBatch 1 vs the bandwidth limit: {pct(b1['pdserve']['decode_tok_s'] / r['bandwidth_limit_tok_s'])}"
    return table(["batch", "pdserve decode tok/s", "transformers decode tok/s", "bound tok/s (linears)",
                  "% of bound", "× transformers", "e2e tok/s pd / tf", "wall s pd / tf", "other CPU"], rows) + bw


def render_prefill(r: dict[str, Any]) -> str:
    return table(["prompt tokens (batch 1)", "pdserve tok/s", "transformers tok/s", "× transformers",
                  "compute limit tok/s", "% of limit", "other CPU"],
                 [[str(n), f"{w['pdserve']['prefill_tok_s']:.0f}", f"{w['transformers']['prefill_tok_s']:.0f}",
                   f"{w['pdserve']['prefill_tok_s'] / w['transformers']['prefill_tok_s']:.2f}×",
                   f"{r['compute_limit_tok_s']:.0f}",
                   check(100 * w['pdserve']['prefill_tok_s'] / r['compute_limit_tok_s'],
                         100 * PREFILL_TARGET[1] if int(n) == PREFILL_TARGET[0] else None, "{:.0f}%"),
                   pct(max_other(w))] for n, w in r["prefill"].items()])


def render_split(r: dict[str, Any]) -> str:
    lw = r["long"]
    return table(["", "prefill s", "decode s", "decode tok/s", "wall s", "decode % of wall"],
                 [[k, f"{v['prefill_s']:.2f}", f"{v['decode_s']:.2f}", f"{v['decode_tok_s']:.1f}",
                   f"{v['wall_s']:.2f}", f"{v['decode_pct_of_wall']:.0f}%"]
                  for k, v in ((k, lw[k]) for k in ("pdserve", "transformers"))]
                 ) + f"\n\nOther processes' CPU share during it: {pct(max_other(lw))}"


def render(r: dict[str, Any]) -> str:
    m, p = r["machine"], r["plan"]
    noisy = max_other(r)
    warn = (f"\n**Warning: other processes used up to {pct(noisy)} of the CPU during a workload; those timings "
            f"are contaminated (see the 'other CPU' columns; waited {r['waited_for_quiet_s']:.0f} s for quiet, "
            f"{r['contended_retries']} workloads re-run). "
            "Re-run on a quiet machine.**\n" if noisy > 0.1 else "")
    cls = m.get("machine_class", "unknown CPU class")
    return (f"## Engine benchmark: {cls} ({r['dtype']}{', quick' if r['quick'] else ''})\n\n"
            f"Command: `{m['command']}` · {m['date']} · total {r['total_s']:.0f} s\n\n"
            f"Machine: {m['cpu']}, {m['cores']} cores, torch threads {m['torch_threads']} · CPU flags: "
            f"{m.get('isa', '?')} · torch {m['torch']} · "
            f"transformers {m['transformers']} (attention: {r['attn_implementation_transformers']})\n\n"
            f"pdserve ran {r['dtype']} ({r.get('dtype_reason', 'given')}), decode attention kernel "
            f"`{r.get('attention_kernel', '?')}`, linear {r.get('linear', 'plain')}, decode step "
            f"{'compiled' if r.get('compiled') else 'eager'}.\n{warn}"
            f"\n### Limits\n\n{render_limits(r)}\n\n"
            f"### Decode: {p['prompt_len']}-token random prompts, {p['new_tokens']} new tokens\n\n"
            f"pdserve ({'compiled decode, `EngineConfig(compile=True)`' if r.get('compile') else 'eager'}) decode "
            f"tok/s = decode tokens / decode seconds (engine stats); transformers = "
            f"{p['new_tokens'] - 1}·B / (t({p['new_tokens']} new) − t(1 new)). Bound = every nn.Linear + lm_head "
            f"alone, computed as the engine computes it (linear {r.get('linear', 'plain')}) + one read of the "
            f"batch's KV cache at the measured bandwidth (average context "
            f"{p['prompt_len'] + p['new_tokens'] / 2:.0f}); tok/s = B / time. {decode_runs(p)}\n\n"
            f"{render_decode(r)}\n\n"
            f"### Prefill\n\n{render_prefill(r)}\n\n"
            f"### {p['long_in']}-in / {p['long_out']}-out request, batch 1\n\n{render_split(r)}\n")


def write_report(path: Path, section: str, machine_class: str, kind: str = "engine") -> None:
    """Put `section` into `path` as the `kind` section of `machine_class`, replacing only that one."""
    start, end = markers(machine_class, kind)
    block = f"{start}\n{section}{end}\n"
    text = path.read_text() if path.exists() else "# pdserve benchmarks\n\n"
    if start in text and end in text:
        text = text[:text.index(start)] + block + text[text.index(end) + len(end):].lstrip("\n")
    else:
        text = text.rstrip("\n") + "\n\n" + block
    path.write_text(text)
