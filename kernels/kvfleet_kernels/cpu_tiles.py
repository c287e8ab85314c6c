"""The weight layout cpu_tiles.h streams (the INT8 and fp32 CPU linears): [N/16, K, 16] tiles of an [N, K] weight."""

from __future__ import annotations

import torch
import torch.nn.functional as F

TILE = 16  # output columns per tile (NR in cpu_tiles.h)


def pack(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] of any dtype → [ceil(N/16), K, 16] contiguous tiles, the last padded with zero columns."""
    n, k = w.shape
    pad = -n % TILE
    return F.pad(w, (0, 0, 0, pad)).reshape((n + pad) // TILE, TILE, k).transpose(1, 2).contiguous()
