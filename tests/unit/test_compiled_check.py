"""The compiled decode step's start-up check: rounding of its dtype passes, a different model does not."""
from __future__ import annotations

import pytest
import torch

from engine.model_runner import EAGER_TOLERANCE, matches_eager


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rounding_passes_and_a_different_model_does_not(dtype):
    eager = torch.randn(2, 1000, generator=torch.Generator().manual_seed(0)).to(dtype)
    noise = torch.randn(2, 1000, generator=torch.Generator().manual_seed(1)) * eager.float().norm() / 1000 ** 0.5
    ok, err = matches_eager((eager.float() + 0.02 * noise / 2 ** 0.5).to(dtype), eager)
    assert ok and 0 < err < EAGER_TOLERANCE[dtype]
    ok, err = matches_eager(eager * 3, eager)  # e.g. scaled embeddings the compiled step leaves out
    assert not ok and err > 1


def test_sixteen_bit_dtypes_allow_more_rounding_than_float32():
    eager = torch.randn(4, 500, generator=torch.Generator().manual_seed(2))
    off = eager + 0.07 * eager.norm() / eager.numel() ** 0.5 * torch.randn(4, 500, generator=torch.Generator().manual_seed(3))
    assert not matches_eager(off, eager)[0]
    assert matches_eager(off.bfloat16(), eager.bfloat16())[0]
