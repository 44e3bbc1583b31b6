"""Hardware profiles: the `CostModel` simulated workers run with.

A simulated request's every step costs what the profile's cost model says (see `planner.sim`), so the
profile is where a plan's hardware comes from:
(a) measured: the cost model a running pdserve calibrated at start-up (`GET /pdserve/cost_model`), or
    that JSON saved to a file (`router.cost_model.load_cost_model`): the same numbers its router places requests with;
(b) roofline: from a model's `config.json` and a device's peak FLOP/s, memory bandwidth and link
    bandwidth (`DEVICES`: A100, H100, H200, L4 and two CPUs), scaled by efficiency factors
    (`Efficiency`, overridable; the defaults are typical shares of peak, not measured by pdserve):
    - prefill of n tokens: fixed = step overhead + weight bytes / (bandwidth x memory efficiency),
      per token = 2 x matmul parameters / (FLOP/s x compute efficiency) (the two roofline regimes added;
      attention's context-dependent FLOPs are left out);
    - a decode step of batch B at context C: step overhead + max((weight bytes + B x C x KV bytes per
      token) / (bandwidth x memory efficiency), B x 2 x matmul parameters / (FLOP/s x compute efficiency)),
      at batch sizes 1, 2, 4, ... up to the largest batch;
    - what B decoding rows add to a prompt chunk's step (decode_ride): their FLOPs and their KV reads,
      as a share of their own decode step, at half the largest batch;
    - KV transfer: link latency + bytes / (link bandwidth x link efficiency); `hop_s` from the efficiency.

Boundary rule: never imports Ray, no torch.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields, replace
from pathlib import Path

from router.cost_model import CostModel, LinearFit

GiB = 1 << 30
KINDS = ("gpu", "cpu")


@dataclass(frozen=True)
class DeviceSpec:
    """One device a worker runs on.

    Args:
        name: its key in `DEVICES`.
        kind: "gpu" or "cpu" (which default `Efficiency` applies).
        flops: dense 16-bit (bf16) FLOP/s, peak.
        memory_bandwidth: bytes/s, peak.
        link_bandwidth: bytes/s one way between two workers (the KV transfer).
        memory_gib: device memory (weights + KV cache), GiB.
        note: what the figures are.
    """

    name: str
    kind: str
    flops: float
    memory_bandwidth: float
    link_bandwidth: float
    memory_gib: float
    note: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        for name in ("flops", "memory_bandwidth", "link_bandwidth", "memory_gib"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


DEVICES: tuple[DeviceSpec, ...] = (
    DeviceSpec("a100", "gpu", 312e12, 2.039e12, 300e9, 80, "A100 SXM 80GB: bf16 dense, HBM2e, NVLink 3 one way"),
    DeviceSpec("h100", "gpu", 989e12, 3.35e12, 450e9, 80, "H100 SXM 80GB: bf16 dense, HBM3, NVLink 4 one way"),
    DeviceSpec("h200", "gpu", 989e12, 4.8e12, 450e9, 141, "H200 SXM 141GB: bf16 dense, HBM3e, NVLink 4 one way"),
    DeviceSpec("l4", "gpu", 121e12, 300e9, 32e9, 24, "L4 24GB: bf16 dense, GDDR6, PCIe 4.0 x16 one way"),
    DeviceSpec("xeon-8480", "cpu", 115e12, 307e9, 12.5e9, 256, "Xeon Platinum 8480+ (56 cores, AMX bf16 at "
               "2.0 GHz), 8 channels DDR5-4800, 100 Gb/s network"),
    DeviceSpec("cpu-2core-avx2", "cpu", 192e9, 25e9, 5e9, 8, "2 cores at 3 GHz, AVX2 FMA (fp32), dual-channel "
               "DDR4, loopback transfers"),
)
DEVICE_NAMES = tuple(d.name for d in DEVICES)
assert len(set(DEVICE_NAMES)) == len(DEVICES), "device names must be unique"
assert {"a100", "h100", "h200", "l4"} <= set(DEVICE_NAMES) and any(d.kind == "cpu" for d in DEVICES)


def device(name: str) -> DeviceSpec:
    """Args: a `DEVICE_NAMES` name (any case). Raises: ValueError listing the known ones."""
    for d in DEVICES:
        if d.name == name.lower():
            return d
    raise ValueError(f"unknown device {name!r}; known: {', '.join(DEVICE_NAMES)}")


@dataclass(frozen=True)
class Efficiency:
    """The shares of a device's peak a serving engine reaches, and its fixed costs.

    Args:
        compute: share of peak FLOP/s in matmuls, in (0, 1].
        memory: share of peak memory bandwidth streaming weights and KV, in (0, 1].
        link: share of the link's bandwidth a KV transfer gets, in (0, 1].
        step_overhead_s: fixed seconds per engine step (launches, scheduling), >= 0.
        link_latency_s: fixed seconds per KV transfer, >= 0.
        hop_s: the remote path's extra round trips, seconds, >= 0.
    """

    compute: float
    memory: float
    link: float
    step_overhead_s: float
    link_latency_s: float
    hop_s: float

    def __post_init__(self) -> None:
        for name in ("compute", "memory", "link"):
            value = getattr(self, name)
            if not (math.isfinite(value) and 0 < value <= 1):
                raise ValueError(f"efficiency {name} must be in (0, 1], got {value!r}")
        for name in ("step_overhead_s", "link_latency_s", "hop_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"efficiency {name} must be a finite number >= 0, got {value!r}")

    def with_overrides(self, text: str) -> Efficiency:
        """Args: "name=value,..." over this one's fields (e.g. "compute=0.5,memory=0.8").
        Raises: ValueError naming an unknown field or a bad value."""
        return _overridden(self, text, "efficiency")


def _overridden(obj: object, text: str, what: str) -> object:
    """A copy of the dataclass `obj` with "name=value,..." (numbers) over its fields. Raises: ValueError
    naming `what`, the part, and an unknown field or a bad value."""
    names = {f.name for f in fields(obj)}
    changes = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        if not sep or name.strip() not in names:
            raise ValueError(f"{what} override {part!r}: use NAME=VALUE with NAME one of {sorted(names)}")
        try:
            changes[name.strip()] = float(value)
        except ValueError:
            raise ValueError(f"{what} override {part!r}: {value!r} is not a number") from None
    return replace(obj, **changes)


@dataclass(frozen=True)
class ServingFactors:
    """What serving adds to a measured cost model's times (all 1 / 0: as calibrated).

    A measured cost model times each phase inside the engine at start-up, one engine at a time; serving
    adds what that leaves out: engines computing side by side on one node slow each other down, and the
    worker's loop and the token feed take their share (`decode`, a factor on a step's decode rows, and
    `decode_step_s`, seconds each step with decode rows takes beyond that at any batch; `prefill`, a
    factor on its prompt tokens; `prefill_beside`, what a prefill worker's step takes while a decode
    worker computes, over its time alone, in place of the cost model's `prefill_beside_decode`: start-up
    times the two engines beside each other with nothing else running, serving streams the decode
    worker's tokens through the router on the same cores), and the router, its hops to the workers and
    the HTTP server put a latency between the engine and the client (`latency_s`, added to when each
    request's first and last token arrive; it holds no worker up). KV transfers stay as calibrated. The
    placement policy still prices with the plain cost model, as the server's does (its `Correction`
    learns the rest in both).
    `pdserve plan --validate` measures them (`Comparison.measured_factors`: from the workers' served steps
    over the cost model's, `planner.validate.ServedSteps`, and measured minus simulated TTFT p50);
    `--factors` applies them.

    Args: prefill, decode: finite numbers > 0. decode_step_s, latency_s: seconds, finite, >= 0.
        prefill_beside: a finite number >= 1, or 0: the cost model's.
    """

    prefill: float = 1.0
    decode: float = 1.0
    latency_s: float = 0.0
    decode_step_s: float = 0.0
    prefill_beside: float = 0.0

    def __post_init__(self) -> None:
        beside = self.prefill_beside
        if not (isinstance(beside, (int, float)) and math.isfinite(beside) and (beside == 0 or beside >= 1)):
            raise ValueError(f"serving factor prefill_beside must be 0 (the cost model's) or a finite number >= 1, "
                             f"got {beside!r}")
        for name in ("prefill", "decode"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"serving factor {name} must be a finite number > 0, got {value!r}")
        for name in ("latency_s", "decode_step_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"serving factor {name} must be a finite number >= 0 seconds, got {value!r}")

    def with_overrides(self, text: str) -> ServingFactors:
        """Args: "prefill=X,decode=Y,decode_step_s=S,latency_s=Z,prefill_beside=B" (any of them). Raises:
        ValueError naming a bad part."""
        return _overridden(self, text, "serving factor")

    def applied(self, cost: CostModel) -> CostModel:
        """`cost` with `prefill_beside` in place of its `prefill_beside_decode` (`cost` itself where it is 0)."""
        return replace(cost, prefill_beside_decode=self.prefill_beside) if self.prefill_beside else cost

    def describe(self) -> str:
        return (f"prefill={self.prefill:.3g},decode={self.decode:.3g},decode_step_s={self.decode_step_s:.3g},"
                f"latency_s={self.latency_s:.3g}" + (f",prefill_beside={self.prefill_beside:.3g}"
                                                     if self.prefill_beside else ""))


AS_CALIBRATED = ServingFactors()  # served steps take the cost model's times


DEFAULT_EFFICIENCY = {
    "gpu": Efficiency(compute=0.45, memory=0.75, link=0.7, step_overhead_s=0.002, link_latency_s=0.0005,
                      hop_s=0.003),
    "cpu": Efficiency(compute=0.3, memory=0.6, link=0.5, step_overhead_s=0.003, link_latency_s=0.001, hop_s=0.006),
}
assert set(DEFAULT_EFFICIENCY) == set(KINDS)

_GATED_MLP_OFF = ("gpt2", "gpt_neox", "opt", "bloom", "falcon", "gptj", "phi")  # two-matrix MLPs


@dataclass(frozen=True)
class ModelShape:
    """What the roofline needs of a decoder-only transformer (a Hugging Face config.json).

    Args: num_layers, hidden_size, num_heads, num_kv_heads, head_dim, intermediate_size, vocab_size: its
    shape. dtype_bytes: bytes per weight and KV element. gated_mlp: three MLP matrices (SwiGLU) or two.
    tied_embeddings: the output head shares the input embeddings (still read every step).
    """

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    dtype_bytes: int = 2
    gated_mlp: bool = True
    tied_embeddings: bool = False

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "int" and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"model {f.name} must be an integer >= 1, got {value!r}")

    @classmethod
    def from_config(cls, config: dict | str | Path) -> ModelShape:
        """Args: a config.json's contents, the file, or the model directory holding it.
        Raises: ValueError naming a missing field, or for a mixture-of-experts model."""
        if not isinstance(config, dict):
            path = Path(config)
            path = path / "config.json" if path.is_dir() else path
            try:
                config = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError) as e:
                raise ValueError(f"cannot read model config {path}: {e}") from None
        cfg = config.get("text_config", config)
        if any(k in cfg for k in ("num_local_experts", "num_experts", "n_routed_experts")):
            raise ValueError("mixture-of-experts models are not in the roofline profile (active parameters "
                             "differ from stored ones); give a measured cost model")

        def need(*names: str) -> int:
            for n in names:
                if n in cfg:
                    return cfg[n]
            raise ValueError(f"model config lacks {' / '.join(names)}")
        hidden, heads = need("hidden_size", "n_embd", "d_model"), need("num_attention_heads", "n_head")
        dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
        return cls(num_layers=need("num_hidden_layers", "n_layer"), hidden_size=hidden, num_heads=heads,
                   num_kv_heads=cfg.get("num_key_value_heads") or heads,
                   head_dim=cfg.get("head_dim") or hidden // heads,
                   intermediate_size=cfg.get("intermediate_size") or cfg.get("n_inner") or 4 * hidden,
                   vocab_size=need("vocab_size"), dtype_bytes=4 if "32" in dtype else 2,
                   gated_mlp=cfg.get("model_type") not in _GATED_MLP_OFF,
                   tied_embeddings=bool(cfg.get("tie_word_embeddings", False)))

    @property
    def matmul_params(self) -> int:
        """Parameters every token multiplies by: attention and MLP of each layer, and the output head."""
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        attention = self.hidden_size * (2 * q + 2 * kv)
        mlp = (3 if self.gated_mlp else 2) * self.hidden_size * self.intermediate_size
        return self.num_layers * (attention + mlp) + self.vocab_size * self.hidden_size

    @property
    def flops_per_token(self) -> float:
        return 2.0 * self.matmul_params

    @property
    def weight_bytes(self) -> int:
        """Bytes a step reads: the matmul weights."""
        return self.matmul_params * self.dtype_bytes

    @property
    def stored_bytes(self) -> int:
        """Bytes the weights take in memory (the input embeddings too, unless tied)."""
        extra = 0 if self.tied_embeddings else self.vocab_size * self.hidden_size
        return (self.matmul_params + extra) * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes


def _batches(max_batch: int) -> list[int]:
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return [*out, max_batch]


def roofline_cost_model(shape: ModelShape, dev: DeviceSpec, efficiency: Efficiency | None = None,
                        context_tokens: int = 1024, max_batch: int = 256,
                        prefill_chunk_tokens: int | None = None) -> CostModel:
    """The cost model a roofline gives (see the module docstring).

    Args:
        shape: the model. dev: the device. efficiency: None: `DEFAULT_EFFICIENCY[dev.kind]`.
        context_tokens: the context a decode step's sequences hold (their KV is read every step), >= 1.
        max_batch: the largest decode batch priced, >= 1.
        prefill_chunk_tokens: the engine's prompt chunk (None: whole prompts).
    """
    eff = efficiency or DEFAULT_EFFICIENCY[dev.kind]
    if context_tokens < 1 or max_batch < 1:
        raise ValueError(f"context_tokens and max_batch must be >= 1, got {context_tokens} and {max_batch}")
    bandwidth, flops = dev.memory_bandwidth * eff.memory, dev.flops * eff.compute
    fpt, kv = shape.flops_per_token, shape.kv_bytes_per_token

    def step(b: int) -> float:
        return eff.step_overhead_s + max((shape.weight_bytes + b * context_tokens * kv) / bandwidth, b * fpt / flops)

    ride_batch = max(1, max_batch // 2)
    ride = min(1.0, ride_batch * (fpt / flops + context_tokens * kv / bandwidth) / step(ride_batch))
    prefill = LinearFit(eff.step_overhead_s + shape.weight_bytes / bandwidth, fpt / flops)
    return CostModel(prefill=prefill, local_prefill=prefill,
                     decode_step=tuple((b, step(b)) for b in _batches(max_batch)),
                     transfer=LinearFit(eff.link_latency_s, 1.0 / (dev.link_bandwidth * eff.link)),
                     kv_bytes_per_token=kv, num_layers=shape.num_layers, hop_s=eff.hop_s,
                     prefill_chunk_tokens=prefill_chunk_tokens, decode_ride=ride,
                     # a prompt token's attention over a cached token: its query against the key, then the value
                     prefill_context_s=4 * shape.num_heads * shape.head_dim * shape.num_layers / flops)


def kv_memory_gib(shape: ModelShape, dev: DeviceSpec, utilization: float = 0.9) -> float:
    """GiB left for the KV cache on one device: `utilization` of its memory minus the weights.
    Raises: ValueError when the weights do not fit."""
    left = dev.memory_gib * utilization - shape.stored_bytes / GiB
    if left <= 0:
        raise ValueError(f"the model's weights ({shape.stored_bytes / GiB:.1f} GiB) do not fit in {utilization:.0%} "
                         f"of a {dev.name}'s {dev.memory_gib:g} GiB")
    return left
