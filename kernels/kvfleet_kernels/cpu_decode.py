"""A decode step's decoder stack in one C++ call on CPU: cpu_decode.cpp, built on first use."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import cast

import torch

from kvfleet_kernels import cpu_attention, cpu_fused
from kvfleet_kernels.cpu_ext import Extension

__all__ = ["ENABLE_ENV", "NAME", "SOURCE", "TENSORS_PER_LAYER", "available", "decode_forward"]

SOURCE = Path(__file__).with_name("cpu_decode.cpp")
NAME = "kvfleet_cpu_decode"  # the extension's file name and its torch.ops namespace
ENABLE_ENV = "KVFLEET_CPU_DECODE_EXT"  # "0": never build or load it (each layer runs its modules in Python)
TENSORS_PER_LAYER = 20  # the op's layout: 4 norm weights, then 4 linears of (weight, packed, tiles, bias)

_EXT = Extension(NAME, SOURCE, ENABLE_ENV, "CPU one-call decode stack",
                 "decode steps run the layers' modules one op at a time", 60)


def available() -> bool:
    """Whether the op is loaded with the kernels it calls (cpu_fused, cpu_attention), building it on first use."""
    return cpu_fused.available() and cpu_attention.available() and _EXT.available()


def decode_forward(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, tensors: Sequence[torch.Tensor | None],
                   few_below: Sequence[int], k_caches: Sequence[torch.Tensor], v_caches: Sequence[torch.Tensor],
                   slot_mapping: torch.Tensor, groups: Sequence[tuple[int, int, torch.Tensor, torch.Tensor]],
                   final_norm: torch.Tensor, heads: tuple[int, int, int], eps: float, scale: float) -> torch.Tensor:
    """x [T, hidden] embedded decode rows → the final norm's output [T, hidden]. Needs available().

    cos / sin [T, head_dim]: each row's rotary rows; tensors / few_below: TENSORS_PER_LAYER tensors and 4 row
    crossovers per layer; groups: (start, end, block tables, prefix mask) of each decode-attention call;
    heads: (query heads, KV heads, head_dim).
    """
    starts, ends, tables, valid = zip(*groups, strict=True) if groups else ((), (), (), ())
    op = torch.ops.kvfleet_cpu_decode.decode_forward.default
    return cast(torch.Tensor, op(x, cos, sin, list(tensors), list(few_below), list(k_caches), list(v_caches),
                                 slot_mapping, list(starts), list(ends), list(tables), list(valid), final_norm,
                                 *heads, eps, scale))
