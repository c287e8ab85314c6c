"""fp32 matmul on CPU for few rows (decode, verification): cpu_f32.cpp, compiled on first use and cached."""

from __future__ import annotations

from pathlib import Path
from typing import cast

import torch

from kvfleet_kernels import cpu_tiles
from kvfleet_kernels.cpu_ext import Extension

__all__ = ["ENABLE_ENV", "NAME", "SOURCE", "TILE", "available", "linear", "pack"]

SOURCE = Path(__file__).with_name("cpu_f32.cpp")
NAME = "kvfleet_cpu_f32"  # the extension's file name and its torch.ops namespace
TILE = cpu_tiles.TILE
ENABLE_ENV = "KVFLEET_CPU_F32_EXT"  # "0": never build or load it (F.linear runs few rows instead)

_EXT = Extension(NAME, SOURCE, ENABLE_ENV, "CPU fp32 few-row matmul kernel", "few rows run F.linear", 15)


def available() -> bool:
    """Whether the kernel is loaded, building it on the first call; False means callers take F.linear."""
    return _EXT.available()


def pack(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] fp32 → [ceil(N/16), K, 16] tiles (the last zero-padded)."""
    return cpu_tiles.pack(w)


def linear(x: torch.Tensor, tiles: torch.Tensor, n: int, portable: bool = False) -> torch.Tensor:
    """x [M, K] fp32 → x · wᵀ [M, n] for pack()'s tiles of an [n, K] weight. Needs available().

    portable: run the plain C++ loop even where the AVX2 one would (tests).
    """
    return cast(torch.Tensor, torch.ops.kvfleet_cpu_f32.f32_linear(x, tiles, n, portable))
