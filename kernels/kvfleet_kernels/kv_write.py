"""Triton KV write: each new token's keys and values into its cache slot (reshape_and_cache), quantized if asked."""

import torch
import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]

from kvfleet_kernels import kv_quant
from kvfleet_kernels.kv_codec import quantize_rows


@triton.jit  # type: ignore[untyped-decorator]
def _store_rows(x, cache_ptr, scale_ptr, row_off, scale_off, mask, h_ok,  # type: ignore[no-untyped-def]
                KV_QUANT: tl.constexpr, QMAX: tl.constexpr, MIN_AMAX: tl.constexpr):
    if KV_QUANT:
        codes, scales = quantize_rows(x.to(tl.float32), QMAX, KV_QUANT, MIN_AMAX)
        tl.store(cache_ptr + row_off, codes.to(cache_ptr.dtype.element_ty), mask=mask)
        tl.store(scale_ptr + scale_off, scales, mask=h_ok)
    else:
        tl.store(cache_ptr + row_off, x.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit  # type: ignore[untyped-decorator]
def _write_kv_kernel(  # type: ignore[no-untyped-def]
        k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot_ptr, num_kv_heads,
        s_kt, s_kh, s_vt, s_vh, s_kcn, s_kcs, s_kch, s_vcn, s_vcs, s_vch, s_sn, s_ss, s_sh,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        KV_QUANT: tl.constexpr, QMAX: tl.constexpr, MIN_AMAX: tl.constexpr):
    # One program per token: all its KV heads. A negative slot is a padding row (a CUDA graph's batch
    # padded to its captured size) and writes nothing.
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    hd = h[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    heads = tl.where(slot >= 0, num_kv_heads, 0)  # not `& (slot >= 0)`: the interpreter makes that mask int32
    mask = (hd < heads) & (d < HEAD_DIM)
    block = tl.maximum(slot, 0) // BLOCK_SIZE
    offset = tl.maximum(slot, 0) % BLOCK_SIZE
    k = tl.load(k_ptr + t * s_kt + hd * s_kh + d, mask=mask, other=0.0)
    v = tl.load(v_ptr + t * s_vt + hd * s_vh + d, mask=mask, other=0.0)
    scale_off = block * s_sn + offset * s_ss + h * s_sh
    _store_rows(k, k_cache_ptr, k_scale_ptr, block * s_kcn + offset * s_kcs + hd * s_kch + d, scale_off, mask,
                h < heads, KV_QUANT, QMAX, MIN_AMAX)
    _store_rows(v, v_cache_ptr, v_scale_ptr, block * s_vcn + offset * s_vcs + hd * s_vch + d, scale_off, mask,
                h < heads, KV_QUANT, QMAX, MIN_AMAX)


def kv_quant_mode(cache: torch.Tensor) -> int:
    """The kernels' KV_QUANT for a cache tensor: 0 float, 1 int8, 2 fp8 (kv_codec.INT8 / FP8)."""
    return {torch.int8: 1, torch.float8_e4m3fn: 2}.get(cache.dtype, 0)


def as_codes(cache: torch.Tensor) -> torch.Tensor:
    """The cache as the kernels address it: an fp8 one as its bytes (kv_codec encodes and decodes them)."""
    return cache.view(torch.uint8) if cache.dtype == torch.float8_e4m3fn else cache


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """reference.write_kv for k/v [T, KVH, D] (any token and head strides); slots < 0 are skipped."""
    t, kvh, d = k.shape
    for x in (k, v, k_cache, v_cache):
        if x.stride(-1) != 1:
            raise ValueError(f"the head dimension must be contiguous (strides {x.stride()})")
    if t == 0:
        return
    mode = kv_quant_mode(k_cache)
    if mode and (k_scale is None or v_scale is None):
        raise ValueError(f"a {k_cache.dtype} KV cache needs its k_scale and v_scale tensors")
    scales = (k_scale, v_scale) if k_scale is not None and v_scale is not None else (k_cache, v_cache)
    _write_kv_kernel[(t,)](
        k, v, as_codes(k_cache), as_codes(v_cache), *scales, slot_mapping, kvh, k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
        *(scales[0].stride()[:3] if mode else (0, 0, 0)),
        HEAD_DIM=d, BLOCK_D=triton.next_power_of_2(d), BLOCK_H=triton.next_power_of_2(kvh),
        BLOCK_SIZE=k_cache.shape[1], KV_QUANT=mode, QMAX=kv_quant.QMAX.get(k_cache.dtype, 1.0),
        MIN_AMAX=kv_quant.MIN_AMAX, num_warps=4)
