"""On-load quantization of an fp checkpoint's linear weights: INT8 and FP8 per output channel, INT4 in groups."""

from __future__ import annotations

import torch

from kvfleet_agent.layers.quant.weight import FP8, QuantWeight

E4M3_MAX = 448.0  # float8_e4m3fn's largest finite value
# The preferred group first; a smaller one where it does not divide the inputs (16 has no CPU kernel: such a
# layer runs dequantized, and the start-up log says so).
INT4_GROUPS = (128, 64, 32, 16)


def int4_group(cols: int, wanted: int = 128) -> int:
    """The group size for a weight with `cols` inputs: `wanted` if it divides them, else the largest that does."""
    for g in (wanted, *INT4_GROUPS):
        if g <= cols and cols % g == 0:
            return g
    raise ValueError(f"int4 quantization needs the input dimension ({cols}) to be a multiple of 16: "
                     "use --quantization int8 for this checkpoint")


def quantize_int8(w: torch.Tensor) -> QuantWeight:
    """Symmetric INT8, one scale per output channel: q = round(w / s), s = max|w| / 127 (round to nearest)."""
    w = w.to(torch.float32)
    scale = (w.abs().amax(dim=1, keepdim=True) / 127).clamp(min=torch.finfo(torch.float32).tiny)
    q = torch.round(w / scale).clamp(-127, 127).to(torch.int8)
    return QuantWeight(q=q, scale=scale, zero=None, bits=8, group_size=int(w.shape[1]))


def quantize_int4(w: torch.Tensor, group_size: int = 128) -> QuantWeight:
    """Asymmetric INT4 in groups along the inputs: each group's min..max onto 0..15 with an integer zero point.

    Asymmetric because a group's weights are rarely centred: min/max spends all 16 levels on the range
    the group uses (what GPTQ's and AWQ's zero points do), where a symmetric grid wastes part of one side.
    """
    out, cols = w.shape
    g = int4_group(int(cols), group_size)
    wg = w.to(torch.float32).reshape(out, cols // g, g)
    lo = wg.amin(dim=2).clamp(max=0)  # keep 0 representable: padding and exact zeros stay exact
    hi = wg.amax(dim=2).clamp(min=0)
    scale = ((hi - lo) / 15).clamp(min=torch.finfo(torch.float32).tiny)
    zero = torch.round(-lo / scale).clamp(0, 15)
    q = (torch.round(wg / scale[..., None]) + zero[..., None]).clamp(0, 15).to(torch.int8)
    return QuantWeight(q=q.reshape(out, cols), scale=scale, zero=zero, bits=4, group_size=g)


def quantize_fp8(w: torch.Tensor) -> QuantWeight:
    """E4M3 with one scale per output channel (each row's largest magnitude onto E4M3's 448), as vLLM's on-load FP8."""
    w = w.to(torch.float32)
    scale = (w.abs().amax(dim=1, keepdim=True) / E4M3_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    q = (w / scale).clamp(-E4M3_MAX, E4M3_MAX).to(FP8)
    return QuantWeight(q=q, scale=scale, zero=None, bits=8, group_size=int(w.shape[1]))


def quantize(w: torch.Tensor, method: str) -> QuantWeight:
    """Quantize a dense weight [out, in] by the on-load method's name (int8, int4 or fp8)."""
    if method == "int8":
        return quantize_int8(w)
    if method == "int4":
        return quantize_int4(w)
    if method == "fp8":
        return quantize_fp8(w)
    raise ValueError(f"on-load quantization {method!r} is unknown: use int8, int4 or fp8")
