"""What a request will cost, for the placement policy: measured phase costs and expected output length.

`CostModel`: prefill, decode step, KV transfer and extra round trips, calibrated at start-up (each pool
times a few prompts, decode batches and transfers) and fitted here; nothing guessed; JSON round trip
(`load_cost_model`: one saved to a file, or a running pdserve's).
`OutputLengthEstimator`: tightens max_tokens from the lengths of recent finished requests.
`Correction`: online actual / predicted factors for TTFT (per path) and TPOT, from served requests.
"""
from __future__ import annotations

import http.client
import itertools
import json
import math
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path


def _check_nonneg(name: str, value: float) -> None:
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


@dataclass(frozen=True)
class LinearFit:
    """seconds = fixed_s + per_unit_s * x, both coefficients >= 0.

    Args:
        fixed_s: seconds paid whatever x is.
        per_unit_s: seconds per unit of x (token, byte).
    """

    fixed_s: float
    per_unit_s: float

    def __post_init__(self) -> None:
        _check_nonneg("fixed_s", self.fixed_s)
        _check_nonneg("per_unit_s", self.per_unit_s)

    def __call__(self, x: float) -> float:
        """Args: x: units (>= 0). Returns: seconds."""
        return self.fixed_s + self.per_unit_s * x

    @classmethod
    def fit(cls, xs: Sequence[float], ys: Sequence[float]) -> LinearFit:
        """Least-squares line through measurements, coefficients clamped at >= 0.

        Args:
            xs: units per measurement (>= 0).
            ys: seconds per measurement (>= 0).
        Returns:
            The fit. One distinct x gives a line through the origin (fixed 0, slope mean(y)/x).
        """
        if len(xs) != len(ys):
            raise ValueError(f"xs and ys must have the same length, got {len(xs)} and {len(ys)}")
        if not xs:
            raise ValueError("xs must hold at least one measurement")
        for x, y in zip(xs, ys):
            _check_nonneg("xs[i]", x)
            _check_nonneg("ys[i]", y)
        n = len(xs)
        mx, my = sum(xs) / n, sum(ys) / n
        sxx = sum((x - mx) ** 2 for x in xs)
        if sxx == 0:  # one distinct x: all of it is per-unit cost
            return cls(my, 0.0) if mx == 0 else cls(0.0, my / mx)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
        fixed = my - slope * mx
        if slope < 0:  # best flat line
            return cls(my, 0.0)
        if fixed < 0:  # best line through the origin
            return cls(0.0, sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs))
        return cls(fixed, slope)

    def to_dict(self) -> dict:
        """Returns: {"fixed_s": ..., "per_unit_s": ...}."""
        return {"fixed_s": self.fixed_s, "per_unit_s": self.per_unit_s}

    @classmethod
    def from_dict(cls, d: dict) -> LinearFit:
        """Args: d: as written by `to_dict`. Returns: the fit."""
        return cls(float(_field(d, "fixed_s")), float(_field(d, "per_unit_s")))


def _field(d: dict, name: str) -> object:
    if not isinstance(d, dict) or name not in d:
        raise ValueError(f"cost model dict is missing the field {name!r}")
    return d[name]


@dataclass(frozen=True)
class CostModel:
    """What each phase costs on this deployment.

    Args:
        prefill: prefill seconds on a prefill worker vs prompt tokens.
        local_prefill: prefill seconds on a decode worker (its own device) vs prompt tokens.
        decode_step: (batch size, seconds per decode step), strictly increasing batch, >= 1 point.
        transfer: seconds to move the KV of one request vs bytes.
        kv_bytes_per_token: KV bytes of one token over all layers.
        num_layers: model layers (KV ships layer by layer).
        hop_s: extra round trips of the remote path (reserve + start), seconds.
        prefill_chunk_tokens: prompt tokens a worker computes per step (None: a whole prompt in one step).
        decode_ride: what decoding sequences add to a step that computes a prompt chunk beside them, as a
            fraction of their decode step alone (measured: near 0 where decode is memory-bound and rides
            on the chunk's pass; near 1 on a CPU where both are compute-bound; 1 when unknown).
        decode_context: the tokens of context each sequence of the `decode_step` points held.
        decode_context_s: seconds a decode step adds per token of context its sequences hold beyond
            `decode_context` each (their attention's KV reads; 0 when unknown: any context costs the same).
        prefill_context_s: seconds a prompt token adds per token of cached prefix it attends over (its
            attention reads the prefix's KV; 0 when unknown: a prefix cache hit costs nothing to compute
            over). Prompts computed whole are in `prefill` / `local_prefill` as measured.
        decode_beside_prefill / prefill_beside_decode: what a decode worker's decode step takes while a
            prefill worker computes a prompt, and a prefill worker's prompt while a decode worker decodes,
            over what each takes alone (>= 1; measured: above 1 where the two share a node's memory
            bandwidth and caches, 1 on separate devices or when unknown).
    """

    prefill: LinearFit
    local_prefill: LinearFit
    decode_step: tuple[tuple[int, float], ...]
    transfer: LinearFit
    kv_bytes_per_token: int
    num_layers: int
    hop_s: float
    prefill_chunk_tokens: int | None = None
    decode_ride: float = 1.0
    decode_context: int = 64
    decode_context_s: float = 0.0
    prefill_context_s: float = 0.0
    decode_beside_prefill: float = 1.0
    prefill_beside_decode: float = 1.0

    def __post_init__(self) -> None:
        for name in ("prefill", "local_prefill", "transfer"):
            if not isinstance(getattr(self, name), LinearFit):
                raise TypeError(f"{name} must be a LinearFit, got {type(getattr(self, name)).__name__}")
        points = tuple((int(b), float(s)) for b, s in self.decode_step)
        object.__setattr__(self, "decode_step", points)  # lists (JSON) -> tuples
        if not points:
            raise ValueError("decode_step must hold at least one (batch, seconds) point")
        for i, (b, s) in enumerate(points):
            if b < 1:
                raise ValueError(f"decode_step batch sizes must be >= 1, got {b}")
            if not (math.isfinite(s) and s > 0):
                raise ValueError(f"decode_step seconds must be finite and > 0, got {s!r} at batch {b}")
            if i and b <= points[i - 1][0]:
                raise ValueError(f"decode_step must be sorted by strictly increasing batch, got {points}")
        if self.kv_bytes_per_token < 1:
            raise ValueError(f"kv_bytes_per_token must be >= 1, got {self.kv_bytes_per_token}")
        if self.num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {self.num_layers}")
        _check_nonneg("hop_s", self.hop_s)
        if self.prefill_chunk_tokens is not None and self.prefill_chunk_tokens < 1:
            raise ValueError(f"prefill_chunk_tokens must be >= 1 or None, got {self.prefill_chunk_tokens}")
        if not (math.isfinite(self.decode_ride) and 0 <= self.decode_ride <= 1):
            raise ValueError(f"decode_ride must be in [0, 1], got {self.decode_ride!r}")
        if self.decode_context < 1:
            raise ValueError(f"decode_context must be >= 1, got {self.decode_context}")
        _check_nonneg("decode_context_s", self.decode_context_s)
        _check_nonneg("prefill_context_s", self.prefill_context_s)
        for name in ("decode_beside_prefill", "prefill_beside_decode"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) >= 1):
                raise ValueError(f"{name} must be a finite number >= 1, got {getattr(self, name)!r}")

    def prefill_s(self, tokens: int, cached: int = 0) -> float:
        """Args: tokens: prompt tokens computed. cached: prefix tokens before them its cache holds.
        Returns: prefill seconds on a prefill worker."""
        return self.prefill(tokens) + self.prefill_context_s * tokens * cached

    def local_prefill_s(self, tokens: int, cached: int = 0) -> float:
        """Args: tokens: prompt tokens computed. cached: prefix tokens before them its cache holds.
        Returns: prefill seconds on a decode worker."""
        return self.local_prefill(tokens) + self.prefill_context_s * tokens * cached

    def chunks(self, tokens: int) -> list[int]:
        """Args: tokens: prompt tokens. Returns: the sizes of the chunks (one per step) they prefill in."""
        c = self.prefill_chunk_tokens or tokens
        return [c] * ((tokens - 1) // c) + [tokens - c * ((tokens - 1) // c)]

    def local_prefill_wall_s(self, tokens: int, running: int, cached: int = 0) -> float:
        """Seconds until a prompt prefilled on a decode worker (`tokens` computed over `cached` its cache
        holds) has its first token: its chunks' steps, each also decoding the `running` sequences beside it
        (`decode_ride` of their decode step)."""
        ride = len(self.chunks(tokens)) * self.step_s(running) * self.decode_ride if running else 0.0
        return self.local_prefill_s(tokens, cached) + ride

    def local_stall_s(self, tokens: int, running: int, cached: int = 0) -> float:
        """Seconds each of a decode worker's running streams loses while a prompt of `tokens` (over `cached`
        its cache holds) prefills there: what the steps carrying its chunks take beyond the decode steps
        they stand in for."""
        step = self.step_s(max(1, running))
        saved = len(self.chunks(tokens)) * step * (1 - self.decode_ride)
        return max(0.0, self.local_prefill_s(tokens, cached) - saved)

    def step_s(self, batch: float) -> float:
        """Seconds per decode step, piecewise linear over `decode_step`.

        Args:
            batch: sequences in the step (a mean batch too).
        Returns:
            Below the first point: its value; beyond the last: the last segment's slope (clamped
            at >= 0, so noise never makes bigger batches cheaper), constant with one point.
        """
        pts = self.decode_step
        if batch <= pts[0][0]:
            return pts[0][1]
        for (b0, s0), (b1, s1) in itertools.pairwise(pts):
            if batch <= b1:
                return s0 + (s1 - s0) * (batch - b0) / (b1 - b0)
        if len(pts) == 1:
            return pts[0][1]
        (b0, s0), (b1, s1) = pts[-2], pts[-1]
        return s1 + max(0.0, (s1 - s0) / (b1 - b0)) * (batch - b1)

    def decode_s(self, batch: float, context_tokens: float) -> float:
        """Seconds of a decode step whose `batch` sequences hold `context_tokens` tokens of context in all:
        `step_s(batch)` and `decode_context_s` per token beyond `decode_context` each (never less than
        `step_s(batch)`)."""
        return self.step_s(batch) + self.decode_context_s * max(0.0, context_tokens - batch * self.decode_context)

    def beside(self, pool: str, share: float) -> float:
        """What `pool`'s steps ("prefill": prompts; "decode": decode-only steps) take over alone when `share` of
        them (0 to 1) run while a worker of the other pool computes."""
        factor = self.prefill_beside_decode if pool == "prefill" else self.decode_beside_prefill
        return 1 + (factor - 1) * share

    def transfer_s(self, tokens: int) -> float:
        """Args: tokens: tokens whose KV moves. Returns: seconds for the whole transfer."""
        return self.transfer(tokens * self.kv_bytes_per_token)

    def exposed_transfer_s(self, tokens: int, whole: bool = False, held: bool = False) -> float:
        """Transfer seconds TTFT still pays when KV ships layer by layer while the later layers of the
        prompt's last chunk compute.

        Args:
            tokens: prompt tokens.
            whole: the prompt is prefilled in one step (alone on its prefill worker), its one chunk.
            held: the prefill worker computes with borrowed threads, and holds the layers until the last
                (`PrefillWorker._after_layer`): the whole transfer follows the prefill.
        Returns:
            max(transfer / num_layers, transfer - last chunk's prefill * (num_layers - 1) / num_layers),
            or the whole transfer when held.
        """
        t, layers = self.transfer_s(tokens), self.num_layers
        if held:
            return t
        last = tokens if whole else self.chunks(tokens)[-1]
        return max(t / layers, t - self.prefill_s(last) * (layers - 1) / layers)

    def to_dict(self) -> dict:
        """Returns: a JSON-serialisable dict; `from_dict` reads it back."""
        return {
            "prefill": self.prefill.to_dict(),
            "local_prefill": self.local_prefill.to_dict(),
            "decode_step": [[b, s] for b, s in self.decode_step],
            "transfer": self.transfer.to_dict(),
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "num_layers": self.num_layers,
            "hop_s": self.hop_s,
            "prefill_chunk_tokens": self.prefill_chunk_tokens,
            "decode_ride": self.decode_ride,
            "decode_context": self.decode_context,
            "decode_context_s": self.decode_context_s,
            "prefill_context_s": self.prefill_context_s,
            "decode_beside_prefill": self.decode_beside_prefill,
            "prefill_beside_decode": self.prefill_beside_decode,
        }

    def for_workers(self, kv_bytes_per_token: int, num_layers: int, prefill_chunk_tokens: int | None,
                    prefill_workers: bool) -> CostModel:
        """This cost model for workers whose KV takes `kv_bytes_per_token` over `num_layers` layers, whose prompts
        go in chunks of `prefill_chunk_tokens` (their setting, not a measurement: theirs is kept), with or without
        `prefill_workers`. Raises: ValueError naming the field when the workers' KV geometry differs (another
        model or dtype), or when they have prefill workers and it was measured without (no transfer timed)."""
        for name, theirs in (("kv_bytes_per_token", kv_bytes_per_token), ("num_layers", num_layers)):
            if getattr(self, name) != theirs:
                raise ValueError(f"cost_model: measured on another model or dtype ({name} {getattr(self, name)}; "
                                 f"these workers' {theirs})")
        if prefill_workers and self.transfer == LinearFit(0.0, 0.0):  # calibrated without: remote costs copied
            raise ValueError("cost_model: measured without prefill workers (transfer 0 s: no KV transfer timed); "
                             "this deployment has them: calibrate it, or give a cost model of one that had")
        return replace(self, prefill_chunk_tokens=prefill_chunk_tokens)

    @classmethod
    def from_dict(cls, d: dict) -> CostModel:
        """Args: d: as written by `to_dict`. Returns: the cost model (validated)."""
        steps = _field(d, "decode_step")
        if not isinstance(steps, (list, tuple)) or not all(isinstance(p, (list, tuple)) and len(p) == 2
                                                           for p in steps):
            raise ValueError(f"decode_step must be a list of [batch, seconds] pairs, got {steps!r}")
        return cls(
            prefill=LinearFit.from_dict(_field(d, "prefill")),
            local_prefill=LinearFit.from_dict(_field(d, "local_prefill")),
            decode_step=tuple((int(b), float(s)) for b, s in steps),
            transfer=LinearFit.from_dict(_field(d, "transfer")),
            kv_bytes_per_token=int(_field(d, "kv_bytes_per_token")),
            num_layers=int(_field(d, "num_layers")),
            hop_s=float(_field(d, "hop_s")),
            # absent from a model written before prompts were chunked: whole prompts, nothing shared
            prefill_chunk_tokens=d.get("prefill_chunk_tokens"),
            decode_ride=float(d.get("decode_ride", 1.0)),
            # absent from a model written before decode steps were timed at two contexts: context costs nothing
            decode_context=int(d.get("decode_context", 64)),
            decode_context_s=float(d.get("decode_context_s", 0.0)),
            # absent from a model written before prompts were timed over a cached prefix: it costs nothing
            prefill_context_s=float(d.get("prefill_context_s", 0.0)),
            decode_beside_prefill=float(d.get("decode_beside_prefill", 1.0)),  # absent: measured apart, never
            prefill_beside_decode=float(d.get("prefill_beside_decode", 1.0)),
        )


def load_cost_model(source: str, timeout_s: float = 10.0) -> CostModel:
    """A measured cost model (the `--cost-model` of `pdserve serve` and `pdserve plan`). Args: source: a
    pdserve HTTP address (http://HOST:PORT; its `/pdserve/cost_model` is read) or a JSON file of
    `CostModel.to_dict()`. Raises: ValueError naming the flag and what is wrong."""
    remote = source.startswith(("http://", "https://"))
    where = source.rstrip("/") + "/pdserve/cost_model" if remote else source
    try:
        if remote:
            with urllib.request.urlopen(where, timeout=timeout_s) as r:
                data = json.loads(r.read())
        else:
            data = json.loads(Path(source).read_text())
    # OSError: no such file, refused or timed out; ValueError: not UTF-8 or JSON, a malformed URL; HTTPException:
    # an answer that is no HTTP (another service's port)
    except (OSError, ValueError, http.client.HTTPException) as e:
        raise ValueError(f"cost_model: cannot read {where}: {e}") from None
    try:
        return CostModel.from_dict(data)
    except (TypeError, ValueError, OverflowError) as e:  # a field of the wrong type, out of range, or infinite
        raise ValueError(f"cost_model: {where} holds no valid cost model: {e}") from None


class OutputLengthEstimator:
    """Tightens max_tokens to an expected output length from recent finished requests.

    Args:
        min_samples: observations needed before estimating (>= 1); until then max_tokens.
        alpha: EMA weight of the newest observation, in (0, 1].
    """

    def __init__(self, min_samples: int = 8, alpha: float = 0.1) -> None:
        if min_samples < 1:
            raise ValueError(f"min_samples must be >= 1, got {min_samples}")
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha!r}")
        self.min_samples = min_samples
        self.alpha = alpha
        self.samples = 0
        self.stop_ema: float | None = None  # output tokens of requests that stopped on their own
        self.length_share: float | None = None  # EMA of "hit max_tokens"

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.alpha * (new - old)

    def observe(self, output_tokens: int, max_tokens: int, finish_reason: str) -> None:
        """Args: output_tokens: tokens generated. max_tokens: the request's limit. finish_reason: "stop"
        or "length" count; anything else (abort, error) says nothing about lengths and is ignored."""
        if finish_reason not in ("stop", "length"):
            return
        self.samples += 1
        hit = finish_reason == "length"
        self.length_share = self._ema(self.length_share, float(hit))
        if not hit:
            self.stop_ema = self._ema(self.stop_ema, float(output_tokens))

    def expected(self, max_tokens: int, ignore_eos: bool) -> int:
        """Args: max_tokens: the request's limit (>= 1). ignore_eos: the request never stops early.
        Returns: expected output tokens, in [1, max_tokens]."""
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        if ignore_eos or self.samples < self.min_samples or self.stop_ema is None:
            return max_tokens
        if self.length_share is not None and self.length_share > 0.5:
            return max_tokens
        return min(max_tokens, max(1, round(self.stop_ema * 1.5)))


class Correction:
    """What the cost model gets wrong, learnt while serving: a factor per (quantity, path), quantity
    "ttft" or "tpot", path "remote" or "local", that the policy multiplies its estimates by.

    Each finished request's actual value over the corrected estimate it was placed with moves the
    factor by `rate` of that ratio's logarithm: a steady bias is learnt in a few dozen requests and
    drift is followed; a factor stays within [1 / limit, limit].

    Args:
        rate: share of each observation's log-ratio taken (0 < rate <= 1).
        limit: the largest correction either way (> 1).
    """

    QUANTITIES = ("ttft", "tpot")
    PATHS = ("remote", "local")

    def __init__(self, rate: float = 0.1, limit: float = 10.0) -> None:
        if not 0 < rate <= 1:
            raise ValueError(f"rate must be in (0, 1], got {rate!r}")
        if not limit > 1:
            raise ValueError(f"limit must be > 1, got {limit!r}")
        self.rate, self.limit = rate, limit
        self.factors = {(q, p): 1.0 for q in self.QUANTITIES for p in self.PATHS}

    def factor(self, quantity: str, path: str) -> float:
        return self.factors[(quantity, path)]

    def observe(self, quantity: str, path: str, actual: float, predicted: float) -> float | None:
        """Learn from one request. Returns actual / predicted, or None when either is not > 0."""
        if not (actual > 0 and predicted > 0 and math.isfinite(actual) and math.isfinite(predicted)):
            return None
        ratio = actual / predicted
        f = self.factors[(quantity, path)] * ratio ** self.rate
        self.factors[(quantity, path)] = min(self.limit, max(1 / self.limit, f))
        return ratio
