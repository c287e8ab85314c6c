"""CheckpointTensor: a checkpoint tensor read lazily, so each rank materialises only its own shard."""

from __future__ import annotations

from typing import Any

import torch


class CheckpointTensor:
    """One tensor of a checkpoint: its shape up front, its data only when (a range of) it is read.

    `source` is a safetensors slice (`safe_open(...).get_slice(name)`), which reads just the rows or
    columns asked for from the memory-mapped file, or a plain tensor (tests, converted weights).
    Reads come back in `dtype`; `bytes_read` counts what was materialised, so a test can check that a
    rank of N read about 1/N of the model.
    """

    def __init__(self, source: Any, dtype: torch.dtype) -> None:
        self.source = source
        self.dtype = dtype
        shape = source.shape if isinstance(source, torch.Tensor) else source.get_shape()
        self.shape: tuple[int, ...] = tuple(int(s) for s in shape)
        self.bytes_read = 0

    def read(self) -> torch.Tensor:
        """The whole tensor."""
        return self._take(self.source[...] if isinstance(self.source, torch.Tensor) else self.source[:])

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        """Entries start:start+length along dim (dim 0 or 1), read without touching the rest."""
        index = (slice(None),) * dim + (slice(start, start + length),)
        return self._take(self.source[index])

    def _take(self, t: torch.Tensor) -> torch.Tensor:
        out = t.to(self.dtype)
        self.bytes_read += out.numel() * out.element_size()
        return out
