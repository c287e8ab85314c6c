"""INT8 weight-only matmul on CPU with fp32 activations: cpu_int8.cpp, compiled on first use and cached."""

from __future__ import annotations

from pathlib import Path
from typing import cast

import torch
import torch.nn.functional as F

from kvfleet_kernels import cpu_tiles
from kvfleet_kernels.cpu_ext import CACHE_ENV, CFLAGS, LDFLAGS, Extension

__all__ = ["CACHE_ENV", "CFLAGS", "ENABLE_ENV", "LDFLAGS", "NAME", "SOURCE", "TILE", "available", "build_dir",
           "linear", "pack"]

SOURCE = Path(__file__).with_name("cpu_int8.cpp")
NAME = "kvfleet_cpu_int8"  # the extension's file name and its torch.ops namespace
TILE = cpu_tiles.TILE
ENABLE_ENV = "KVFLEET_CPU_INT8_EXT"  # "0": never build or load it (PyTorch's kernels run instead)

_EXT = Extension(NAME, SOURCE, ENABLE_ENV, "CPU INT8 matmul kernel", "INT8 weights run PyTorch's kernels", 15)


def build_dir() -> Path:
    """This build's cache folder (cpu_ext.Extension.build_dir)."""
    return _EXT.build_dir()


def available() -> bool:
    """Whether the kernel is loaded, building it on the first call; False means callers take their fallback."""
    return _EXT.available()


def pack(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [N, K] int8, scale [N]) → ([ceil(N/16), K, 16] int8 tiles, scale zero-padded to a whole tile)."""
    tiles = cpu_tiles.pack(q)
    pad = tiles.shape[0] * TILE - q.shape[0]
    return tiles, F.pad(scale.to(torch.float32).reshape(-1), (0, pad)).contiguous()


def linear(x: torch.Tensor, tiles: torch.Tensor, scale: torch.Tensor, n: int, portable: bool = False) -> torch.Tensor:
    """x [M, K] fp32 → (x · qᵀ) · scale [M, n] fp32, for pack()'s tiles of an [n, K] weight. Needs available().

    portable: run the plain C++ loop even where the AVX2 one would (tests).
    """
    return cast(torch.Tensor, torch.ops.kvfleet_cpu_int8.int8_linear(x, tiles, scale, n, portable))

