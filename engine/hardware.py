"""What this machine does fast: its CPU's instruction sets, and the dtype and kernel build they call for.

An engine started with dtype "auto" asks `choose_dtype` with the CPU flags (or the CUDA device's
bf16 support). Where the hardware decides it (native bf16 instructions on x86, or none), that is the
answer; where it does not (Arm with BF16), the engine measures both dtypes on the loaded model
(`engine.auto_dtype`). `choose_kernel` picks the paged-attention build the CPU
can run, best first. The choosers are pure (unit-tested from given flags); the readers of this
machine sit at the bottom. No torch here.
"""
from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

AUTO = "auto"


@dataclass(frozen=True)
class CpuInfo:
    """The CPU as /proc/cpuinfo names it: model name, instruction-set flags, machine architecture."""

    model: str
    flags: frozenset[str]
    arch: str

    def machine_class(self) -> str:
        """The class benchmarks are reported by: the widest feature that decides dtype and kernel here."""
        for flag, name in (("amx_bf16", "AMX-BF16"), ("avx512_bf16", "AVX-512 BF16"),
                           ("avx512f", "AVX-512 (no BF16)"), ("avx2", "AVX2 + FMA")):
            if flag in self.flags:
                return name
        return self.arch

    def isa_summary(self) -> str:
        """The flags that decide dtype and kernel, in a fixed order (for logs and reports)."""
        shown = [f for f in _SHOWN_FLAGS if f in self.flags]
        return " ".join(shown) or "none of " + " ".join(_SHOWN_FLAGS)


_SHOWN_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "amx_bf16", "asimd", "bf16", "sve")


@dataclass(frozen=True)
class DtypeChoice:
    """`dtype` None: the hardware does not decide; measure both on the model."""

    dtype: str | None
    reason: str


def choose_dtype(device: str, cpu: CpuInfo, cuda_bf16: bool = False) -> DtypeChoice:
    """The dtype that serves fastest here, when the hardware alone says so.

    Args:
        device: "cpu" or "cuda[:N]".
        cpu: the CPU's flags (ignored on CUDA).
        cuda_bf16: whether the CUDA device computes in bf16 natively (compute capability >= 8.0).
    Returns:
        a dtype and the reason, or dtype None when only a measurement can tell.
    """
    if device.startswith("cuda"):
        if cuda_bf16:
            return DtypeChoice("bfloat16", "the CUDA device computes in bf16 natively")
        return DtypeChoice("float16", "the CUDA device has no native bf16; float16 instead")
    flags = cpu.flags
    if "amx_bf16" in flags:
        return DtypeChoice("bfloat16", "the CPU has AMX-BF16 matrix units")
    if "avx512_bf16" in flags:
        return DtypeChoice("bfloat16", "the CPU has AVX-512 BF16 instructions")
    if "avx512f" in flags:
        # Measured once instead (a 2-core Ice Lake): the probe of the model's layers came out a near-tie either
        # way (bf16 wins memory-bound batch-1 products by its half bytes), while prompts and batched decode
        # lose: bf16 matmuls ran at 66 GFLOP/s against 320 for fp32, and batch-8 decode at half the tok/s.
        return DtypeChoice("float32", "the CPU has AVX-512 but no BF16 instructions: bf16 would run emulated, its "
                                      "matmuls about 5x slower than float32")
    if cpu.arch == "aarch64" and "bf16" in flags:
        return DtypeChoice(None, "the CPU has bf16 instructions, but how fast they run varies: measure")
    return DtypeChoice("float32", "the CPU has no bf16 instructions: bf16 would run emulated, its matmuls about "
                                  "100x slower than float32")


def pick_measured(seconds: dict[str, float]) -> DtypeChoice:
    """The faster dtype from a probe's timings {"float32": s, "bfloat16": s} (same work for both)."""
    fp32, bf16 = seconds["float32"], seconds["bfloat16"]
    dtype = "bfloat16" if bf16 < fp32 else "float32"
    return DtypeChoice(dtype, f"measured on the model: float32 {fp32 * 1e3:.0f} ms, bfloat16 {bf16 * 1e3:.0f} ms")


@dataclass(frozen=True)
class LinearChoice:
    """How linear layers compute: `groups` names those packed for oneDNN (weights packed once; a group is
    the layers of one name and shape, e.g. "gate_proj 1536x576"; `ALL_LAYERS` is every one; empty is
    none), or None when only a measurement on the model can tell; `kernel` names those pdserve's own
    small-batch kernel computes (`engine.kernels`, fp32 or bf16) and `blocked` those its kernel computes
    from a blocked copy of the weight (fp32 or bf16); the rest run plain `F.linear`; and why."""

    groups: frozenset[str] | None
    reason: str
    kernel: frozenset[str] = frozenset()
    blocked: frozenset[str] = frozenset()

    def packs(self, group: str) -> bool:
        assert self.groups is not None, "measure first"
        return self.groups == ALL_LAYERS or group in self.groups

    def uses_kernel(self, group: str) -> bool:
        return group in self.kernel

    def uses_blocked(self, group: str) -> bool:
        return group in self.blocked

    def summary(self) -> str:
        """"packed", "plain", or the groups of each way (for logs, `/v1/models` and `pdserve status`)."""
        if self.groups == ALL_LAYERS:
            return "packed"
        parts = [f"{way} " + ", ".join(sorted(names)) for way, names in (("packed", self.groups or ()),
                                                                          ("kernel", self.kernel),
                                                                          ("blocked", self.blocked)) if names]
        return "; ".join(parts) or "plain"


ALL_LAYERS = frozenset({"*"})
LINEAR_WAYS = ("packed", "kernel", "blocked")  # the ways a group may leave plain `F.linear` (`LinearChoice`)
PACKED_GAIN = 0.9  # a group leaves plain when another way takes at most this share of its time over the probe batches
PACKED_BATCH1_LOSS = 1.1  # ... and at most this multiple of its plain time at batch 1 (lone streams stay as fast)


def choose_linear(setting: str, device: str, packing_available: bool) -> LinearChoice:
    """Packed or plain linear layers, where the setting, the device or the torch build decides.

    Args:
        setting: "auto", "packed" or "plain" (`EngineConfig.linear`).
        device: "cpu" or "cuda[:N]".
        packing_available: whether this torch build and CPU can pack the model's weights (oneDNN, its dtype).
    Raises:
        ValueError: "packed" asked for where it cannot run.
    """
    if device.startswith("cuda"):
        if setting == "packed":
            raise ValueError("linear='packed' runs on CPU only; on CUDA use auto or plain")
        return LinearChoice(frozenset(), "CUDA runs plain linear layers")
    if setting == "packed" and not packing_available:
        raise ValueError("linear='packed' needs oneDNN able to pack the model's dtype on this CPU (bf16: AVX-512 "
                         "BW/VL/DQ); use auto or plain")
    if setting != AUTO:
        return LinearChoice(ALL_LAYERS if setting == "packed" else frozenset(), "set explicitly")
    if not packing_available:
        return LinearChoice(frozenset(), "oneDNN cannot pack the model's dtype with this torch build and CPU")
    return LinearChoice(None, "measure")


def pick_linear(seconds: dict[str, dict[str, list[float]]]) -> LinearChoice:
    """How each group computes, from a probe's timings {group: {"plain": [s per batch], "packed": [...],
    "kernel": [...], "blocked": [...] (those two where the kernel runs)}} (the same products every way, the
    first batch 1): the fastest way over all the batches among those that are a clear win over plain and
    cost batch 1 no more than noise; plain where none is."""
    def total(t: dict[str, list[float]], way: str) -> float:
        return sum(t[way])

    def wins(t: dict[str, list[float]], way: str) -> bool:
        return total(t, way) <= PACKED_GAIN * total(t, "plain") and t[way][0] <= PACKED_BATCH1_LOSS * t["plain"][0]

    best = {g: min((w for w in LINEAR_WAYS if w in t and wins(t, w)), key=lambda w: total(t, w),
                   default="plain") for g, t in seconds.items()}
    timing = "; ".join(
        f"{g} " + " / ".join(f"{w} {total(t, w) * 1e3:.1f} ms (batch 1 {t[w][0] * 1e3:.2f})" for w in t)
        for g, t in sorted(seconds.items()))

    def way(name: str) -> frozenset[str]:
        return frozenset(g for g, w in best.items() if w == name)

    return LinearChoice(way("packed"), f"measured on the model: {timing}", kernel=way("kernel"),
                        blocked=way("blocked"))


@dataclass(frozen=True)
class KernelBuild:
    """One build of the paged-attention C kernel: the CPU flags it needs and the compiler flags it takes."""

    name: str
    needs: frozenset[str]
    cflags: tuple[str, ...]


# Best first. Every build holds every dtype's attention; a build uses its vector paths where it has
# them and the portable C elsewhere.
_AVX512_BF16 = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "fma", "avx2", "f16c"})
_AVX512_BF16_FLAGS = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mavx2", "-mfma", "-mf16c")
KERNEL_BUILDS: tuple[KernelBuild, ...] = (
    # The avx512_bf16 build plus AMX tiles for the bf16 linear kernel (more than a few rows).
    KernelBuild("amx_bf16", _AVX512_BF16 | {"amx_tile", "amx_bf16"}, (*_AVX512_BF16_FLAGS, "-mamx-tile", "-mamx-bf16")),
    KernelBuild("avx512_bf16", _AVX512_BF16, _AVX512_BF16_FLAGS),
    # AVX-512 without BF16 (e.g. Intel Ice Lake): decode attention 16 lanes wide (fp32, and bf16 widened), the
    # 16-column blocked fp32 linear kernel and fp32 prefill attention 16 lanes wide; every AVX-512 build holds these.
    KernelBuild("avx512", _AVX512_BF16 - {"avx512_bf16"}, tuple(f for f in _AVX512_BF16_FLAGS if f != "-mavx512bf16")),
    KernelBuild("avx2", frozenset({"avx2", "fma", "f16c"}), ("-mavx2", "-mfma", "-mf16c")),
    KernelBuild("portable", frozenset(), ()),
)
KERNEL_NAMES = tuple(k.name for k in KERNEL_BUILDS)
TORCH_KERNEL = "torch"  # no C kernel: gather + SDPA
FORCE_ENV = "PDSERVE_KERNEL"  # force a build by name (or "torch"); tests use it to cover every build

assert KERNEL_BUILDS[-1].needs == frozenset(), "the last build must run on any CPU"
assert len(set(KERNEL_NAMES)) == len(KERNEL_NAMES) and TORCH_KERNEL not in KERNEL_NAMES


@dataclass(frozen=True)
class KernelChoice:
    """The build to load (None: torch ops) and why."""

    build: KernelBuild | None
    reason: str


def runnable(cpu: CpuInfo) -> list[KernelBuild]:
    """The builds this CPU can execute, best first (x86 vector builds only on x86)."""
    x86 = cpu.arch in ("x86_64", "amd64", "i686")
    return [k for k in KERNEL_BUILDS if k.needs <= cpu.flags and (x86 or not k.needs)]


def choose_kernel(cpu: CpuInfo, forced: str | None = None) -> KernelChoice:
    """The best build this CPU runs, or the one `forced` names (a name from KERNEL_NAMES or "torch").

    Raises:
        ValueError: `forced` names no build, or one this CPU cannot execute.
    """
    ok = runnable(cpu)
    if forced:
        if forced == TORCH_KERNEL:
            return KernelChoice(None, f"{FORCE_ENV}={TORCH_KERNEL}")
        if forced not in KERNEL_NAMES:
            raise ValueError(f"{FORCE_ENV}={forced!r} names no kernel build; choose from "
                             f"{', '.join(KERNEL_NAMES + (TORCH_KERNEL,))}")
        build = next(k for k in KERNEL_BUILDS if k.name == forced)
        if build not in ok:
            raise ValueError(f"{FORCE_ENV}={forced!r} needs CPU flags {' '.join(sorted(build.needs - cpu.flags))}, "
                             f"which this CPU lacks; it runs {', '.join(k.name for k in ok)}")
        return KernelChoice(build, f"{FORCE_ENV}={forced}")
    best = ok[0]
    why = "best build for this CPU" if best.needs else "no vector build runs on this CPU"
    return KernelChoice(best, why)


# -- this machine ----------------------------------------------------------------------------------
def parse_cpuinfo(text: str, arch: str) -> CpuInfo:
    """A CpuInfo from /proc/cpuinfo's text: x86 `flags` / `model name`, Arm `Features` / `CPU part`."""
    model, flags = "unknown", ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model == "unknown":
            model = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = value
    return CpuInfo(model, frozenset(flags.split()), arch)


def this_cpu() -> CpuInfo:
    """This machine's CPU. Without /proc/cpuinfo (not Linux), the flags are empty: portable choices."""
    arch = platform.machine().lower()
    try:
        return parse_cpuinfo(Path("/proc/cpuinfo").read_text(), arch)
    except OSError:
        return CpuInfo(platform.processor() or "unknown", frozenset(), arch)


def best_of(fn: Callable[[], object], reps: int) -> float:
    """The fastest of `reps` timed calls of `fn`, seconds, after one untimed call (first touch of the
    weights, the library's kernel selection): how the start-up probes time this machine."""
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def forced_kernel() -> str | None:
    """The build forced through the environment, if any (PDSERVE_NO_KERNELS=1 means torch ops)."""
    if os.environ.get("PDSERVE_NO_KERNELS") == "1":
        return TORCH_KERNEL
    return os.environ.get(FORCE_ENV) or None
