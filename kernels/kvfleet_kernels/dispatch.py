"""Each op runs its Triton kernel on CUDA tensors and its PyTorch reference elsewhere (reference.py's signatures).

Decode attention on CPU runs cpu_attention's C++ kernel instead where it is built and reads the dtypes (it
reads the cache in place; the reference gathers a padded copy first), KVFLEET_CPU_ATTENTION_EXT=0 to turn it off.
RMSNorm, rotary and SwiGLU's activation on CPU run cpu_fused's one-pass C++ ops likewise (a decode step of a small
model is mostly the per-op cost of their several PyTorch ops each), KVFLEET_CPU_FUSED_EXT=0 to turn them off.
Greedy sampling's row argmax on CPU runs cpu_argmax's one pass, KVFLEET_CPU_ARGMAX_EXT=0 to turn it off.
"""

import importlib
import importlib.util
import os
from collections.abc import Callable
from types import ModuleType
from typing import cast

import torch

from kvfleet_kernels import cpu_argmax, cpu_attention, cpu_fused, reference

__all__ = ["FORCE_ENV", "add_rms_norm", "argmax", "backend", "causal_attention", "interpreting", "kernel_module",
           "paged_decode_attention", "paged_prefill_attention", "planned_decode_attention", "rms_norm", "rotary",
           "silu_and_mul",
           "write_kv"]

# KVFLEET_FORCE_TRITON=1 runs the Triton kernels on CPU tensors too, in Triton's interpreter, which the process
# must have chosen before importing triton (TRITON_INTERPRET=1 in its environment: Triton's own tl.* helpers are
# compiled or interpreted from then on). KVFLEET_FORCE_TRITON=0 keeps the reference on CUDA, for A/B runs.
# Both are read at every call.
FORCE_ENV = "KVFLEET_FORCE_TRITON"
HAS_TRITON = importlib.util.find_spec("triton") is not None
TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def interpreting() -> bool:
    """Whether TRITON_INTERPRET asks for Triton's interpreter (the values Triton itself accepts as true)."""
    return os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "on", "yes")


def backend(x: torch.Tensor) -> str:
    """What the ops run for tensors like x: 'triton' (compiled, CUDA), 'interpreter' (CPU, forced) or 'reference'."""
    force = os.environ.get(FORCE_ENV, "")
    if not HAS_TRITON or force == "0" or x.dtype not in TRITON_DTYPES:
        return "reference"
    if x.is_cuda:
        return "triton"
    if force != "1" or x.device.type != "cpu":
        return "reference"
    if not interpreting():
        raise RuntimeError(f"{FORCE_ENV}=1 with CPU tensors runs Triton's interpreter: start the process with "
                           "TRITON_INTERPRET=1 (Triton reads it when triton is first imported)")
    return "interpreter"


def kernel_module(name: str) -> ModuleType:
    """kvfleet_kernels.<name> ('paged_attention', 'kv_write' or 'fused'), imported on first use (it imports triton)."""
    return importlib.import_module(f"kvfleet_kernels.{name}")


def _kernels(name: str, x: torch.Tensor) -> ModuleType | None:
    return None if backend(x) == "reference" else kernel_module(name)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if (ops := _kernels("fused", x)) is None:
        if cpu_fused.supports(x):
            return cpu_fused.rms_norm(x, weight, eps)
        return reference.rms_norm(x, weight, eps)
    return cast(torch.Tensor, ops.rms_norm(x, weight, eps))


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    if (ops := _kernels("fused", x)) is None:
        if cpu_fused.supports(x) and residual.dtype == x.dtype:
            return cpu_fused.add_rms_norm(x, residual, weight, eps)
        return reference.add_rms_norm(x, residual, weight, eps)
    return cast(tuple[torch.Tensor, torch.Tensor], ops.add_rms_norm(x, residual, weight, eps))


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    if (ops := _kernels("fused", x)) is None:
        if cpu_fused.supports(x) and cos.dtype == sin.dtype == x.dtype:
            return cpu_fused.rotary(x, cos, sin)
        return reference.rotary(x, cos, sin)
    return cast(torch.Tensor, ops.rotary(x, cos, sin))


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, [..., 2N] → [..., N]: cpu_fused's op on CPU, the reference (in place over gate_up) elsewhere."""
    if backend(gate_up) == "reference" and cpu_fused.supports(gate_up):
        return cpu_fused.silu_and_mul(gate_up)
    return reference.silu_and_mul(gate_up)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax, logits [N, V] → int64 [N]: cpu_argmax's one pass on CPU (torch's reduction is 10-20x
    slower there), torch.argmax elsewhere."""
    if cpu_argmax.supports(logits):
        return cpu_argmax.argmax(logits)
    return logits.argmax(dim=-1)


# The k_scale / v_scale arguments: [N, bs, KVH] float32 beside an int8 or fp8 cache (kv_quant.py), else None.
Scales = torch.Tensor | None


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: Scales = None, v_scale: Scales = None) -> None:
    if (ops := _kernels("kv_write", k)) is None:
        reference.write_kv(k_cache, v_cache, k, v, slot_mapping, k_scale, v_scale)
    else:
        ops.write_kv(k_cache, v_cache, k, v, slot_mapping, k_scale, v_scale)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           max_seq_len: int | None = None, k_scale: Scales = None,
                           v_scale: Scales = None) -> torch.Tensor:
    if (ops := _kernels("paged_attention", q)) is None:
        if cpu_attention.supports(q, k_cache):
            return cpu_attention.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale,
                                                        max_seq_len, k_scale, v_scale)
        return reference.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, max_seq_len,
                                                k_scale, v_scale)
    return cast(torch.Tensor, ops.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale,
                                                         max_seq_len, k_scale, v_scale))


def planned_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             flat_block_index: torch.Tensor, valid: torch.Tensor, scale: float, k_scale: Scales = None,
                             v_scale: Scales = None) -> torch.Tensor:
    if (ops := _kernels("paged_attention", q)) is None:
        if cpu_attention.supports(q, k_cache):
            return cpu_attention.planned_decode_attention(q, k_cache, v_cache, flat_block_index, valid, scale,
                                                          k_scale, v_scale)
        return reference.planned_decode_attention(q, k_cache, v_cache, flat_block_index, valid, scale, k_scale, v_scale)
    return cast(torch.Tensor, ops.planned_decode_attention(q, k_cache, v_cache, flat_block_index, valid, scale,
                                                           k_scale, v_scale))


def grouped_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             block_tables: torch.Tensor, seq_lens: torch.Tensor,
                             plan: Callable[[], tuple[torch.Tensor, torch.Tensor]], scale: float,
                             k_scale: Scales = None, v_scale: Scales = None) -> torch.Tensor:
    """A group of decode rows: the CPU kernel reads their tables and lengths in place; the kernels that gather
    take the group's decode_plan from `plan()` (computed on first use, then shared by every layer)."""
    if _kernels("paged_attention", q) is None and cpu_attention.supports(q, k_cache):
        return cpu_attention.decode(q, k_cache, v_cache, block_tables, seq_lens, scale, k_scale, v_scale)
    return planned_decode_attention(q, k_cache, v_cache, *plan(), scale, k_scale, v_scale)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_table: torch.Tensor, seq_len: int, scale: float, k_scale: Scales = None,
                            v_scale: Scales = None) -> torch.Tensor:
    if (ops := _kernels("paged_attention", q)) is None:
        return reference.paged_prefill_attention(q, k_cache, v_cache, block_table, seq_len, scale, k_scale, v_scale)
    return cast(torch.Tensor, ops.paged_prefill_attention(q, k_cache, v_cache, block_table, seq_len, scale,
                                                          k_scale, v_scale))


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    if (ops := _kernels("paged_attention", q)) is None:
        return reference.causal_attention(q, k, v, scale)
    return cast(torch.Tensor, ops.causal_attention(q, k, v, scale))
