"""CheckpointTensor: a checkpoint tensor read lazily, so each rank materialises only its own shard."""

from __future__ import annotations

import time
from typing import Any

import torch


class CheckpointTensor:
    """One tensor of a checkpoint: its shape up front, its data only when (a range of) it is read.

    `source` is a safetensors slice (`safe_open(...).get_slice(name)`), which reads just the rows or
    columns asked for from the memory-mapped file, or a plain tensor (tests, converted weights).
    Reads come back in `dtype`; `bytes_read` counts what was materialised, so a test can check that a
    rank of N read about 1/N of the model; `read_seconds` is the time spent reading (the start-up phase
    weights_read), apart from copying into the parameters.
    """

    def __init__(self, source: Any, dtype: torch.dtype) -> None:
        self.source = source
        self.dtype = dtype
        shape = source.shape if isinstance(source, torch.Tensor) else source.get_shape()
        self.shape: tuple[int, ...] = tuple(int(s) for s in shape)
        self.bytes_read = 0
        self.read_seconds = 0.0

    def read(self) -> torch.Tensor:
        """The whole tensor."""
        return self._take(... if isinstance(self.source, torch.Tensor) else slice(None))

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        """Entries start:start+length along dim (dim 0 or 1), read without touching the rest."""
        return self._take((slice(None),) * dim + (slice(start, start + length),))

    def _take(self, index: Any) -> torch.Tensor:
        start = time.perf_counter()
        # Indexing a safetensors slice is what reads the file (its pages fault in from the memory map).
        out: torch.Tensor = self.source[index].to(self.dtype)
        self.read_seconds += time.perf_counter() - start
        self.bytes_read += out.numel() * out.element_size()
        return out
