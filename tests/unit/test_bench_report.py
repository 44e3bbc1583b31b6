"""BENCHMARKS.md keeps one engine section per machine class: writing one leaves the others."""
from __future__ import annotations

from pdserve.bench.report import markers, write_report


def test_each_machine_class_has_its_own_section(tmp_path):
    path = tmp_path / "BENCHMARKS.md"
    path.write_text("# pdserve benchmarks\n\nintro\n")
    write_report(path, "avx512 run 1\n", "AVX-512 BF16")
    write_report(path, "avx2 run 1\n", "AVX2 + FMA")
    write_report(path, "avx512 run 2\n", "AVX-512 BF16")
    text = path.read_text()
    assert "intro" in text and "avx2 run 1" in text and "avx512 run 2" in text and "avx512 run 1" not in text
    for cls in ("AVX-512 BF16", "AVX2 + FMA"):
        start, end = markers(cls)
        assert text.count(start) == 1 and text.count(end) == 1 and text.index(start) < text.index(end)
