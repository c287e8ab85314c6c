"""Quantized KV cache entries: int8 or fp8 (E4M3) values with one float32 scale per token and KV head.

A scale per (token, head), set from that row's own absolute maximum when it is written, needs no calibration
and keeps an outlier in one head or token from costing the others their precision; it adds 4 bytes to a row of
head_dim bytes (6% at head_dim 64). The cache tensors keep their [N, bs, KVH, D] shape in the narrow dtype,
the scales sit beside them as [N, bs, KVH] float32. Rounding is spelled out (half away from zero for int8,
clamp-then-round-to-nearest-even for fp8) so that the Triton write kernel stores the same bytes.
"""

from __future__ import annotations

import torch

# vLLM's --kv-cache-dtype spellings: fp8 means E4M3 (the format with the precision; E5M2 spends bits on range
# that a per-row scale makes unnecessary).
CACHE_DTYPES: dict[str, torch.dtype] = {"int8": torch.int8, "fp8": torch.float8_e4m3fn,
                                        "fp8_e4m3": torch.float8_e4m3fn}
QMAX: dict[torch.dtype, float] = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
# A row of zeros (a padded token) still needs a finite, non-zero scale: its values quantize to 0 either way.
MIN_AMAX = 1e-12
SCALE_BYTES = 4  # float32 per (token, head)


def is_quantized(cache: torch.Tensor) -> bool:
    """Whether a cache tensor holds quantized entries (and so comes with scales)."""
    return cache.dtype in QMAX


def bytes_per_row(head_dim: int, cache_dtype: torch.dtype) -> int:
    """Bytes one token's K (or V) for one head costs in a cache of cache_dtype, its scale included."""
    elem = torch.empty(0, dtype=cache_dtype).element_size()
    return head_dim * elem + (SCALE_BYTES if cache_dtype in QMAX else 0)


def round_half_away(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest integer, ties away from zero (what the Triton kernel can spell in every backend)."""
    return torch.where(x >= 0, torch.floor(x + 0.5), torch.ceil(x - 0.5))


def quantize(x: torch.Tensor, cache_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] → (values [..., D] in cache_dtype, scales [...] float32), x ≈ values · scale."""
    qmax = QMAX[cache_dtype]
    xf = x.float()
    amax = xf.abs().amax(-1).clamp(min=MIN_AMAX)
    inv = qmax / amax
    y = (xf * inv[..., None]).clamp(-qmax, qmax)
    if cache_dtype == torch.int8:
        y = round_half_away(y)
    return y.to(cache_dtype), amax / qmax


def dequantize(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """values [..., D] · scales [...] in dtype (what attention computes with)."""
    return (values.float() * scales.unsqueeze(-1)).to(dtype)


def as_bytes(cache: torch.Tensor) -> torch.Tensor:
    """A one-byte cache viewed as uint8: PyTorch's CPU copies (index_copy_) have no float8 kernels."""
    return cache.view(torch.uint8) if cache.dtype == torch.float8_e4m3fn else cache
