"""Device and dtype policy: which device a rank runs on, in which dtype, and how step metadata reaches it."""

from __future__ import annotations

import contextlib
import ctypes
import logging
from collections.abc import Sequence

import numpy as np
import torch

from kvfleet_agent.config import EngineConfig
from kvfleet_agent.models.config import ModelConfig

log = logging.getLogger(__name__)


def cpu_bf16_matmul() -> str | None:
    """What gives this CPU native bfloat16 matmuls (oneDNN uses it): 'AMX', 'AVX512-BF16', or None."""
    if torch.cpu._is_amx_tile_supported():
        return "AMX"
    if torch.cpu._is_avx512_bf16_supported():
        return "AVX512-BF16"
    return None


def resolve_dtype(config: EngineConfig, model_cfg: ModelConfig, device: torch.device,
                  cpu_bf16: str | bool | None = True) -> torch.dtype:
    """The compute dtype: as asked; else on GPU the checkpoint's, float32 ones in bfloat16 (float16 where the GPU
    lacks it), as vLLM does: decode is memory-bound, half the bytes is twice the speed. On CPU a 16-bit checkpoint
    runs in bfloat16 where the CPU multiplies bfloat16 natively (cpu_bf16, detected when True), else float32:
    without AMX or AVX512-BF16 every bfloat16 product is converted and runs slower than float32. A float32
    checkpoint stays float32 on CPU (its outputs stay exactly transformers')."""
    name = config.dtype
    if name == "auto" and device.type == "cuda":
        name = model_cfg.torch_dtype
        if name == "float32":
            bf16 = not torch.cuda.is_available() or torch.cuda.is_bf16_supported()
            name = "bfloat16" if bf16 else "float16"
    elif name == "auto":
        native = cpu_bf16_matmul() if cpu_bf16 is True else cpu_bf16 or None
        half = model_cfg.torch_dtype in ("bfloat16", "float16")
        name = "bfloat16" if half and native else "float32"
        log.info("dtype auto on CPU: %s (%s checkpoint; %s)", name, model_cfg.torch_dtype,
                 f"{native} multiplies bfloat16 natively" if native else "no AMX or AVX512-BF16 for bfloat16 matmuls")
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"config.json torch_dtype={name!r} is not a torch dtype; pass dtype explicitly")
    return dtype


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    """The device of a tensor-parallel rank: one GPU each (counting from the configured one), or the CPU."""
    want = torch.device(config.device if config.device != "auto" else
                        ("cuda" if torch.cuda.is_available() else "cpu"))
    if want.type != "cuda":
        return want
    index = (want.index or 0) + rank
    if index >= torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size={config.tensor_parallel_size} needs GPU {index} for rank {rank}, "
                         f"but only {torch.cuda.device_count()} are visible: lower tensor_parallel_size")
    return torch.device("cuda", index)


def host_buffer(n: int, device: torch.device) -> torch.Tensor:
    """An int64 host tensor of n elements for staging step metadata bound for `device`.

    Pinned when the device is a GPU, so that its copy runs asynchronously (non_blocking). It comes
    from torch's caching host allocator, which hands a block out again only once the copies that read
    it have finished: a fresh buffer per step is cheap and needs no event bookkeeping of our own.
    """
    return torch.empty(n, dtype=torch.int64, pin_memory=device.type == "cuda")


def to_device(arrays: Sequence[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """The arrays as tensors on `device`: views of the numpy memory on CPU (no copy, as before), one
    pinned buffer and one asynchronous copy for all of them on a GPU (int64: every array here is an
    index)."""
    if device.type != "cuda":
        return [torch.from_numpy(a) for a in arrays]
    sizes = [a.size for a in arrays]
    host = host_buffer(sum(sizes), device)
    flat = host.numpy()
    offset = 0
    for a, n in zip(arrays, sizes, strict=True):
        flat[offset:offset + n] = a.reshape(-1)
        offset += n
    staged = host.to(device, non_blocking=True)
    return [t.view(a.shape) for t, a in zip(torch.split(staged, sizes), arrays, strict=True)]


def release_freed_memory() -> None:
    """Return the heap's freed pages to the OS (glibc's malloc_trim), where there is such a call.

    Loading frees about as much host memory as it keeps (tensors read whole, quantized, prepacked), and the
    allocator holds on to it: RSS, which a pod's memory limit watches, would go on counting it.
    """
    with contextlib.suppress(OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim this way
        ctypes.CDLL("libc.so.6").malloc_trim(0)
