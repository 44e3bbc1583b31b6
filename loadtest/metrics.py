"""Summaries of a run's request records. Pure functions.

Definitions (all over successful requests only, i.e. records with no error):
  TTFT    send → first chunk carrying output (RequestRecord.ttft_s).
  ITL     gaps between consecutive output chunks of one request, pooled over all requests (a chunk may carry
          several tokens when the server batches text, so this is inter-chunk latency).
  TPOT    (e2e - ttft) / (output_tokens - 1) per request; requests with fewer than 2 output tokens have no
          TPOT and are left out of its statistics.
  e2e     send → end of the stream.
  Percentiles: linear interpolation between closest ranks (numpy.percentile's default "linear" method):
          for sorted x[0..n-1], p-th percentile = x[i] + (x[i+1] - x[i]) * f where i + f = p/100 * (n - 1).
          Every statistic has p50 / p90 / p99; a `PercentileSelection` adds more (e.g. p99.9, keyed by
          `percentile_key`) to the metrics it selects, and says which the text report shows.
  Throughput: successful requests / wall time, and their output tokens / wall time; wall time is the
          run's (first send to last end).
  Goodput: requests / wall time that succeeded AND met both targets: TTFT <= ttft_target_s and
          TPOT <= tpot_target_s (a request without a TPOT meets the TPOT target; a None target is not checked).
  Turns:  in a multi-turn run, the TTFT of the first turns and of the later ones (whose history a server
          may hold in its prefix cache), apart.
  Prefix cache: prompt tokens the server reported as served from its cache, against all prompt tokens of
          the requests that reported it (None when no request did).
  Prompt tokens: of the successful requests, as the workload counted them and as the server's usage did
          (None when no request reported it); they differ where a chat template wraps the messages.
"""
from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from loadtest.records import RequestRecord

PERCENTILES = (50, 90, 99)  # in every statistic, and the report's default columns
# vLLM's names (`vllm bench serve --percentile-metrics`) → the summary's keys
PERCENTILE_METRICS = {"ttft": "ttft_s", "tpot": "tpot_s", "itl": "itl_s", "e2el": "e2e_s"}


def percentile_key(p: float) -> str:
    """The statistic's key of the p-th percentile: p50, p99, p99.9 (as `vllm bench serve` names them)."""
    return f"p{int(p)}" if p == int(p) else f"p{p}"


@dataclass(frozen=True)
class PercentileSelection:
    """Which percentiles a summary carries beyond p50 / p90 / p99, and of which metrics.

    percentiles: each in [0, 100], ascending, no repeats; the text report's columns after the mean.
    metrics: names from PERCENTILE_METRICS (ttft, tpot, itl, e2el); they get the percentiles in the
    summary and are the text report's rows.
    """

    percentiles: tuple[float, ...] = PERCENTILES
    metrics: tuple[str, ...] = tuple(PERCENTILE_METRICS)

    def __post_init__(self) -> None:
        if not self.percentiles:
            raise ValueError("percentiles: give at least one")
        for p in self.percentiles:
            if not 0 <= p <= 100:
                raise ValueError(f"percentiles: each must be in [0, 100], got {p:g}")
        if list(self.percentiles) != sorted(set(self.percentiles)):
            raise ValueError(f"percentiles must be ascending without repeats, got {list(self.percentiles)}")
        unknown = [m for m in self.metrics if m not in PERCENTILE_METRICS]
        if unknown or not self.metrics or len(set(self.metrics)) != len(self.metrics):
            raise ValueError(f"percentile metrics must be distinct names from {', '.join(PERCENTILE_METRICS)}; "
                             f"got {', '.join(self.metrics) or 'none'}")

    @classmethod
    def parse(cls, percentiles: str | None = None, metrics: str | None = None) -> PercentileSelection:
        """From comma-separated lists ("50,90,99,99.9"; "ttft,tpot,itl,e2el"); None: the default.
        Percentiles are sorted and repeats dropped. Raises: ValueError saying what is wrong."""
        ps, ms = cls.percentiles, cls.metrics  # the defaults, as class attributes
        if percentiles is not None:
            items = [t.strip() for t in percentiles.split(",") if t.strip()]
            try:
                values = [float(t) for t in items]
            except ValueError:
                raise ValueError(f"percentiles: expected comma-separated numbers in [0, 100] (e.g. 50,90,99,99.9), "
                                 f"got {percentiles!r}") from None
            if any(math.isnan(v) for v in values):
                raise ValueError(f"percentiles: expected numbers in [0, 100], got {percentiles!r}")
            ps = tuple(sorted(set(values)))
        if metrics is not None:
            ms = tuple(dict.fromkeys(t.strip() for t in metrics.split(",") if t.strip()))
        return cls(ps, ms)


def percentile(values: Sequence[float], p: float) -> float:
    """Args: values (non-empty), p in [0, 100]. Returns: the p-th percentile, linear interpolation."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= p <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {p}")
    xs = sorted(values)
    pos = p / 100 * (len(xs) - 1)
    i = math.floor(pos)
    if i >= len(xs) - 1:
        return float(xs[-1])
    return float(xs[i] + (xs[i + 1] - xs[i]) * (pos - i))


def stats(values: Sequence[float], extra_percentiles: Iterable[float] = ()) -> dict[str, float | int | None]:
    """Returns: count, mean, min, max, p50/p90/p99 and the extra percentiles (keys `percentile_key`), in
    ascending order; None when there are no values."""
    ps = sorted(set(PERCENTILES).union(extra_percentiles))
    out: dict[str, float | int | None] = {"count": len(values)}
    if not values:
        return {**out, "mean": None, "min": None, "max": None, **{percentile_key(p): None for p in ps}}
    out.update(mean=math.fsum(values) / len(values), min=float(min(values)), max=float(max(values)))
    out.update({percentile_key(p): percentile(values, p) for p in ps})
    return out


def request_tpot(rec: RequestRecord) -> float | None:
    """Time per output token after the first, or None (failed, no TTFT, or fewer than 2 output tokens)."""
    if not rec.ok or rec.ttft_s is None or rec.e2e_s is None or rec.output_tokens < 2:
        return None
    return (rec.e2e_s - rec.ttft_s) / (rec.output_tokens - 1)


def request_itls(rec: RequestRecord) -> list[float]:
    """Gaps between the request's consecutive output chunks (empty for a failed request)."""
    if not rec.ok:
        return []
    ts = rec.chunk_times_s
    return [b - a for a, b in itertools.pairwise(ts)]


def is_good(rec: RequestRecord, ttft_target_s: float | None, tpot_target_s: float | None) -> bool:
    """Whether the request succeeded and met both latency targets (None: target not checked)."""
    if not rec.ok or rec.ttft_s is None:
        return False
    if ttft_target_s is not None and rec.ttft_s > ttft_target_s:
        return False
    tpot = request_tpot(rec)
    return tpot_target_s is None or tpot is None or tpot <= tpot_target_s


def summarize(records: Iterable[RequestRecord], wall_time_s: float, ttft_target_s: float | None = None,
              tpot_target_s: float | None = None, percentiles: PercentileSelection | None = None) -> dict[str, Any]:
    """Args: a run's records, its wall time (> 0), the goodput targets, the percentiles to add (None: the
    default selection). Returns: a JSON-ready summary: requests {total, ok, errors, short_outputs},
    errors_by_kind, wall_time_s, ttft_s / itl_s / tpot_s / e2e_s (see `stats`; the selected ones with the
    selected percentiles), percentiles {percentiles, metrics} (the selection), prompt_tokens {workload,
    server}, send_lag_s (how late requests were sent against the open-loop schedule; a large lag means the
    client, not the server, was the bottleneck), throughput {requests_per_s, output_tokens_per_s}, goodput
    {ttft_target_s, tpot_target_s, good_requests, requests_per_s, fraction}. short_outputs: successful requests that got fewer tokens than
    asked for (the server stopped early: EOS without ignore_eos, or a context limit)."""
    recs = list(records)
    if not wall_time_s > 0:
        raise ValueError(f"wall time must be > 0 s, got {wall_time_s}")
    ok = [r for r in recs if r.ok]
    good = sum(is_good(r, ttft_target_s, tpot_target_s) for r in recs)
    tpots = [t for t in map(request_tpot, ok) if t is not None]
    sel = percentiles if percentiles is not None else PercentileSelection()

    def latency(metric: str, values: list[float]) -> dict[str, float | int | None]:
        return stats(values, sel.percentiles if metric in sel.metrics else ())

    told = [r.server_prompt_tokens for r in ok if r.server_prompt_tokens is not None]
    return {
        "requests": {"total": len(recs), "ok": len(ok), "errors": len(recs) - len(ok),
                     "short_outputs": sum(r.output_tokens < r.requested_output_tokens for r in ok)},
        "errors_by_kind": dict(sorted(Counter(r.error_kind or "unknown" for r in recs if not r.ok).items())),
        "wall_time_s": wall_time_s,
        "ttft_s": latency("ttft", [r.ttft_s for r in ok if r.ttft_s is not None]),
        "itl_s": latency("itl", [g for r in ok for g in request_itls(r)]),
        "tpot_s": latency("tpot", tpots),
        "e2e_s": latency("e2el", [r.e2e_s for r in ok if r.e2e_s is not None]),
        "percentiles": {"percentiles": list(sel.percentiles), "metrics": list(sel.metrics)},
        "prompt_tokens": {"workload": sum(r.prompt_tokens for r in ok), "server": sum(told) if told else None},
        "send_lag_s": stats([r.start_s - r.scheduled_s for r in recs]),
        "throughput": {"requests_per_s": len(ok) / wall_time_s,
                       "output_tokens_per_s": sum(r.output_tokens for r in ok) / wall_time_s},
        "goodput": {"ttft_target_s": ttft_target_s, "tpot_target_s": tpot_target_s, "good_requests": good,
                    "requests_per_s": good / wall_time_s, "fraction": good / len(recs) if recs else 0.0},
        "turns": _turns(ok),
        "prefix_cache": _prefix_cache(ok),
    }


def _turns(ok: list[RequestRecord]) -> dict[str, Any] | None:
    if all(r.conversation is None for r in ok):
        return None
    return {"first_ttft_s": stats([r.ttft_s for r in ok if r.turn == 0 and r.ttft_s is not None]),
            "later_ttft_s": stats([r.ttft_s for r in ok if r.turn > 0 and r.ttft_s is not None])}


def _prefix_cache(ok: list[RequestRecord]) -> dict[str, Any] | None:
    told = [r for r in ok if r.cached_tokens is not None]
    if not told:
        return None
    cached, prompt = sum(r.cached_tokens for r in told), sum(r.server_prompt_tokens or r.prompt_tokens for r in told)
    return {"cached_tokens": cached, "prompt_tokens": prompt, "fraction": cached / prompt if prompt else 0.0}
