"""QuantMatmul: a QuantWeight made ready for its device once, then y = x · Wᵀ through the fastest kernel there.

On GPU: kvfleet_kernels' Triton dequant-GEMMs (W8A16, W4A16) and torch._scaled_mm for FP8 (sm_89+).
On CPU: per-channel INT8 with fp32 activations runs kvfleet_kernels.cpu_int8 (a C++/AVX2 kernel built on first
use; exact to fp32 accumulation order). Otherwise PyTorch's native weight-only kernels (`_weight_int8pack_mm`,
`_weight_int4pack_mm_for_cpu`), which take bf16 activations (W8A16 / W4A16, as vLLM names the schemes).
Where no kernel fits (FP8 on CPU, odd shapes) the weight is dequantized once into the compute dtype and
runs as a dense layer: correct, but without the memory saving, and the start-up log says so.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from kvfleet_agent.layers.quant.weight import QuantWeight
from kvfleet_kernels import cpu_int8, dispatch, quant_pack

log = logging.getLogger(__name__)

BF16 = torch.bfloat16
# The fallback INT8 path (no C++ compiler, or bf16 activations): above this many rows `_weight_int8pack_mm` (a
# decode-shaped loop) loses to dequantizing the layer's weight for the step and running oneDNN's fp32 GEMM on it:
# measured on the 2-core EPYC, 5632x1024 weight, at 64 rows 27.8 ms against 17.2 (the dequantization itself
# ~6 ms), at 256 rows 72 against 54; at 16 rows the kernel still wins.
INT8_KERNEL_ROWS = 32
MKLDNN = torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]


def _uniform_groups(qw: QuantWeight) -> tuple[QuantWeight, torch.Tensor | None]:
    """The weight with contiguous groups, and the input permutation that gives them (act-order), if any.

    GPTQ's act-order stores columns in their original order with a group index each; sorting the columns by
    group (and the activations the same way) turns that into plain groups, exactly, when every group
    holds group_size columns.
    """
    if qw.g_idx is None:
        return qw, None
    perm = torch.argsort(qw.g_idx, stable=True)
    counts = torch.bincount(qw.g_idx, minlength=int(qw.scale.shape[1]))
    if bool((counts != qw.group_size).any()):
        return qw, perm  # uneven groups: the caller falls back to the dense weight
    return QuantWeight(q=qw.q[:, perm].contiguous(), scale=qw.scale, zero=qw.zero, bits=qw.bits,
                       group_size=qw.group_size), perm


class QuantMatmul:
    """One quantized weight on its device: `path` names the kernel, `nbytes` what it keeps resident."""

    def __init__(self, qw: QuantWeight, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.out_features, self.in_features = qw.shape
        self.perm: torch.Tensor | None = None
        self.dense: torch.Tensor | None = None
        self.path = "dense"
        device = qw.q.device
        plain, perm = _uniform_groups(qw)
        if plain.g_idx is None and self._triton(plain, dtype):
            self.perm = perm
            return
        if qw.is_fp8 and self._scaled_mm(qw, dtype):
            return
        if device.type == "cpu" and not qw.is_fp8 and plain.g_idx is None:
            if qw.bits == 8 and self._cpu_int8(plain):
                self.perm = perm
                return
            if qw.bits == 4 and self._cpu_int4(plain):
                self.perm = perm
                return
        self.dense = qw.dequantize(dtype)

    def _triton(self, qw: QuantWeight, dtype: torch.dtype) -> bool:
        """W8A16 / W4A16 through kvfleet_kernels' Triton dequant-GEMMs (CUDA; on CPU only in the interpreter)."""
        if qw.is_fp8 or not quant_pack.supports(torch.empty(0, dtype=dtype, device=qw.q.device)):
            return False
        q, zero = qw.q, qw.zero
        if qw.bits == 4 and int(q.min()) < 0:  # a signed grid (−8..7) onto the kernel's 0..15, the zero with it
            q, zero = q + 8, (torch.zeros_like(qw.scale) if zero is None else zero) + 8
        try:
            pack = quant_pack.pack_int8 if qw.bits == 8 else quant_pack.pack_int4
            self.tpacked: quant_pack.PackedInt8 | quant_pack.PackedInt4 = pack(q, qw.scale, zero, qw.group_size)
        except ValueError as e:  # a group size the kernels do not tile (not a multiple of 16)
            log.info("no Triton kernel for a %s weight: %s; it runs dequantized", tuple(qw.shape), e)
            return False
        self.kernels = dispatch.kernel_module("quant_matmul")
        self.path = f"triton-w{qw.bits}a16"
        return True

    def _scaled_mm(self, qw: QuantWeight, dtype: torch.dtype) -> bool:
        """FP8 weights through torch._scaled_mm with per-token activation scales (CUDA, compute capability 8.9+)."""
        if not quant_pack.fp8_scaled_mm_supported(qw.q.device) or dtype not in (torch.bfloat16, torch.float16) \
                or qw.group_size != self.in_features or qw.zero is not None or qw.g_idx is not None:
            return False  # block-wise scales and fp32 activations run dequantized
        self.fp8_w, self.fp8_scale = qw.q.contiguous(), qw.scale.contiguous()
        self.path = "fp8-scaled-mm"
        return True

    def _cpu_int8(self, qw: QuantWeight) -> bool:
        """Per-channel INT8: y = (x·qᵀ)·s − (Σx)·(z·s); the scale factors out of the sum, so it stays fp32.

        fp32 models take kvfleet_kernels.cpu_int8 when it builds (on the 2-core EPYC 1.6-1.8x oneDNN's fp32
        GEMM at 16 rows, 2-3x at 1, on par from 256 on); otherwise, and for bf16/fp16, `_weight_int8pack_mm`.
        Only one int8 copy is kept: the tiles, or the [N, K] weight the fallback reads.
        """
        # K in steps of 8: what the fallback reads, so the path does not depend on whether a compiler exists.
        if qw.group_size != self.in_features or self.in_features % 8:
            return False
        scale = qw.scale[:, 0].to(torch.float32)
        self.zero_scale = None if qw.zero is None else (qw.zero[:, 0] * qw.scale[:, 0]).contiguous()
        if self.dtype == torch.float32 and cpu_int8.available():
            self.tiles, self.tile_scale = cpu_int8.pack(qw.q, scale)
        else:
            self.q8 = qw.q.contiguous()
            self.ones = torch.ones(self.out_features, dtype=BF16)
            self.scale = scale.contiguous()
        self.path = "cpu-int8"
        return True

    def _cpu_int4(self, qw: QuantWeight) -> bool:
        """Grouped INT4 through the packed CPU kernel, whose grid is w = (q − 8)·s + z per group."""
        if self.out_features % 16 or qw.group_size not in (32, 64, 128, 256) or self.in_features % qw.group_size:
            return False
        q = qw.q.to(torch.int32)
        zero = torch.zeros_like(qw.scale) if qw.zero is None else qw.zero
        if int(q.min()) < 0:  # a signed grid (−8..7): shift it onto the kernel's 0..15, the zero point with it
            q, zero = q + 8, zero + 8
        self.q4 = torch._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1)
        # (q − zero)·s = (q − 8)·s + (8 − zero)·s: the kernel's additive zero is (8 − zero)·s.
        self.scales_zeros = torch.stack([qw.scale, (8 - zero) * qw.scale], dim=-1).transpose(0, 1).contiguous().to(BF16)
        self.group_size = qw.group_size
        self.path = "cpu-int4"
        return True

    @property
    def nbytes(self) -> int:
        """Bytes this weight keeps resident on its device."""
        held = [getattr(self, name, None) for name in ("dense", "q8", "scale", "zero_scale", "q4", "scales_zeros",
                                                       "perm", "fp8_w", "fp8_scale", "tiles", "tile_scale")]
        packed = getattr(self, "tpacked", None)
        if packed is not None:
            held += [packed.qweight, packed.scale, packed.zero]
        return sum(t.numel() * t.element_size() for t in held if isinstance(t, torch.Tensor))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] → x · Wᵀ [T, out] in x's dtype."""
        if self.dense is not None:
            return F.linear(x, self.dense)
        if self.perm is not None:
            x = x.index_select(-1, self.perm)
        if self.path == "triton-w8a16":
            return self.kernels.w8a16_matmul(x, self.tpacked)  # type: ignore[no-any-return]
        if self.path == "triton-w4a16":
            return self.kernels.w4a16_matmul(x, self.tpacked)  # type: ignore[no-any-return]
        if self.path == "fp8-scaled-mm":
            return quant_pack.fp8_linear(x, self.fp8_w, self.fp8_scale)
        if self.path == "cpu-int8":
            return self._int8(x)
        y = torch._weight_int4pack_mm_for_cpu(x.to(BF16), self.q4, self.group_size, self.scales_zeros)
        return y.to(x.dtype)

    def _int8(self, x: torch.Tensor) -> torch.Tensor:
        """The cpu-int8 path: kvfleet's kernel where packed for it, else PyTorch's; a zero point after either."""
        if hasattr(self, "tiles"):
            y = cpu_int8.linear(x.to(torch.float32), self.tiles, self.tile_scale, self.out_features)
        elif x.shape[0] > INT8_KERNEL_ROWS and x.dtype == torch.float32:  # prefill chunks: dequantize for the step
            w = self.q8.to(torch.float32).mul_(self.scale[:, None])
            y = (torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "") if MKLDNN else F.linear(x, w))
        else:
            y = torch._weight_int8pack_mm(x.to(BF16), self.q8, self.ones).to(torch.float32).mul_(self.scale)
        if self.zero_scale is not None:
            y.sub_(x.to(torch.float32).sum(-1, keepdim=True) * self.zero_scale)
        return y.to(x.dtype)
