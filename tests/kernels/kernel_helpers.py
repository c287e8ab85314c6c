"""Shared by the reference-kernel tests: seeded generators, dtype tolerances and the head layouts to cover."""

from __future__ import annotations

import torch

# Tolerances against float64 references, by the dtype the kernel computed in.
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
HEADS = [(4, 4), (4, 2), (8, 2)]  # (query heads, key/value heads): GQA groups 1, 2, 4


def assert_close_at(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """assert_close (NaN fails) with atol = rtol = TOL[dtype]."""
    torch.testing.assert_close(actual, expected, atol=TOL[dtype], rtol=TOL[dtype])


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)
