"""The dtype, kernel and linear-layer choices from given CPU flags, devices and timings (pure: no torch,
no measurement)."""
from __future__ import annotations

import pytest

from engine import hardware
from engine.config import EngineConfig
from engine.hardware import (
    CpuInfo,
    choose_dtype,
    choose_kernel,
    choose_linear,
    parse_cpuinfo,
    pick_linear,
    pick_measured,
)

AVX2 = frozenset(["fpu", "sse2", "avx", "avx2", "fma", "f16c"])
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
AVX512_BF16 = AVX512 | {"avx512_bf16"}
AMX = AVX512_BF16 | {"amx_bf16", "amx_tile"}


def cpu(flags: frozenset[str], arch: str = "x86_64") -> CpuInfo:
    return CpuInfo("test cpu", frozenset(flags), arch)


@pytest.mark.parametrize("flags,arch,want", [
    (AVX2, "x86_64", "float32"),  # bf16 would run emulated: several times slower
    (frozenset({"sse2"}), "x86_64", "float32"),
    (AVX512_BF16, "x86_64", "bfloat16"),
    (AMX, "x86_64", "bfloat16"),
    (AVX512, "x86_64", "float32"),  # emulated bf16 on wide vectors: prompts and batches about 5x slower
    (frozenset({"asimd", "bf16"}), "aarch64", None),
    (frozenset({"asimd"}), "aarch64", "float32"),
])
def test_cpu_dtype_follows_the_instruction_sets(flags, arch, want):
    choice = choose_dtype("cpu", cpu(flags, arch))
    assert choice.dtype == want and choice.reason


@pytest.mark.parametrize("bf16,want", [(True, "bfloat16"), (False, "float16")])
def test_cuda_dtype_follows_the_device(bf16, want):
    assert choose_dtype("cuda:0", cpu(AVX2), cuda_bf16=bf16).dtype == want


def test_a_measurement_picks_the_faster_dtype_and_says_so():
    assert pick_measured({"float32": 0.2, "bfloat16": 0.1}).dtype == "bfloat16"
    choice = pick_measured({"float32": 0.1, "bfloat16": 0.3})
    assert choice.dtype == "float32" and "100 ms" in choice.reason and "300 ms" in choice.reason


@pytest.mark.parametrize("setting,device,available,want", [
    ("auto", "cpu", True, None),  # only a measurement on the model tells
    ("auto", "cpu", False, frozenset()),
    ("packed", "cpu", True, hardware.ALL_LAYERS),
    ("plain", "cpu", True, frozenset()),
    ("auto", "cuda:0", True, frozenset()),
    ("plain", "cuda", False, frozenset()),
])
def test_linear_layers_follow_the_setting_device_and_build(setting, device, available, want):
    choice = choose_linear(setting, device, available)
    assert choice.groups == want and choice.reason


def test_packed_linear_layers_where_they_cannot_run_are_refused_by_name():
    with pytest.raises(ValueError, match="linear='packed' runs on CPU only"):
        choose_linear("packed", "cuda:0", True)
    with pytest.raises(ValueError, match="linear='packed' needs oneDNN able to pack the model's dtype"):
        choose_linear("packed", "cpu", False)
    with pytest.raises(ValueError, match=r"linear must be one of \('auto', 'packed', 'plain'\), got 'fast'"):
        EngineConfig(linear="fast")
    assert EngineConfig().linear == "auto"


def test_a_measurement_packs_the_groups_that_clearly_win_and_says_so():
    choice = pick_linear({  # seconds at batches 1, 4, 16
        "lm_head 512x64": {"plain": [0.010, 0.040, 0.050], "packed": [0.009, 0.015, 0.036]},  # a clear win
        "up_proj 128x64": {"plain": [0.010, 0.040, 0.050], "packed": [0.010, 0.038, 0.047]},  # noise: stays plain
        "down_proj 64x128": {"plain": [0.010, 0.040, 0.050], "packed": [0.013, 0.020, 0.030]},  # slows batch 1
        "q_proj 64x64": {"plain": [0.010, 0.010, 0.010], "packed": [0.015, 0.015, 0.015]}})
    assert choice.groups == {"lm_head 512x64"}
    assert choice.packs("lm_head 512x64") and not choice.packs("down_proj 64x128")
    assert "lm_head 512x64 plain 100.0 ms (batch 1 10.00) / packed 60.0 ms (batch 1 9.00)" in choice.reason
    assert "q_proj 64x64 plain 30.0 ms (batch 1 10.00) / packed 45.0 ms" in choice.reason
    assert choice.summary() == "packed lm_head 512x64"
    assert pick_linear({"q_proj 64x64": {"plain": [0.1], "packed": [0.2]}}).summary() == "plain"
    assert hardware.LinearChoice(hardware.ALL_LAYERS, "set explicitly").summary() == "packed"


def test_a_measurement_with_the_kernel_picks_the_fastest_way_that_clearly_wins():
    choice = pick_linear({  # seconds at batches 1, 4, 16
        "lm_head 512x64": {"plain": [0.010, 0.040, 0.050], "packed": [0.009, 0.015, 0.036],
                           "kernel": [0.009, 0.016, 0.040]},  # both win, packed by more
        "up_proj 128x64": {"plain": [0.010, 0.040, 0.050], "packed": [0.013, 0.020, 0.030],
                           "kernel": [0.008, 0.030, 0.040]},  # packed slows batch 1; the kernel wins
        "q_proj 64x64": {"plain": [0.010, 0.010, 0.010], "packed": [0.015, 0.015, 0.015],
                         "kernel": [0.010, 0.010, 0.0095]}})  # noise: stays plain
    assert choice.groups == {"lm_head 512x64"} and choice.kernel == {"up_proj 128x64"}
    assert choice.uses_kernel("up_proj 128x64") and not choice.packs("up_proj 128x64")
    assert choice.summary() == "packed lm_head 512x64; kernel up_proj 128x64"
    assert "kernel 78.0 ms (batch 1 8.00)" in choice.reason
    assert hardware.LinearChoice(frozenset(), "m", kernel=frozenset({"a 2x2"})).summary() == "kernel a 2x2"


def test_blocked_weights_are_a_way_of_their_own_picked_where_they_are_fastest():
    choice = pick_linear({  # seconds at batches 1, 4, 16
        "lm_head 512x64": {"plain": [0.010, 0.040, 0.050], "packed": [0.009, 0.015, 0.036],
                           "kernel": [0.009, 0.016, 0.040], "blocked": [0.007, 0.010, 0.030]},  # blocked by most
        "up_proj 128x64": {"plain": [0.010, 0.040, 0.050], "packed": [0.009, 0.020, 0.030],
                           "kernel": [0.008, 0.030, 0.040], "blocked": [0.012, 0.012, 0.012]},  # slows batch 1
        "q_proj 64x64": {"plain": [0.010, 0.010, 0.010], "kernel": [0.010, 0.010, 0.0095],
                         "blocked": [0.010, 0.0098, 0.0095]}})  # noise: stays plain
    assert choice.blocked == {"lm_head 512x64"} and choice.groups == {"up_proj 128x64"} and not choice.kernel
    assert choice.uses_blocked("lm_head 512x64") and not choice.uses_kernel("lm_head 512x64")
    assert not choice.packs("lm_head 512x64") and not choice.uses_blocked("q_proj 64x64")
    assert choice.summary() == "packed up_proj 128x64; blocked lm_head 512x64"
    assert "blocked 47.0 ms (batch 1 7.00)" in choice.reason


@pytest.mark.parametrize("flags,arch,want", [
    (AMX, "x86_64", "amx_bf16"),
    (AVX512_BF16, "x86_64", "avx512_bf16"),
    (AVX512, "x86_64", "avx512"),  # AVX-512 without BF16 (Ice Lake): 16-lane fp32 and widened-bf16 paths
    (AVX512 - {"avx512dq"}, "x86_64", "avx2"),  # AVX-512 F alone: the AVX2 build
    (AVX2, "x86_64", "avx2"),
    (AVX2 - {"f16c"}, "x86_64", "portable"),
    (frozenset(), "x86_64", "portable"),
    (frozenset({"asimd", "bf16", "avx2", "fma", "f16c"}), "aarch64", "portable"),  # x86 builds only on x86
])
def test_the_kernel_is_the_best_build_the_cpu_runs(flags, arch, want):
    choice = choose_kernel(cpu(flags, arch))
    assert choice.build is not None and choice.build.name == want


def test_a_forced_kernel_wins_where_the_cpu_runs_it():
    assert choose_kernel(cpu(AVX512_BF16), "portable").build.name == "portable"
    assert choose_kernel(cpu(AVX512_BF16), "avx2").build.name == "avx2"
    assert choose_kernel(cpu(AVX512_BF16), "avx512").build.name == "avx512"
    torch_ops = choose_kernel(cpu(AVX2), "torch")
    assert torch_ops.build is None and hardware.FORCE_ENV in torch_ops.reason


def test_a_forced_kernel_the_cpu_cannot_run_or_that_does_not_exist_is_refused_by_name():
    with pytest.raises(ValueError, match=r"PDSERVE_KERNEL='avx512_bf16' needs CPU flags .*avx512_bf16"):
        choose_kernel(cpu(AVX2), "avx512_bf16")
    with pytest.raises(ValueError, match=r"PDSERVE_KERNEL='avx9' names no kernel build; choose from amx_bf16, avx512_bf16"):
        choose_kernel(cpu(AVX2), "avx9")


def test_the_environment_forces_a_kernel(monkeypatch):
    monkeypatch.delenv("PDSERVE_NO_KERNELS", raising=False)
    monkeypatch.setenv("PDSERVE_KERNEL", "portable")
    assert hardware.forced_kernel() == "portable"
    monkeypatch.setenv("PDSERVE_NO_KERNELS", "1")
    assert hardware.forced_kernel() == "torch"
    monkeypatch.delenv("PDSERVE_NO_KERNELS")
    monkeypatch.delenv("PDSERVE_KERNEL")
    assert hardware.forced_kernel() is None


def test_cpuinfo_is_read_on_x86_and_arm():
    x86 = parse_cpuinfo("processor\t: 0\nmodel name\t: AMD EPYC 7B13\nflags\t\t: fpu avx2 fma f16c\n\n"
                        "processor\t: 1\nmodel name\t: AMD EPYC 7B13\nflags\t\t: fpu avx2 fma f16c\n", "x86_64")
    assert x86.model == "AMD EPYC 7B13" and x86.flags == {"fpu", "avx2", "fma", "f16c"}
    assert x86.isa_summary() == "avx2 fma f16c" and x86.machine_class() == "AVX2 + FMA"
    assert cpu(AVX512_BF16).machine_class() == "AVX-512 BF16" and cpu(AVX512).machine_class() == "AVX-512 (no BF16)"
    arm = parse_cpuinfo("processor\t: 0\nFeatures\t: fp asimd bf16 sve\nCPU part\t: 0xd40\n", "aarch64")
    assert arm.flags == {"fp", "asimd", "bf16", "sve"} and arm.model == "unknown"
    assert choose_dtype("cpu", arm).dtype is None


def test_this_machine_is_read():
    me = hardware.this_cpu()
    assert me.arch and isinstance(me.flags, frozenset)
    assert choose_kernel(me, "portable").build.name == "portable"  # every CPU runs the portable build


def test_engine_config_dtype_is_auto_by_default_and_checked():
    assert EngineConfig().dtype == "auto"
    with pytest.raises(ValueError, match="dtype float16 needs a CUDA device; on cpu use auto, bfloat16 or float32"):
        EngineConfig(dtype="float16")
    with pytest.raises(ValueError, match=r"dtype must be one of \('auto', 'float32', 'bfloat16', 'float16'\), "
                                         r"got 'int8'"):
        EngineConfig(dtype="int8")
    assert EngineConfig(dtype="float16", device="cuda").dtype == "float16"


def test_large_allocations_stay_in_the_heap_on_glibc():
    import platform

    from engine.allocator import keep_large_allocations

    if platform.libc_ver()[0] != "glibc":
        assert keep_large_allocations() is False
        return
    assert keep_large_allocations() is True
    assert keep_large_allocations() is True  # once per process; later calls are no-ops
