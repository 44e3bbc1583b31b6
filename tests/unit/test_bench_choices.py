"""`pdserve bench choices`' table: medians per prompt length, a dash where a server gives no figure."""
from __future__ import annotations

from pdserve.bench.choices import Sample, rows


def test_rows_are_medians_per_prompt_length_and_dashes_for_the_peer() -> None:
    pdserve = [Sample(512, 0.2, 2.0, 128, 8e6, 1500.0), Sample(512, 0.4, 3.0, 128, 9e6, 1500.0),
               Sample(512, 0.3, 4.0, 128, 1e6, 1400.0), Sample(64, 0.1, 1.0, 128, 2e6, 0.0)]
    assert rows("ratio", pdserve) == ["| ratio | 64 | 1 | 0.10 | 1.00 | 2.0 | 0 |",
                                      "| ratio | 512 | 3 | 0.30 | 3.00 | 8.0 | 1500 |"]
    assert rows("vllm", [Sample(64, 0.5, 1.5, 128, None, None)]) == ["| vllm | 64 | 1 | 0.50 | 1.50 | – | – |"]
