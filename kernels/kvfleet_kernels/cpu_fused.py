"""Fused RMSNorm (+ residual add), rotary and SwiGLU for CPU steps, one pass each: cpu_fused.cpp, built on first use."""

from __future__ import annotations

from pathlib import Path
from typing import cast

import torch

from kvfleet_kernels.cpu_ext import Extension

__all__ = ["DTYPES", "ENABLE_ENV", "NAME", "SOURCE", "add_rms_norm", "available", "rms_norm", "rotary",
           "silu_and_mul", "supports"]

SOURCE = Path(__file__).with_name("cpu_fused.cpp")
NAME = "kvfleet_cpu_fused"  # the extension's file name and its torch.ops namespace
ENABLE_ENV = "KVFLEET_CPU_FUSED_EXT"  # "0": never build or load it (the PyTorch reference runs instead)
# x's dtypes; weights float32 or bfloat16, cos / sin in x's dtype, everything computed in float32.
DTYPES = (torch.float32, torch.bfloat16)

_EXT = Extension(NAME, SOURCE, ENABLE_ENV, "CPU fused norm / rotary / SwiGLU kernels",
                 "they run the PyTorch reference", 20)


def available() -> bool:
    """Whether the kernels are loaded, building them on the first call; False means callers take the reference."""
    return _EXT.available()


def supports(x: torch.Tensor) -> bool:
    """Whether the ops take x (and the kernels are loaded): a CPU tensor in float32 or bfloat16."""
    return x.device.type == "cpu" and x.dtype in DTYPES and available()


# Each op: reference.py's contract (same shapes, dtypes and values, inputs never written). Needs supports().
# portable: the plain C++ loop even where the AVX2 one would run (tests).


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, portable: bool = False) -> torch.Tensor:
    """reference.rms_norm: x [..., H], weight [H] → promote_types(weight, x) [..., H]."""
    return cast(torch.Tensor, torch.ops.kvfleet_cpu_fused.rms_norm.default(x, weight, eps, portable))


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 portable: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """reference.add_rms_norm: (rms_norm(residual + x), residual + x), the sum in x's dtype (residual's too)."""
    return cast(tuple[torch.Tensor, torch.Tensor],
                torch.ops.kvfleet_cpu_fused.add_rms_norm.default(x, residual, weight, eps, portable))


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, portable: bool = False) -> torch.Tensor:
    """reference.rotary: x [T, heads, D] (a view with any token / head strides is read in place), cos / sin [T, D]."""
    return cast(torch.Tensor, torch.ops.kvfleet_cpu_fused.rotary.default(x, cos, sin, portable))


def silu_and_mul(gate_up: torch.Tensor, portable: bool = False) -> torch.Tensor:
    """silu(gate) * up for gate, up = gate_up.chunk(2, -1): [..., 2N] → [..., N]."""
    return cast(torch.Tensor, torch.ops.kvfleet_cpu_fused.silu_and_mul.default(gate_up, portable))
