"""QuantWeight: one linear weight as integers (or FP8) with scales, whatever checkpoint format it came from.

Every format reduces to `w[o, i] = (q[o, i] - zero[o, g(i)]) * scale[o, g(i)]`, with `g(i) = i // group_size`
unless the checkpoint ordered its groups by activation (GPTQ act-order), in which case `g_idx[i]` names
each column's group. Keeping the checkpoint's own integers and scales (rather than dequantizing and
quantizing again) makes a served GPTQ or AWQ model compute exactly what its authors calibrated.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

FP8 = torch.float8_e4m3fn


@dataclass
class QuantWeight:
    """A weight [out, in]: integer (or FP8) values `q`, per-(row, group) `scale` and optional `zero`."""

    q: torch.Tensor  # [out, in]: int8 holding -128..127 (bits 8) or 0..15 (bits 4); float8_e4m3fn for FP8
    scale: torch.Tensor  # float32 [out, groups]
    zero: torch.Tensor | None  # float32 [out, groups], in q's units; None means 0 (symmetric)
    bits: int  # 8 or 4
    group_size: int  # columns per group; `in` for one scale per output channel
    g_idx: torch.Tensor | None = None  # int64 [in]: each column's group, where not i // group_size

    def __post_init__(self) -> None:
        out, cols = self.q.shape
        groups = self.scale.shape[1]
        if self.scale.shape[0] != out or (self.zero is not None and self.zero.shape != self.scale.shape):
            raise ValueError(f"quantized weight [{out}, {cols}]: scale {tuple(self.scale.shape)} and zero "
                             f"{None if self.zero is None else tuple(self.zero.shape)} must be [{out}, groups]")
        if self.g_idx is None and groups != -(-cols // self.group_size):
            raise ValueError(f"quantized weight [{out}, {cols}] with group_size {self.group_size} needs "
                             f"{-(-cols // self.group_size)} groups, the scales have {groups}")

    @property
    def is_fp8(self) -> bool:
        """Whether q holds FP8 (E4M3) values rather than integers."""
        return self.q.dtype == FP8

    @property
    def shape(self) -> tuple[int, int]:
        """The dense weight's shape, [out, in]."""
        return (int(self.q.shape[0]), int(self.q.shape[1]))

    def to(self, device: torch.device) -> QuantWeight:
        """The same weight with its tensors on `device`."""
        return replace(self, q=self.q.to(device), scale=self.scale.to(device),
                       zero=None if self.zero is None else self.zero.to(device),
                       g_idx=None if self.g_idx is None else self.g_idx.to(device))

    def groups_of_columns(self) -> torch.Tensor:
        """Each column's group index, [in]."""
        if self.g_idx is not None:
            return self.g_idx
        return torch.arange(self.q.shape[1], device=self.q.device) // self.group_size

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense weight [out, in]: the reference every backend is checked against."""
        g = self.groups_of_columns()
        q = self.q.to(torch.float32)
        if self.zero is not None:
            q = q - self.zero[:, g]
        return (q * self.scale[:, g]).to(dtype)

    def narrow(self, dim: int, start: int, length: int) -> QuantWeight:
        """Rows (dim 0) or columns (dim 1) start:start+length, with their scales: one tensor-parallel shard.

        Columns must start and end on group boundaries, so that no group is split between two ranks'
        scales; act-order columns keep their own group indices, renumbered from 0.
        """
        if dim == 0:
            return replace(self, q=self.q.narrow(0, start, length), scale=self.scale.narrow(0, start, length),
                           zero=None if self.zero is None else self.zero.narrow(0, start, length))
        if self.g_idx is not None:
            g = self.g_idx.narrow(0, start, length)
            used = torch.unique(g)
            remap = torch.full((int(self.scale.shape[1]),), -1, dtype=torch.long, device=g.device)
            remap[used] = torch.arange(len(used), device=g.device)
            return replace(self, q=self.q.narrow(1, start, length), scale=self.scale[:, used],
                           zero=None if self.zero is None else self.zero[:, used], g_idx=remap[g])
        cols = int(self.q.shape[1])
        if self.group_size >= cols:  # one scale per output channel: every shard keeps all of them
            return replace(self, q=self.q.narrow(1, start, length), group_size=length)
        if start % self.group_size or (length % self.group_size and start + length != cols):
            raise ValueError(f"a tensor-parallel shard of columns {start}:{start + length} would split a "
                             f"quantization group of {self.group_size} columns: choose a tensor_parallel_size "
                             "whose shard of the input dimension is a multiple of the group size")
        g0, g1 = start // self.group_size, -(-(start + length) // self.group_size)
        return replace(self, q=self.q.narrow(1, start, length), scale=self.scale[:, g0:g1],
                       zero=None if self.zero is None else self.zero[:, g0:g1])

def cat_rows(parts: list[QuantWeight]) -> QuantWeight:
    """Several weights stacked along their outputs (q, k, v packed into one matmul): same grid, same columns."""
    first = parts[0]
    for p in parts[1:]:
        if (p.bits, p.group_size, p.q.dtype, p.q.shape[1], p.zero is None) != \
                (first.bits, first.group_size, first.q.dtype, first.q.shape[1], first.zero is None) or \
                (p.g_idx is None) != (first.g_idx is None) or \
                (p.g_idx is not None and first.g_idx is not None and not torch.equal(p.g_idx, first.g_idx)):
            raise ValueError("packed projections (q/k/v or gate/up) are quantized differently in this checkpoint: "
                             "bits, group size, symmetry and act-order must agree to share one matmul")
    return replace(first, q=torch.cat([p.q for p in parts]), scale=torch.cat([p.scale for p in parts]),
                   zero=None if first.zero is None else torch.cat([p.zero for p in parts if p.zero is not None]))
