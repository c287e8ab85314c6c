"""Triton weight-only quantized matmuls (W8A16, W4A16): weight tiles dequantized in registers, fp32 accumulation."""

# The packing, the references, fp8_linear and `supports` are plain PyTorch in quant_pack.py (importable without
# triton) and re-exported here, so this module is the whole API: dispatch.kernel_module("quant_matmul").

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]

from kvfleet_kernels.quant_pack import (
    FP8,
    PackedInt4,
    PackedInt8,
    dequantize,
    emulate_fp8_linear,
    fp8_linear,
    fp8_scaled_mm_supported,
    pack_int4,
    pack_int8,
    quantize_fp8_per_token,
    ref_fp8_linear,
    ref_w4a16,
    ref_w8a16,
    supports,
    unpack_int4,
    unpack_int8,
)

__all__ = ["FP8", "PackedInt4", "PackedInt8", "Tiles", "base_tiles", "choose_tiles", "dequantize", "emulate_fp8_linear",
           "fp8_linear", "fp8_scaled_mm_supported", "pack_int4", "pack_int8", "quantize_fp8_per_token",
           "ref_fp8_linear", "ref_w4a16", "ref_w8a16", "supports", "unpack_int4", "unpack_int8", "w4a16_matmul",
           "w8a16_matmul"]

# 2^23, the float whose bits are 0x4B000000: OR-ing n < 2^23 into its mantissa gives 2^23 + n.
MAGIC = tl.constexpr(8388608.0)


@triton.jit  # type: ignore[untyped-decorator]
def _wq_matmul_kernel(  # type: ignore[no-untyped-def]
        x_ptr, w_ptr, s_ptr, z_ptr, out_ptr, M, N, K, group_size, tiles_per_split, s_xm, s_wn, s_om, s_split,
        BITS: tl.constexpr, HAS_ZERO: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, DOT_F32: tl.constexpr, PRECISION: tl.constexpr,
        SWAP_AB: tl.constexpr, EVEN: tl.constexpr):
    # One program: a [BLOCK_M, BLOCK_N] tile of y over one split's range of K tiles. Programs are numbered
    # in groups of GROUP_M row tiles, so those running together share weight tiles in the L2 (prefill).
    pid = tl.program_id(0)
    split = tl.program_id(1)
    num_m = tl.cdiv(M, BLOCK_M)
    width = GROUP_M * tl.cdiv(N, BLOCK_N)
    first_m = (pid // width) * GROUP_M
    rows = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % rows
    pid_n = (pid % width) // rows
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * s_xm
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * s_wn
    # SWAP_AB computes yᵀ = W xᵀ: the dequantized weight is the dot's first operand, which Hopper's wgmma can
    # read from registers (the second must sit in shared memory), and its 64+ rows fill wgmma's M of 64.
    acc = tl.zeros([BLOCK_N, BLOCK_M] if SWAP_AB else [BLOCK_M, BLOCK_N], tl.float32)
    t0 = split * tiles_per_split
    t1 = tl.minimum(t0 + tiles_per_split, tl.cdiv(K, BLOCK_K))
    for t in range(t0, t1):
        k = t * BLOCK_K + tl.arange(0, BLOCK_K)
        kb = t * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)  # int4: byte j holds columns 2j and 2j + 1
        if EVEN:  # BLOCK_N divides N and BLOCK_K divides K: no per-element masks on the weight (fewer ALU ops)
            xt = tl.load(x_rows + k[None, :], mask=m_ok[:, None], other=0.0)
            qu = tl.load(w_rows + (k if BITS == 8 else kb)[None, :])
        else:
            xt = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & (k < K)[None, :], other=0.0)
            k_ok = (k < K) if BITS == 8 else (kb < K // 2)
            qu = tl.load(w_rows + (k if BITS == 8 else kb)[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0)
        qu = qu.to(tl.uint32)
        if BITS == 8:  # bytes hold q + 128
            offset = MAGIC + 128.0
        else:  # low nibble first: join then reshape puts each byte's two columns side by side
            qu = tl.reshape(tl.join(qu & 0xF, qu >> 4), (BLOCK_N, BLOCK_K))
            offset = MAGIC
        # q as an exact float without an int->float conversion (quarter rate): see quant_pack's layout notes.
        qf = (qu | 0x4B000000).to(tl.float32, bitcast=True) - offset
        # A tile lies within one group (the wrapper's BLOCK_K divides the group size): one scale per row.
        g = (t * BLOCK_K) // group_size
        s = tl.load(s_ptr + g * N + offs_n, mask=n_ok, other=0.0)
        if HAS_ZERO:
            z = tl.load(z_ptr + g * N + offs_n, mask=n_ok, other=0.0)
            w = (qf - z[:, None]) * s[:, None]  # the reference's order: the same fp32 weight, bit for bit
        else:
            w = qf * s[:, None]
        # float32 activations, or bfloat16 in the interpreter (whose bf16 tl.dot is wrong), dot in float32;
        # else 16-bit operands on the tensor cores: one rounding of each weight, as a 16-bit dense model.
        a = xt.to(tl.float32) if DOT_F32 else xt
        b = w if DOT_F32 else w.to(xt.dtype)
        if SWAP_AB:
            acc = tl.dot(b, tl.trans(a), acc, input_precision=PRECISION)
        else:
            acc = tl.dot(a, tl.trans(b), acc, input_precision=PRECISION)
    out = out_ptr + split * s_split
    if SWAP_AB:
        tl.store(out + offs_m[None, :] * s_om + offs_n[:, None], acc.to(out_ptr.dtype.element_ty),
                 mask=n_ok[:, None] & m_ok[None, :])
    else:
        tl.store(out + offs_m[:, None] * s_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])


@triton.jit  # type: ignore[untyped-decorator]
def _sum_splits_kernel(part_ptr, out_ptr, N, splits, s_split, s_om, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    # Split-K partials [splits, M, N] float32 summed in a fixed order (deterministic, unlike atomics), cast once.
    m = tl.program_id(0)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = n < N
    acc = tl.zeros([BLOCK], tl.float32)
    for s in range(splits):
        acc += tl.load(part_ptr + s * s_split + m * N + n, mask=ok, other=0.0)
    tl.store(out_ptr + m * s_om + n, acc.to(out_ptr.dtype.element_ty), mask=ok)


@dataclass(frozen=True)
class Tiles:
    """One launch's tiling: output tile, K tile, K splits, warps and software-pipeline stages."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int
    swap_ab: bool = False  # y transposed: the weight tile as the dot's first operand


# Tiles by regime (16-bit activations), each the fastest of a sweep on an H200 (Triton 3.6) at the 8B shapes
# among candidates that compile for sm_90 with no or few register spills (test_quant_matmul.py checks them).
# - Decode, M ≤ 16: memory-bound, the weight is the traffic. BLOCK_M 16 is tl.dot's least; 128-column K tiles
#   make each row's bytes one contiguous run. int4 swaps the operands (SWAP_AB: the dequantized weight in
#   wgmma's register operand, 7-12% faster); int8 does not (4-8% faster without). Split-K gives every SM
#   several programs (and loads in flight) where out / BLOCK_N alone would not: 4096 outputs are 64 tiles for
#   132 SMs. Measured best: 4 splits at K 4096, 4 to 8 at K 14336, fewer than 8 K tiles per split a loss.
# - Small batches, M ≤ 64: 64x128 tiles over 8 warps, swapped; split until the tiles fill the SMs once.
# - Prefill: 128x128x64 over 8 warps (340-360 TFLOP/s at M 2048, ~45% of the dense bf16 matmul); swapped
#   for int4 (8% faster), not for int8 (11% faster). No split once the output tiles fill the GPU.
# float32 activations (tests, not serving) take narrower K tiles: IEEE fp32 dots hold far more registers.
DECODE_INT8 = Tiles(16, 64, 128, 1, 4, 3)
DECODE_INT4 = Tiles(16, 64, 128, 1, 4, 3, swap_ab=True)
SMALL = Tiles(64, 128, 64, 1, 8, 3, swap_ab=True)
PREFILL_INT8 = Tiles(128, 128, 64, 1, 8, 3)
PREFILL_INT4 = Tiles(128, 128, 64, 1, 8, 3, swap_ab=True)
DECODE_F32 = Tiles(16, 64, 32, 1, 4, 3)
WIDE_F32 = Tiles(64, 64, 32, 1, 8, 3)
DECODE_PROGRAMS_PER_SM = 6  # split-K's target at decode; one program per SM for larger M
MIN_TILES_PER_SPLIT = 8
MAX_SPLIT = 8  # 16 splits measured slower than 8: the partials' traffic and the sum outweigh the parallelism


def _fit_block_k(block_k: int, k: int, group_size: int) -> int:
    """block_k shrunk (by halves, ≥ 16) to no more than k needs and to divide a grouped weight's group size."""
    block_k = min(block_k, max(16, triton.next_power_of_2(k)))
    while group_size < k and group_size % block_k:
        block_k //= 2
    return block_k


def base_tiles(m: int, bits: int, dtype: torch.dtype) -> Tiles:
    """The regime's tiles for m rows of activations of dtype, before fitting K and choosing the split."""
    if dtype == torch.float32:
        return DECODE_F32 if m <= 16 else WIDE_F32
    if m <= 16:
        return DECODE_INT4 if bits == 4 else DECODE_INT8
    return SMALL if m <= 64 else PREFILL_INT4 if bits == 4 else PREFILL_INT8


def choose_tiles(m: int, n: int, k: int, group_size: int, bits: int, dtype: torch.dtype, sm_count: int) -> Tiles:
    """The tiling for y [m, n] = x [m, k] times a bits-wide weight quantized in groups of group_size inputs."""
    base = base_tiles(m, bits, dtype)
    block_k = _fit_block_k(base.block_k, k, group_size)
    k_tiles = triton.cdiv(k, block_k)
    tiles_mn = triton.cdiv(m, base.block_m) * triton.cdiv(n, base.block_n)
    target = (DECODE_PROGRAMS_PER_SM if m <= 16 else 1) * sm_count
    split = max(1, min(triton.cdiv(target, tiles_mn), k_tiles // MIN_TILES_PER_SPLIT, MAX_SPLIT))
    split = triton.cdiv(k_tiles, triton.cdiv(k_tiles, split))  # as many as the even share of tiles needs
    return Tiles(base.block_m, base.block_n, block_k, split, base.num_warps, base.num_stages, base.swap_ab)


@functools.cache  # looked up on every call, once per layer and step
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: small, so that small tests split K too
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def _matmul(x: torch.Tensor, packed: PackedInt8 | PackedInt4, bits: int, tiles: Tiles | None) -> torch.Tensor:
    n, k = packed.shape
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} inputs, the weight {k}")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"activations must be float32, float16 or bfloat16, got {x.dtype}")
    x2 = x.reshape(-1, k)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    m = int(x2.shape[0])
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y.reshape(*x.shape[:-1], n)
    t = tiles or choose_tiles(m, n, k, packed.group_size, bits, x.dtype, _sm_count(x.device))
    if t.block_k != _fit_block_k(t.block_k, k, packed.group_size) or (bits == 4 and t.block_k % 2):
        raise ValueError(f"block_k {t.block_k} must be even and divide the group size {packed.group_size}")
    per_split = triton.cdiv(triton.cdiv(k, t.block_k), t.split_k)
    splits = triton.cdiv(triton.cdiv(k, t.block_k), per_split)  # no empty splits
    dest = y if splits == 1 else torch.empty((splits, m, n), dtype=torch.float32, device=x.device)
    dot_f32 = x.dtype == torch.float32 or (x.dtype == torch.bfloat16 and not x.is_cuda)
    grid = (triton.cdiv(m, t.block_m) * triton.cdiv(n, t.block_n), splits)
    _wq_matmul_kernel[grid](
        x2, packed.qweight, packed.scale, packed.zero if packed.zero is not None else packed.scale, dest,
        m, n, k, min(packed.group_size, k), per_split, x2.stride(0), packed.qweight.stride(0), dest.stride(-2),
        dest.stride(0) if splits > 1 else 0,
        BITS=bits, HAS_ZERO=packed.zero is not None, BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k,
        GROUP_M=8, DOT_F32=dot_f32, PRECISION="ieee", SWAP_AB=t.swap_ab,
        EVEN=n % t.block_n == 0 and k % t.block_k == 0, num_warps=t.num_warps, num_stages=t.num_stages)
    if splits > 1:
        block = min(1024, triton.next_power_of_2(n))
        _sum_splits_kernel[(m, triton.cdiv(n, block))](dest, y, n, splits, dest.stride(0), y.stride(0),
                                                       BLOCK=block, num_warps=4)
    return y.reshape(*x.shape[:-1], n)


def w8a16_matmul(x: torch.Tensor, packed: PackedInt8, *, tiles: Tiles | None = None) -> torch.Tensor:
    """ref_w8a16 for x [..., in] (fp32/fp16/bf16, any device Triton runs on) → [..., out] in x.dtype."""
    return _matmul(x, packed, 8, tiles)


def w4a16_matmul(x: torch.Tensor, packed: PackedInt4, *, tiles: Tiles | None = None) -> torch.Tensor:
    """ref_w4a16 for x [..., in] (fp32/fp16/bf16) → [..., out] in x.dtype; tiles overrides choose_tiles."""
    return _matmul(x, packed, 4, tiles)
