"""A decode step's decoder stack in one C++ call on CPU: cpu_decode.cpp, built on first use."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch

from kvfleet_kernels import cpu_attention, cpu_fused
from kvfleet_kernels.cpu_ext import Extension

__all__ = ["ENABLE_ENV", "NAME", "SOURCE", "TENSORS_PER_LAYER", "Stack", "available", "decode_forward",
           "propose_greedy"]

SOURCE = Path(__file__).with_name("cpu_decode.cpp")
NAME = "kvfleet_cpu_decode"  # the extension's file name and its torch.ops namespace
ENABLE_ENV = "KVFLEET_CPU_DECODE_EXT"  # "0": never build or load it (each layer runs its modules in Python)
TENSORS_PER_LAYER = 20  # the op's layout: 4 norm weights, then 4 linears of (weight, packed, tiles, bias)

_EXT = Extension(NAME, SOURCE, ENABLE_ENV, "CPU one-call decode stack",
                 "decode steps run the layers' modules one op at a time", 60)


def available() -> bool:
    """Whether the op is loaded with the kernels it calls (cpu_fused, cpu_attention), building it on first use."""
    return cpu_fused.available() and cpu_attention.available() and _EXT.available()


@dataclass(frozen=True)
class Stack:
    """A decoder stack as the ops take it: TENSORS_PER_LAYER tensors and 4 row crossovers per layer, each layer's
    K and V cache, the final norm's weight, (query heads, KV heads, head_dim), the norms' eps, attention's scale."""

    tensors: list[torch.Tensor | None]
    few_below: list[int]
    k_caches: list[torch.Tensor]
    v_caches: list[torch.Tensor]
    final_norm: torch.Tensor
    heads: tuple[int, int, int]
    eps: float
    scale: float

    def args(self) -> tuple[object, ...]:
        """The ops' trailing arguments."""
        return (self.tensors, self.few_below, self.k_caches, self.v_caches, self.final_norm, *self.heads, self.eps,
                self.scale)


def decode_forward(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, stack: Stack, slot_mapping: torch.Tensor,
                   groups: Sequence[tuple[int, int, torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """x [T, hidden] embedded decode rows → the final norm's output [T, hidden]. Needs available().

    cos / sin [T, head_dim]: each row's rotary rows; groups: (start, end, block tables [rows, W], each row's
    context: seq_lens int64 [rows] or a prefix mask [rows, L] bool) of each decode-attention call.
    """
    starts, ends, tables, lengths = zip(*groups, strict=True) if groups else ((), (), (), ())
    tensors, few_below, k_caches, v_caches, *rest = stack.args()
    op = torch.ops.kvfleet_cpu_decode.decode_forward.default
    return cast(torch.Tensor, op(x, cos, sin, tensors, few_below, k_caches, v_caches, slot_mapping, list(starts),
                                 list(ends), list(tables), list(lengths), *rest))


def propose_greedy(ids: torch.Tensor, starts: Sequence[int], rows: Sequence[int], counts: Sequence[int],
                   tables: torch.Tensor, block_size: int, embed: torch.Tensor, head: Sequence[torch.Tensor | None],
                   head_few_below: int, rope: tuple[torch.Tensor, torch.Tensor],
                   stack: Stack) -> tuple[torch.Tensor, float]:
    """A draft's greedy run in one call. First forward: request i's rows[i] tokens (ids, in request order: what its
    K/V lacks, then its newest token) at positions starts[i] onwards, its last row proposing; then it feeds each
    request its last proposal until it has counts[i]. Returns (int64 [B, max(counts)], -1 past a request's count;
    the seconds until the first proposals were known).

    tables [B, W] int64; head: the LM head's (weight, packed, tiles, bias), run as a linear with head_few_below;
    rope: the rotary (cos, sin) tables [max_positions, head_dim]. Needs available().
    """
    op = torch.ops.kvfleet_cpu_decode.propose_greedy.default
    out, first_s = op(ids, list(starts), list(rows), list(counts), tables, block_size, embed, list(head),
                      head_few_below, *rope, *stack.args())
    return cast(torch.Tensor, out), float(first_s)
