"""Paged decode attention on CPU read in place from the cache (no gather): cpu_attention.cpp, built on first use."""

from __future__ import annotations

from pathlib import Path
from typing import cast

import torch

from kvfleet_kernels.cpu_ext import Extension

__all__ = ["CACHE_DTYPES", "ENABLE_ENV", "NAME", "QUERY_DTYPES", "SOURCE", "available", "decode",
           "paged_decode_attention", "planned_decode_attention", "supports"]

SOURCE = Path(__file__).with_name("cpu_attention.cpp")
NAME = "kvfleet_cpu_attention"  # the extension's file name and its torch.ops namespace
ENABLE_ENV = "KVFLEET_CPU_ATTENTION_EXT"  # "0": never build or load it (the PyTorch reference runs instead)
# int8 and fp8 caches come with their float32 scales (kv_quant.py); bf16 queries compute in fp32.
CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.int8, torch.float8_e4m3fn)
QUERY_DTYPES = (torch.float32, torch.bfloat16)

_EXT = Extension(NAME, SOURCE, ENABLE_ENV, "CPU paged decode attention kernel",
                 "decode attention runs the PyTorch reference (a gathered copy)", 20)


def available() -> bool:
    """Whether the kernel is loaded, building it on the first call; False means callers take the reference."""
    return _EXT.available()


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether decode() takes these tensors (and the kernel is loaded): CPU, dtypes it reads, a dense cache."""
    return (q.device.type == "cpu" and q.dtype in QUERY_DTYPES and k_cache.dtype in CACHE_DTYPES
            and k_cache.device.type == "cpu" and k_cache.is_contiguous() and available())


def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
           lengths: torch.Tensor, scale: float, k_scale: torch.Tensor | None = None,
           v_scale: torch.Tensor | None = None, chunk: int = 0, portable: bool = False) -> torch.Tensor:
    """q [B, H, D] over block_tables [B, W] → [B, H, D] in q's dtype. Needs supports().

    lengths: seq_lens [B] or a prefix mask [B, <= W * bs] bool (decode_plan's valid); chunk: tokens per
    online-softmax step (0: the kernel's default); portable: the plain C++ loop even where the AVX2 one would
    run (tests).
    """
    if lengths.dtype != torch.bool:
        lengths = lengths.long()
    out = _op(q if q.dtype == torch.float32 else q.float(), k_cache, v_cache, block_tables.long(), lengths, scale,
              k_scale, v_scale, chunk, portable)
    return out if q.dtype == torch.float32 else out.to(q.dtype)


def planned_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             flat_block_index: torch.Tensor, valid: torch.Tensor, scale: float,
                             k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """reference.planned_decode_attention's contract (valid a prefix of each row), without the gathered copy."""
    tables = flat_block_index.view(q.shape[0], -1)
    return decode(q, k_cache, v_cache, tables, valid, scale, k_scale, v_scale)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           max_seq_len: int | None = None, k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """reference.paged_decode_attention's contract: the reference attends to whole blocks up to max_seq_len."""
    if max_seq_len is not None:  # the reference's plan covers whole blocks up to max_seq_len, and no more
        bs = k_cache.shape[1]
        seq_lens = seq_lens.clamp(max=-(-max_seq_len // bs) * bs)
    return decode(q, k_cache, v_cache, block_tables, seq_lens, scale, k_scale, v_scale)


def _op(*args: object) -> torch.Tensor:
    return cast(torch.Tensor, torch.ops.kvfleet_cpu_attention.decode_attention.default(*args))
