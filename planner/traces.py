"""Traces the planner simulates: when each request arrives, its prompt and output lengths.

A simulated request's life starts here: a `TraceRequest` says when it reaches the router (`arrival_s`,
from the trace's start), how long its prompt is, how many tokens it asks for (`max_tokens`, what the
router books KV for) and how many it really generates (`output_tokens`). Optional prompt content (token
ids, or Mooncake block hashes) lets prompts share prefixes, so prefix caches and prefix-aware placement
act as they do when serving.

Sources:
- a load generator workload (`loadtest.workload`: decode-heavy, chat, prefix:K:P:S:O, ...) at a rate:
  the same prompts and Poisson arrivals the load generator sends with that seed (`from_workload`);
- a load generator results file (`loadtest.report`): replays what was measured, each request at the
  time it was scheduled, with the output length it got (`from_results`);
- a JSONL trace, one request a line (`from_jsonl`): `timestamp` (milliseconds, as in the Mooncake
  traces) or `arrival_s` (seconds); `input_length` or `prompt_tokens`; `output_length` or
  `output_tokens`; optional `max_tokens`, and `hash_ids` (the Mooncake format: one id per block of
  `hash_block_tokens` prompt tokens; prompts with the same leading ids share that prefix).
A malformed line raises ValueError naming the file and the line number.

Boundary rule: never imports Ray, no torch.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

MOONCAKE_BLOCK_TOKENS = 512  # prompt tokens per hash id in the Mooncake traces


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace.

    Args:
        arrival_s: when it reaches the router, seconds from the trace's start (>= 0).
        prompt_tokens: prompt length (>= 1).
        output_tokens: tokens it generates (>= 1, <= max_tokens).
        max_tokens: tokens it asks for (what the router books KV blocks for); None: output_tokens.
        prompt_ids: the prompt's token ids, when the trace has them (len == prompt_tokens).
        hash_ids: Mooncake block hashes: block i (`Trace.hash_block_tokens` tokens) of the prompt is
            the same in every request whose first i + 1 hashes are the same.
        ignore_eos: it never stops before max_tokens (the load generator's default); the router's
            output-length estimate then is max_tokens.
    """

    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    max_tokens: int | None = None
    prompt_ids: tuple[int, ...] | None = None
    hash_ids: tuple[int, ...] = ()
    ignore_eos: bool = True

    def __post_init__(self) -> None:
        if not (math.isfinite(self.arrival_s) and self.arrival_s >= 0):
            raise ValueError(f"arrival_s must be a finite number >= 0, got {self.arrival_s!r}")
        if not _is_int(self.prompt_tokens) or self.prompt_tokens < 1:
            raise ValueError(f"prompt_tokens must be an integer >= 1, got {self.prompt_tokens!r}")
        if not _is_int(self.output_tokens) or self.output_tokens < 1:
            raise ValueError(f"output_tokens must be an integer >= 1, got {self.output_tokens!r}")
        if self.max_tokens is None:
            object.__setattr__(self, "max_tokens", self.output_tokens)
        if not _is_int(self.max_tokens) or self.max_tokens < self.output_tokens:
            raise ValueError(f"max_tokens must be an integer >= output_tokens ({self.output_tokens}), "
                             f"got {self.max_tokens!r}")
        if self.prompt_ids is not None and len(self.prompt_ids) != self.prompt_tokens:
            raise ValueError(f"prompt_ids holds {len(self.prompt_ids)} tokens, prompt_tokens says {self.prompt_tokens}")
        object.__setattr__(self, "hash_ids", tuple(self.hash_ids))
        if not all(_is_int(h) and h >= 0 for h in self.hash_ids):
            raise ValueError(f"hash_ids must be integers >= 0, got {self.hash_ids!r}")


@dataclass(frozen=True)
class Trace:
    """Args: requests: in arrival order (sorted here). source: where it came from, for reports.
    hash_block_tokens: prompt tokens per hash id (requests with `hash_ids`)."""

    requests: tuple[TraceRequest, ...]
    source: str
    hash_block_tokens: int = MOONCAKE_BLOCK_TOKENS
    shares_prefixes: bool = field(init=False)

    def __post_init__(self) -> None:
        if not self.requests:
            raise ValueError(f"trace {self.source} has no requests")
        object.__setattr__(self, "requests", tuple(sorted(self.requests, key=lambda r: r.arrival_s)))
        if self.hash_block_tokens < 1:
            raise ValueError(f"hash_block_tokens must be >= 1, got {self.hash_block_tokens}")
        object.__setattr__(self, "shares_prefixes", any(r.hash_ids or r.prompt_ids for r in self.requests))

    @property
    def duration_s(self) -> float:
        """From the first arrival to the last."""
        return self.requests[-1].arrival_s - self.requests[0].arrival_s

    @property
    def rate(self) -> float:
        """Mean arrival rate, requests/s (inf when they all arrive at once)."""
        return (len(self.requests) - 1) / self.duration_s if self.duration_s > 0 else math.inf

    def describe(self) -> str:
        """One line: source, requests, rate, mean prompt and output lengths."""
        n = len(self.requests)
        p = sum(r.prompt_tokens for r in self.requests) / n
        o = sum(r.output_tokens for r in self.requests) / n
        return (f"{self.source}: {n} requests over {self.duration_s:.1f} s ({self.rate:.3g} req/s), mean prompt "
                f"{p:.0f} tokens, mean output {o:.0f} tokens")


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def from_workload(name: str, num_requests: int, rate: float, seed: int = 0, max_context: int = 8192,
                  vocab_size: int = 49152) -> Trace:
    """The requests the load generator sends for `--workload name --rate rate --seed seed` (its first run):
    the same lengths, the same Poisson arrival times, and for prefix:K:P:S:O the same prompt token ids
    (`--vocab-size`), so they share the same prefixes.

    Args: name: a `loadtest.workload` name or JSONL workload file; num_requests (>= 1); rate: requests/s
    (inf: all at once); seed; max_context: most prompt + output tokens; vocab_size: the token ids' range.
    Raises: ValueError (a bad workload; a multi-turn one, whose turns wait on each other's answers)."""
    from loadtest.runner import poisson_arrivals
    from loadtest.workload import build_workload, is_file_workload, parse_workload_lengths

    if name == "multi-turn" or name.startswith("multi-turn:"):
        raise ValueError(f"workload {name!r} runs as conversations, each turn sent when the last one ended; "
                         "the planner replays open-loop arrivals: give a JSONL trace or another workload")
    arrivals = poisson_arrivals(rate, num_requests, seed)
    if name.startswith("prefix:") or is_file_workload(name):  # their prompts matter: shared prefixes, a file's
        specs = build_workload(name, num_requests, seed, max_context, vocab_size=vocab_size)
        shared = name.startswith("prefix:")
        requests = [TraceRequest(at, s.prompt_tokens, s.output_tokens, prompt_ids=s.prompt_token_ids if shared else None)
                    for s, at in zip(specs, arrivals)]
    else:  # lengths only: every prompt is its own (random ids share no prefix)
        lengths = parse_workload_lengths(name, num_requests, seed, max_context)
        requests = [TraceRequest(at, p, o) for (p, o), at in zip(lengths, arrivals)]
    return Trace(tuple(requests), f"workload {name} at {rate:g} req/s (seed {seed})")


def from_results(path: str | Path, run: int = 0) -> Trace:
    """Replay run `run` of a load generator results file: every request at the time it was scheduled
    (open loop) or sent (closed loop), the prompt length the server counted, the output it got (what it
    asked for when it failed). Raises: ValueError (not a results file, no such run, no records)."""
    from loadtest.report import load_results, run_records

    doc = load_results(path)
    runs = doc["runs"]
    if not 0 <= run < len(runs):
        raise ValueError(f"{path} holds {len(runs)} runs (0..{len(runs) - 1}), not run {run}")
    records = run_records(runs[run])
    if not records:
        raise ValueError(f"run {run} of {path} has no request records")
    requests = []
    for rec in records:
        prompt = rec.server_prompt_tokens or rec.prompt_tokens
        out = rec.output_tokens if rec.ok and rec.output_tokens >= 1 else rec.requested_output_tokens
        requests.append(TraceRequest(max(0.0, rec.scheduled_s), prompt, min(out, rec.requested_output_tokens),
                                     max_tokens=rec.requested_output_tokens))
    config = runs[run].get("config", {})
    mode = f"rate {config['rate']:g}" if config.get("mode") == "open" else f"{config.get('mode')} loop"
    return Trace(tuple(requests), f"results {path} run {run} ({mode})")


def from_jsonl(path: str | Path, hash_block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> Trace:
    """A JSONL trace (see the module docstring). Arrivals start at 0 (the first timestamp is subtracted).
    Raises: ValueError naming the file and the line of the first malformed line."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise ValueError(f"cannot read trace {path}: {e.strerror or e}") from None
    parsed: list[tuple[float, dict]] = []
    for lineno, line in enumerate(lines, 1):
        if line.strip():
            parsed.append(_jsonl_line(line, f"{path}:{lineno}"))
    if not parsed:
        raise ValueError(f"trace {path} has no requests")
    t0 = min(at for at, _ in parsed)
    return Trace(tuple(TraceRequest(at - t0, **kw) for at, kw in parsed), f"trace {path}", hash_block_tokens)


def _pick(obj: dict, names: tuple[str, ...], where: str, required: bool = True) -> object:
    found = [n for n in names if n in obj]
    if len(found) > 1:
        raise ValueError(f"{where}: give one of {' / '.join(names)}, not {' and '.join(found)}")
    if not found:
        if required:
            raise ValueError(f"{where}: missing {' or '.join(names)}")
        return None
    return obj[found[0]]


def _jsonl_line(line: str, where: str) -> tuple[float, dict]:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected an object with timestamp, input_length and output_length")  # noqa: TRY004 - bad input
    at = _pick(obj, ("timestamp", "arrival_s"), where)
    if not isinstance(at, (int, float)) or isinstance(at, bool) or not math.isfinite(at) or at < 0:
        raise ValueError(f"{where}: timestamp / arrival_s must be a number >= 0, got {at!r}")
    arrival = at / 1000.0 if "timestamp" in obj else float(at)
    kw: dict = {}
    for key, names in (("prompt_tokens", ("input_length", "prompt_tokens")),
                       ("output_tokens", ("output_length", "output_tokens"))):
        value = _pick(obj, names, where)
        if not _is_int(value) or value < 1:
            raise ValueError(f"{where}: {'/'.join(names)} must be an integer >= 1, got {value!r}")
        kw[key] = value
    max_tokens = obj.get("max_tokens")
    if max_tokens is not None:
        if not _is_int(max_tokens) or max_tokens < kw["output_tokens"]:
            raise ValueError(f"{where}: max_tokens must be an integer >= the output length, got {max_tokens!r}")
        kw["max_tokens"] = max_tokens
    hashes = obj.get("hash_ids", [])
    if not isinstance(hashes, list) or not all(_is_int(h) and h >= 0 for h in hashes):
        raise ValueError(f"{where}: hash_ids must be a list of integers >= 0")
    kw["hash_ids"] = tuple(hashes)
    return arrival, kw


def load_trace(spec: str, *, num_requests: int = 1000, rate: float | None = None, seed: int = 0,
               run: int = 0, hash_block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> Trace:
    """A trace from the command line's `--trace`: a .jsonl file (JSONL trace), a .json file (load generator
    results, run `run`), else a load generator workload (a name, or jsonl:PATH; needs `rate`).
    Raises: ValueError."""
    if spec.endswith(".jsonl") and not spec.startswith("jsonl:"):  # jsonl:PATH: a load generator workload file
        return from_jsonl(spec, hash_block_tokens)
    if spec.endswith(".json"):
        return from_results(spec, run)
    if rate is None:
        raise ValueError(f"trace {spec!r} is a workload: give its arrival rate (--rate, requests/s)")
    return from_workload(spec, num_requests, rate, seed)
