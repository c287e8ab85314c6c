"""Plain PyTorch versions of every kernel: the CPU path of the engine and the oracle for Triton tests.

Shapes (T tokens in a step, H query heads, KVH key/value heads, D head size, N blocks of bs slots):
  k_cache, v_cache  [N, bs, KVH, D]
  slot_mapping      [T]            flat slot (block_id * bs + offset) where each new token's K/V goes
  block_tables      [B, max_blocks] int64, padded with any valid block id
  k_scale, v_scale  [N, bs, KVH] float32, with an int8 or fp8 cache (kv_quant.py); None with a float one
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvfleet_kernels import kv_quant
from kvfleet_kernels.plan import decode_plan


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32, cast back to x's dtype (as Llama does)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """residual += x, then RMSNorm of the sum; returns (normed, new residual)."""
    residual = residual + x
    return rms_norm(residual, weight, eps), residual


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half (GPT-NeoX layout) rotary embedding; x [T, heads, D], cos/sin [T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's activation: silu(gate) * up for gate, up = gate_up.chunk(2, -1), [..., 2N] → [..., N]. Computed in
    place over gate_up's gate half (a step's [T, 2N] temporary is its largest): the result is a view of it."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate, inplace=True).mul_(up)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """Store new keys and values [T, KVH, D] into their cache slots; a negative slot (a padding row of a fixed-size
    batch, a profiling pass) stores nothing, as in the kernel. A quantized cache gets each row's scale too."""
    if slot_mapping.numel() and int(slot_mapping.min()) < 0:  # reads the values: fine, the reference is never captured
        keep = (slot_mapping >= 0).nonzero().squeeze(1)
        k, v, slot_mapping = k.index_select(0, keep), v.index_select(0, keep), slot_mapping.index_select(0, keep)
    for cache, scales, x in ((k_cache, k_scale, k), (v_cache, v_scale, v)):
        if scales is not None:
            x, s = kv_quant.quantize(x, cache.dtype)
            scales.view(-1, scales.shape[2]).index_copy_(0, slot_mapping, s)
        kv_quant.as_bytes(cache).view(-1, *cache.shape[2:]).index_copy_(0, slot_mapping, kv_quant.as_bytes(x))


def _entries(cache: torch.Tensor, scales: torch.Tensor | None, blocks: torch.Tensor,
             dtype: torch.dtype) -> torch.Tensor:
    """The cache's blocks [n, bs, KVH, D] in the compute dtype, dequantized with their scales when quantized."""
    values = cache.index_select(0, blocks)
    return values if scales is None else kv_quant.dequantize(values, scales.index_select(0, blocks), dtype)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int, scales: torch.Tensor | None = None,
              dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """One sequence's first `length` cached entries, [length, KVH, D], from its block table (dequantized to dtype
    when the cache is quantized)."""
    num_blocks = -(-length // cache.shape[1])
    return _entries(cache, scales, block_table[:num_blocks], dtype).flatten(0, 1)[:length]


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           max_seq_len: int | None = None, k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """One query token per sequence attending to its whole cached context.

    q [B, H, D]; seq_lens [B] tokens in context (the query's own K/V already written); returns [B, H, D].
    """
    flat, valid = decode_plan(block_tables, seq_lens, k_cache.shape[1], max_seq_len)
    return planned_decode_attention(q, k_cache, v_cache, flat, valid, scale, k_scale, v_scale)


def planned_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             flat_block_index: torch.Tensor, valid: torch.Tensor, scale: float,
                             k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """paged_decode_attention given its decode_plan, which a model computes once per step for every layer."""
    b, h, d = q.shape
    length = valid.shape[1]
    # [B * nb, bs, KVH, D] -> [B, KVH, L, D]: padded to the longest context, the padding masked out.
    # index_select over a flat, contiguous index: several times faster on CPU than tensor indexing.
    k = _entries(k_cache, k_scale, flat_block_index, q.dtype).view(b, length, *k_cache.shape[2:]).transpose(1, 2)
    v = _entries(v_cache, v_scale, flat_block_index, q.dtype).view(b, length, *v_cache.shape[2:]).transpose(1, 2)
    out = F.scaled_dot_product_attention(q.view(b, h, 1, d), k, v, attn_mask=valid[:, None, None, :],
                                         scale=scale, enable_gqa=True)
    return out.view(b, h, d)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_table: torch.Tensor, seq_len: int, scale: float,
                            k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """A chunk of one sequence's queries (its last T positions) over its cached context, causal.

    q [T, H, D]; the chunk's own K/V must already be in the cache; returns [T, H, D].
    """
    k = gather_kv(k_cache, block_table, seq_len, k_scale, q.dtype)
    v = gather_kv(v_cache, block_table, seq_len, v_scale, q.dtype)
    return causal_attention(q, k, v, scale)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Queries [T, H, D] that are the last T of the keys/values [L, KVH, D], each seeing its past."""
    t, length = q.shape[0], k.shape[0]
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    if t == length:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
    else:
        pos = torch.arange(length - t, length, device=q.device)
        mask = torch.arange(length, device=q.device)[None, :] <= pos[:, None]
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(0, 1)
