"""Greedy sampling's row argmax on CPU, over float32 or bfloat16 logits: cpu_argmax.cpp, built on first use."""

from __future__ import annotations

from pathlib import Path
from typing import cast

import torch

from kvfleet_kernels.cpu_ext import Extension

__all__ = ["DTYPES", "ENABLE_ENV", "NAME", "SOURCE", "argmax", "available", "supports"]

SOURCE = Path(__file__).with_name("cpu_argmax.cpp")
NAME = "kvfleet_cpu_argmax"  # the extension's file name and its torch.ops namespace
ENABLE_ENV = "KVFLEET_CPU_ARGMAX_EXT"  # "0": never build or load it (torch.argmax runs instead)
DTYPES = (torch.float32, torch.bfloat16)

_EXT = Extension(NAME, SOURCE, ENABLE_ENV, "CPU row argmax kernel", "greedy sampling runs torch.argmax", 15)


def available() -> bool:
    """Whether the kernel is loaded, building it on the first call; False means callers take torch.argmax."""
    return _EXT.available()


def supports(x: torch.Tensor) -> bool:
    """Whether argmax() takes x: a non-empty 2-D CPU tensor in float32 or bfloat16, rows unit-strided."""
    return (x.device.type == "cpu" and x.dim() == 2 and x.dtype in DTYPES and x.shape[1] > 0
            and x.stride(1) == 1 and available())


def argmax(x: torch.Tensor, portable: bool = False) -> torch.Tensor:
    """torch.argmax(x, dim=-1) for x [rows, V] (the first index of each row's largest value, a NaN's if the row has
    one), int64 [rows]. Needs supports(x). portable: the plain loop even where the AVX2 one would run (tests)."""
    return cast(torch.Tensor, torch.ops.kvfleet_cpu_argmax.argmax.default(x, portable))
