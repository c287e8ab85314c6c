"""Paged attention layer: writes the step's K/V into the cache, then attends over block tables."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from kvfleet_kernels import dispatch, kv_quant  # Triton on CUDA, the PyTorch reference elsewhere
from kvfleet_kernels.plan import decode_plan


@dataclass(slots=True)
class PrefillSpan:
    """A prefill chunk inside the step's token batch."""

    query_start: int  # index of its first token in the batch
    query_len: int
    context_start: int  # tokens of this sequence already in the cache before the chunk
    block_table: torch.Tensor  # [num_blocks] int64


@dataclass(slots=True)
class DecodeGroup:
    """Decode rows start:end of the batch: their block tables and context lengths, and what a gathering kernel
    reads through them (planned on first use, then the same in every layer)."""

    start: int
    end: int
    tables: torch.Tensor  # [rows, width] int64
    seq_lens: torch.Tensor  # [rows] int64: each row's context, its own token included
    max_len: int  # the longest, known on the host (no device read)
    block_size: int
    _plan: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)

    def plan(self) -> tuple[torch.Tensor, torch.Tensor]:
        """decode_plan's (flat block index, valid-slot mask) of the group, computed once. Only the kernels that
        gather need it: the CPU kernel reads the tables in place, and a step's plan cost ~45 us at batch 1."""
        if self._plan is None:
            self._plan = decode_plan(self.tables, self.seq_lens, self.block_size, self.max_len)
        return self._plan


@dataclass(slots=True)
class AttentionMetadata:
    """Where every token of a step sits in the KV cache. Decodes come first in the batch.

    Decode rows take one of two forms. On CPU they attend in `decode_groups`: groups of similar
    length (sorted by the runner), each padded only to its own longest context, so the gathered
    K/V stays small enough to live in cache. A CUDA graph needs fixed shapes instead: then
    `decode_tables` [B, W] and `decode_seq_lens` [B] cover the first B rows, W fixed by
    max_model_len, and the kernel reads each row's length on the device (no host sync).
    """

    slot_mapping: torch.Tensor  # [T]; -1 writes nothing (padding rows of a fixed-size batch, a profiling pass)
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillSpan]
    decode_tables: torch.Tensor | None = None
    decode_seq_lens: torch.Tensor | None = None


class PagedAttention(nn.Module):
    """Attention for one layer over its slice of the paged KV cache (bound by the model runner)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim ** -0.5
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        # With an int8 / fp8 cache: a float32 scale per (block, slot, KV head) for each of K and V.
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None

    def allocate(self, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device) -> None:
        """Bind zero-filled [num_blocks, block_size, KVH, D] K and V tensors of dtype, with scales if it is int8/fp8."""
        shape = (num_blocks, block_size, self.num_kv_heads, self.head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)
        quantized = kv_quant.is_quantized(self.k_cache)
        self.k_scale = torch.zeros(shape[:3], device=device) if quantized else None
        self.v_scale = torch.zeros(shape[:3], device=device) if quantized else None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q [T, H, D], k/v [T, KVH, D] → [T, H, D]."""
        ks, vs = self.k_scale, self.v_scale
        dispatch.write_kv(self.k_cache, self.v_cache, k, v, meta.slot_mapping, ks, vs)
        if meta.decode_tables is not None and meta.decode_seq_lens is not None:
            # No max_seq_len: the table width bounds the context, so launch shapes are fixed per batch size.
            n = meta.decode_tables.shape[0]
            decoded = dispatch.paged_decode_attention(q[:n], self.k_cache, self.v_cache, meta.decode_tables,
                                                       meta.decode_seq_lens, self.scale, None, ks, vs)
            if n == q.shape[0] and not meta.prefills:  # a pure decode batch (every CUDA graph): no copy
                return decoded
            out = torch.empty_like(q)
            out[:n] = decoded
        else:
            out = torch.empty_like(q)
        for g in meta.decode_groups:
            out[g.start:g.end] = dispatch.grouped_decode_attention(
                q[g.start:g.end], self.k_cache, self.v_cache, g.tables, g.seq_lens, g.plan, self.scale, ks, vs)
        for p in meta.prefills:
            span = slice(p.query_start, p.query_start + p.query_len)
            # Nothing cached before the chunk: attend to its fresh K/V directly, unless the cache is quantized;
            # then a prompt reads what its decodes will (the stored values), whether or not it came in chunks.
            if p.context_start == 0 and ks is None:
                out[span] = dispatch.causal_attention(q[span], k[span], v[span], self.scale)
            else:
                out[span] = dispatch.paged_prefill_attention(q[span], self.k_cache, self.v_cache, p.block_table,
                                                              p.context_start + p.query_len, self.scale, ks, vs)
        return out
