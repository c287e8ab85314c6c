"""How many bytes a rank's KV pool gets: from a GPU profiling pass, or a share of RAM on CPU."""

from __future__ import annotations

import os

DEFAULT_CPU_KV_BYTES = 2 << 30


def kv_budget_from_profile(total: int, free: int, torch_allocated: int, torch_peak: int, utilization: float,
                           reserve: int = 0) -> int:
    """KV pool bytes on a GPU, from memory readings taken after a profiling forward pass.

    total, free: the device's memory (torch.cuda.mem_get_info) after the pass, torch's cache emptied;
    torch_allocated: what torch holds now (the weights); torch_peak: the most it held during the pass
    (the weights plus the largest step's activations); reserve: bytes kept back for later (CUDA graphs).
    The process needs, besides the pool, (total − free) − torch_allocated + torch_peak: memory outside
    torch's allocator (the CUDA context, NCCL; other processes too) plus weights and activations. The
    pool gets what is left of total × utilization after that and the reserve (never below zero).
    """
    in_use = (total - free) - torch_allocated + torch_peak
    return max(0, int(total * utilization) - in_use - reserve)


def cpu_kv_budget(tp_size: int, usable_blocks: int, bytes_per_block: int) -> int:
    """KV pool bytes on CPU: at most 2 GiB, a quarter of RAM shared by the ranks, and what usable_blocks need.

    Never more than every sequence at full length could use: the pool is zero-filled up front (a
    masked slot holding NaN garbage would still poison softmax·V), and that costs page faults.
    """
    total_ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return min(DEFAULT_CPU_KV_BYTES, total_ram // 4 // tp_size, usable_blocks * bytes_per_block)
