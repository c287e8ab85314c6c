"""Quantized weights' device layouts (packing), their fp32 references, and FP8 linear through torch._scaled_mm."""

# Plain PyTorch, no triton import: the agent packs weights and asks `supports` on any machine; the Triton
# kernels live in quant_matmul.py, imported on first use (dispatch.kernel_module("quant_matmul")).
#
# The canonical weight (kvfleet_agent's QuantWeight): w[o, i] = (q[o, i] - zero[o, g(i)]) * scale[o, g(i)],
# g(i) = i // group_size, q int8 holding -128..127 (8 bits) or 0..15 (4 bits), scale/zero float32 [out, groups].

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvfleet_kernels import dispatch

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
INT8_OFFSET = 128  # int8 weights are stored offset-binary: the byte holds q + 128 (0..255)
MIN_GROUP = 16  # grouped scales need group_size % 16 == 0: a kernel tile (≥ 16 columns, tl.dot's least K) never
# straddles two groups, so each tile reads one scale (and zero) per output row


@dataclass(frozen=True)
class PackedInt8:
    """W8A16 device layout: qweight uint8 [out, in] holding q + 128; scale/zero float32 [groups, out]."""

    qweight: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None  # None: symmetric (zero 0)
    group_size: int

    @property
    def shape(self) -> tuple[int, int]:
        """The dense weight's shape, [out, in]."""
        return int(self.qweight.shape[0]), int(self.qweight.shape[1])


@dataclass(frozen=True)
class PackedInt4:
    """W4A16 device layout: qweight uint8 [out, in / 2], byte j = q[:, 2j] | q[:, 2j + 1] << 4; scales as int8's."""

    qweight: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    group_size: int

    @property
    def shape(self) -> tuple[int, int]:
        """The dense weight's shape, [out, in]."""
        return int(self.qweight.shape[0]), 2 * int(self.qweight.shape[1])


# Layout choices, and why:
# - Rows stay [out, in] with the inputs contiguous, as nn.Linear keeps them: a tile of BLOCK_K inputs is one
#   contiguous run per output row, read with 16-byte vector loads.
# - int8 as offset-binary uint8: the kernel turns a byte b into a float by OR-ing it into the mantissa of
#   2^23 (bits 0x4B000000 | b) and subtracting 2^23 + 128, which is exact and costs two full-rate ALU ops,
#   where an int->float conversion runs at a quarter of the FMA rate on NVIDIA GPUs; at decode, where the
#   kernel must dequantize as fast as HBM delivers bytes, that rate matters.
# - int4 two per byte along the inputs (low nibble first), not eight per int32: a tile's bytes are contiguous,
#   unpacked with one AND, one shift and a join with no redundant loads and no per-column shift vector.
# - scale and zero transposed to [groups, out]: the BLOCK_N scales a tile needs are contiguous (one coalesced
#   load) rather than strided by the group count.
# - scale and zero kept in float32, not the activation dtype: bit-exact with the canonical weight and the
#   references (rounding a scale to bfloat16 errs by up to 2^-9 in every weight of its group). The price is
#   bytes: 4 (8 with zeros) per group per output, 3% (6%) of an int8 stream at group 128 and 6% (12.5%) of an
#   int4 one; per-channel scales cost nothing. A 16-bit copy could halve that where the checkpoint's scales
#   were 16-bit anyway (GPTQ/AWQ's are fp16); not done here.


def _check_canonical(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, group_size: int) -> int:
    """Validates the canonical form; returns the number of groups."""
    if q.dim() != 2 or q.dtype != torch.int8:
        raise ValueError(f"q must be int8 [out, in], got {q.dtype} {tuple(q.shape)}")
    out, cols = q.shape
    if group_size <= 0 or cols % group_size:
        raise ValueError(f"group_size {group_size} must divide the input dimension {cols}")
    groups = cols // group_size
    if groups > 1 and group_size % MIN_GROUP:
        raise ValueError(f"group_size {group_size} must be a multiple of {MIN_GROUP} (or the whole input dimension)")
    if tuple(scale.shape) != (out, groups) or (zero is not None and tuple(zero.shape) != (out, groups)):
        raise ValueError(f"scale {tuple(scale.shape)} and zero {None if zero is None else tuple(zero.shape)} "
                         f"must be [{out}, {groups}]")
    return groups


def _groups_major(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.to(torch.float32).t().contiguous()


def pack_int8(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, group_size: int) -> PackedInt8:
    """The W8A16 layout of a canonical int8 weight (q -128..127 [out, in], scale/zero float32 [out, groups])."""
    _check_canonical(q, scale, zero, group_size)
    qweight = (q.to(torch.int16) + INT8_OFFSET).to(torch.uint8).contiguous()
    return PackedInt8(qweight, scale.to(torch.float32).t().contiguous(), _groups_major(zero), group_size)


def pack_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, group_size: int) -> PackedInt4:
    """The W4A16 layout of a canonical 4-bit weight (q 0..15 as int8 [out, in], even in; scale/zero as int8's)."""
    _check_canonical(q, scale, zero, group_size)
    if q.shape[1] % 2:
        raise ValueError(f"4-bit packing needs an even input dimension, got {q.shape[1]}")
    if q.numel() and (int(q.min()) < 0 or int(q.max()) > 15):  # load time: one sync per weight is fine
        raise ValueError("4-bit q must hold 0..15")
    u = q.to(torch.uint8)
    qweight = (u[:, 0::2] | (u[:, 1::2] << 4)).contiguous()
    return PackedInt4(qweight, scale.to(torch.float32).t().contiguous(), _groups_major(zero), group_size)


def unpack_int8(packed: PackedInt8) -> torch.Tensor:
    """The canonical q (int8 [out, in]) back from the W8A16 layout."""
    return (packed.qweight.to(torch.int16) - INT8_OFFSET).to(torch.int8)


def unpack_int4(packed: PackedInt4) -> torch.Tensor:
    """The canonical q (int8 0..15, [out, in]) back from the W4A16 layout."""
    b = packed.qweight
    return torch.stack([b & 0xF, b >> 4], dim=-1).reshape(b.shape[0], -1).to(torch.int8)


def dequantize(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, group_size: int) -> torch.Tensor:
    """The dense float32 weight [out, in] of the canonical form: (q - zero) * scale, per (row, group)."""
    out, cols = q.shape
    qf = q.to(torch.float32).reshape(out, cols // group_size, group_size)
    if zero is not None:
        qf = qf - zero.to(torch.float32)[..., None]
    return (qf * scale.to(torch.float32)[..., None]).reshape(out, cols)


def ref_w8a16(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
              group_size: int) -> torch.Tensor:
    """The W8A16 oracle: x [..., in] times the dequantized weight's transpose in float32, returned in x.dtype."""
    return (x.to(torch.float32) @ dequantize(q, scale, zero, group_size).t()).to(x.dtype)


def ref_w4a16(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
              group_size: int) -> torch.Tensor:
    """The W4A16 oracle (q 0..15): the same arithmetic as ref_w8a16."""
    return ref_w8a16(x, q, scale, zero, group_size)


def supports(x: torch.Tensor) -> bool:
    """Whether w8a16_matmul/w4a16_matmul run a Triton kernel for activations like x (dispatch.backend's rule).

    True for CUDA tensors of float32/float16/bfloat16 with triton installed, and for CPU tensors under
    KVFLEET_FORCE_TRITON=1 in a TRITON_INTERPRET=1 process; otherwise the caller takes its reference path.
    """
    return dispatch.backend(x) != "reference"


# ---------------------------------------------------------------------------------------------
# FP8 (E4M3) weights: torch._scaled_mm where the tensor cores take FP8 (sm_89 and later), else the reference.


def fp8_scaled_mm_supported(device: torch.device) -> bool:
    """Whether fp8_linear's fast path (torch._scaled_mm) runs on device: CUDA with compute capability ≥ 8.9."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def quantize_fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_fp8 [M, K] E4M3, scale float32 [M, 1]) with x ≈ x_fp8 * scale: each row's max |x| maps to 448.

    Per token rather than per tensor: one outlier token does not flatten every other row's resolution.
    """
    amax = x.abs().amax(dim=-1, keepdim=True).to(torch.float32).clamp_min(1e-12)  # an all-zero row stays zero
    scale = amax / FP8_MAX
    return (x.to(torch.float32) / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def _w_scale_row(w_scale: torch.Tensor, n: int) -> torch.Tensor:
    """The weight scale (scalar, [1] or [out, 1]) as float32 [1, out]."""
    return w_scale.to(torch.float32).reshape(1, -1).expand(1, n).contiguous()


def ref_fp8_linear(x: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """The FP8 oracle and the slow path: dequantize the weight, float32 matmul, in x.dtype (x unquantized)."""
    w = w_fp8.to(torch.float32) * _w_scale_row(w_scale, int(w_fp8.shape[0])).t()
    return (x.to(torch.float32) @ w.t()).to(x.dtype)


def emulate_fp8_linear(x: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """What the fast path computes, in float32: x quantized per token, both dequantized, multiplied (its oracle)."""
    x_fp8, xs = quantize_fp8_per_token(x.reshape(-1, x.shape[-1]))
    w = w_fp8.to(torch.float32) * _w_scale_row(w_scale, int(w_fp8.shape[0])).t()
    return ((x_fp8.to(torch.float32) * xs) @ w.t()).reshape(*x.shape[:-1], -1).to(x.dtype)


# How _scaled_mm takes per-token scales, by (device, dtype): "rowwise" (scale_a [M, 1], scale_b [1, N], the
# output in x.dtype straight from the GEMM's epilogue) where the build supports it (sm_90, bfloat16 output),
# else "epilogue" (unit scales, a float32 output scaled afterwards: the same numbers, one more pass).
_MODES: dict[tuple[str, torch.dtype], str] = {}


def fp8_linear(x: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor, *,
               scaled_mm: bool | None = None) -> torch.Tensor:
    """x [..., in] (bf16/fp16) times an E4M3 weight [out, in] with w_scale (scalar, [1] or [out, 1]) → [..., out].

    scaled_mm None takes torch._scaled_mm with a dynamic per-token activation scale where
    fp8_scaled_mm_supported(x.device), else ref_fp8_linear; True or False forces one (CPU has _scaled_mm too).
    Shapes _scaled_mm refuses on CUDA (in or out not a multiple of 16) take the reference.
    """
    n, k = int(w_fp8.shape[0]), int(w_fp8.shape[1])
    if scaled_mm is None:
        scaled_mm = fp8_scaled_mm_supported(x.device)
    if not scaled_mm or x.numel() == 0 or (x.is_cuda and (k % 16 or n % 16)):
        return ref_fp8_linear(x, w_fp8, w_scale)
    x2 = x.reshape(-1, k)
    x_fp8, xs = quantize_fp8_per_token(x2)
    ws = _w_scale_row(w_scale, n)
    w_t = w_fp8.contiguous().t()  # column-major [in, out], as _scaled_mm wants its second operand
    key = (str(x.device), x.dtype)
    y: torch.Tensor | None = None
    if _MODES.get(key, "rowwise") == "rowwise":
        try:
            y = torch._scaled_mm(x_fp8, w_t, scale_a=xs, scale_b=ws, out_dtype=x.dtype)
            _MODES[key] = "rowwise"
        except RuntimeError:  # refused before any launch (argument checks): remember, use the epilogue
            _MODES[key] = "epilogue"
    if y is None:
        one = torch.ones((), dtype=torch.float32, device=x.device)
        y = (torch._scaled_mm(x_fp8, w_t, scale_a=one, scale_b=one, out_dtype=torch.float32) * xs * ws).to(x.dtype)
    return y.reshape(*x.shape[:-1], n)
