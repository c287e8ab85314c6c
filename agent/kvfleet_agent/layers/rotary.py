"""Rotary position embedding: cos/sin tables for every position, with Llama-3 and linear scaling."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from kvfleet_kernels import dispatch  # Triton on CUDA, the PyTorch reference elsewhere

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Per-pair rotation speeds, adjusted by config.json's rope_scaling."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"config.json rope_scaling.rope_type={kind!r} is not supported; "
                         f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if scaling is None or kind == "default":
        return inv
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv / factor
    # llama3: long wavelengths slowed by `factor`, short ones kept, a smooth blend in between.
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    """Applies rotary embedding to queries and keys by position, from precomputed tables."""

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: dict[str, Any] | None, dtype: torch.dtype) -> None:
        super().__init__()
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32),
                            inverse_frequencies(head_dim, theta, scaling))
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", emb.cos().to(dtype), persistent=False)
        self.register_buffer("sin", emb.sin().to(dtype), persistent=False)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Rotate x [T, heads, D] by each token's position (queries and keys together in one call)."""
        cos, sin = self.cos.index_select(0, positions), self.sin.index_select(0, positions)
        return dispatch.rotary(x, cos, sin)
