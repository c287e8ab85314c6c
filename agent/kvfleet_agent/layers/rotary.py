"""Rotary position embedding: cos/sin tables for every position, with linear, Llama-3 and YaRN scaling."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from kvfleet_kernels import dispatch  # Triton on CUDA, the PyTorch reference elsewhere

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_type(scaling: dict[str, Any] | None) -> str:
    """The rope type of a rope_scaling / rope_parameters dict, checked against what kvfleet computes."""
    kind = str((scaling or {}).get("rope_type", (scaling or {}).get("type", "default")))
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"config.json rope_type={kind!r} (in rope_scaling or rope_parameters) is not supported; "
                         f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    return kind


def _yarn(pos_freqs: torch.Tensor, head_dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN: frequencies that rotate often enough within the original context keep their speed, slow ones are
    interpolated by `factor`, with a linear ramp between the beta_fast and beta_slow rotation counts."""
    factor = float(scaling["factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    beta_fast, beta_slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)

    def dim_for(rotations: float) -> float:  # the pair index that turns `rotations` times over old_len
        return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_for(beta_fast), dim_for(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the speed), 0: interpolate (divide by factor)
    # Written as transformers computes it, so that the tables agree to the last bit.
    return 1.0 / (factor * pos_freqs) * (1 - keep) + 1.0 / pos_freqs * keep


def attention_scaling(scaling: dict[str, Any] | None) -> float:
    """The factor YaRN multiplies cos and sin by (1 for every other rope type)."""
    if rope_type(scaling) != "yarn":
        return 1.0
    assert scaling is not None
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return mscale(factor, float(scaling["mscale"])) / mscale(factor, float(scaling["mscale_all_dim"]))
    return mscale(factor)


def inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Per-pair rotation speeds, adjusted by config.json's rope scaling (rope_scaling or rope_parameters)."""
    pos_freqs = theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    inv = 1.0 / pos_freqs
    kind = rope_type(scaling)
    if scaling is None or kind == "default":
        return inv
    if kind == "yarn":
        return _yarn(pos_freqs, head_dim, theta, scaling)
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
        scale = attention_scaling(scaling)
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", (emb.cos() * scale).to(dtype), persistent=False)
        self.register_buffer("sin", (emb.sin() * scale).to(dtype), persistent=False)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Rotate x [T, heads, D] by each token's position (queries and keys together in one call)."""
        cos, sin = self.cos.index_select(0, positions), self.sin.index_select(0, positions)
        return dispatch.rotary(x, cos, sin)
