"""Triton KV write: each new token's keys and values into its cache slot (reshape_and_cache)."""

import torch
import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]


@triton.jit  # type: ignore[untyped-decorator]
def _write_kv_kernel(  # type: ignore[no-untyped-def]
        k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, num_kv_heads,
        s_kt, s_kh, s_vt, s_vh, s_kcn, s_kcs, s_kch, s_vcn, s_vcs, s_vch,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    # One program per token: all its KV heads. A negative slot is a padding row (a CUDA graph's batch
    # padded to its captured size) and writes nothing.
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    hd = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    heads = tl.where(slot >= 0, num_kv_heads, 0)  # not `& (slot >= 0)`: the interpreter makes that mask int32
    mask = (hd < heads) & (d < HEAD_DIM)
    block = tl.maximum(slot, 0) // BLOCK_SIZE
    offset = tl.maximum(slot, 0) % BLOCK_SIZE
    k = tl.load(k_ptr + t * s_kt + hd * s_kh + d, mask=mask)
    v = tl.load(v_ptr + t * s_vt + hd * s_vh + d, mask=mask)
    tl.store(k_cache_ptr + block * s_kcn + offset * s_kcs + hd * s_kch + d, k.to(k_cache_ptr.dtype.element_ty),
             mask=mask)
    tl.store(v_cache_ptr + block * s_vcn + offset * s_vcs + hd * s_vch + d, v.to(v_cache_ptr.dtype.element_ty),
             mask=mask)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """reference.write_kv for k/v [T, KVH, D] (any token and head strides); slots < 0 are skipped."""
    t, kvh, d = k.shape
    for x in (k, v, k_cache, v_cache):
        if x.stride(-1) != 1:
            raise ValueError(f"the head dimension must be contiguous (strides {x.stride()})")
    if t == 0:
        return
    _write_kv_kernel[(t,)](
        k, v, k_cache, v_cache, slot_mapping, kvh, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        *k_cache.stride()[:3], *v_cache.stride()[:3],
        HEAD_DIM=d, BLOCK_D=triton.next_power_of_2(d), BLOCK_H=triton.next_power_of_2(kvh),
        BLOCK_SIZE=k_cache.shape[1], num_warps=4)
