"""GEMM crossover: the row count from which a prepacked oneDNN linear beats the few-row path, measured per weight shape.

oneDNN's inner product on a prepacked weight runs large batches 2-2.5x faster than F.linear, but each call costs a
fixed 25-40 us (measured on the 2-core AMD EPYC here, 1 or 2 threads), where a small weight's read takes 5-20 us at
one row. Below a weight of a few hundred thousand elements a decode step (a few rows) is then mostly that fixed
cost: a 2-layer, 128-wide draft model spent 73 us per linear, most of its forward. A small weight keeps a second copy
beside the packed one (KEEP_DENSE_MAX bounds the memory), for its few-row path: kvfleet_kernels.cpu_f32's tiles where
that kernel builds (one read of the weight for up to 96 rows), else the dense weight for F.linear.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)

KEEP_DENSE_MAX = 1 << 19  # elements (2 MiB in fp32): a second copy of a weight this small costs little memory
# The LM head is one weight, not one a layer: its copy may be larger (16 MiB in fp32: a small model's vocabulary).
HEAD_COPY_MAX = 1 << 22
ROWS = (1, 2, 4, 8, 16, 32, 64)
NEVER = 0  # a crossover of 0 rows: the packed path always
Run = Callable[[torch.Tensor], torch.Tensor]
# (out, in, threads, the few-row path's name) → crossover, once per process
_measured: dict[tuple[int, int, int, str], int] = {}
# Rows: every weight's crossover fixed, not measured. A measurement times the two paths, so under load it can move
# and with it the kernel a given row count takes (tiles and oneDNN agree to rounding, not bit for bit): pinning it
# makes the kernels, and so the bits, independent of how busy the machine was at load time (tests comparing batches
# of different sizes; reproducible runs).
PIN_ENV = "KVFLEET_GEMM_CROSSOVER"


def keeps_copy(weight: torch.Tensor, limit: int = KEEP_DENSE_MAX) -> bool:
    """Whether the weight is small enough (at most `limit` elements) to hold a second copy for the few-row path."""
    return weight.numel() <= limit


def crossover(weight: torch.Tensor, run_packed: Run, run_few: Run, few: str, limit: int = KEEP_DENSE_MAX) -> int:
    """The fewest rows at which `run_packed(x)` is at least as fast as `run_few(x)`, the path named `few` (NEVER for a
    weight of more than `limit` elements, too large to keep a second copy of); measured once per shape and thread
    count, with the caller's threads."""
    if not keeps_copy(weight, limit):
        return NEVER
    if pinned := os.environ.get(PIN_ENV):
        if not pinned.isdigit():
            raise ValueError(f"{PIN_ENV}={pinned!r}: give the rows from which the packed path runs, e.g. 8 "
                             "(0: always the packed path)")
        return int(pinned)
    out_f, in_f = weight.shape
    key = (int(out_f), int(in_f), torch.get_num_threads(), few)
    if key not in _measured:
        _measured[key] = _measure(weight, run_packed, run_few)
        log.debug("linear %d -> %d on %d threads: %s below %d rows, prepacked oneDNN from there", in_f, out_f,
                  key[2], few, _measured[key])
    return _measured[key]


def _measure(weight: torch.Tensor, run_packed: Run, run_few: Run) -> int:
    """The first of ROWS at which the packed path wins (beyond ROWS, the packed path: it wins large batches)."""
    with torch.inference_mode():
        for rows in ROWS:
            x = torch.randn(rows, weight.shape[1], dtype=weight.dtype)
            if _fastest(run_packed, x) <= _fastest(run_few, x):
                return rows
    return 2 * ROWS[-1]


def _fastest(call: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, blocks: int = 5, per_block: int = 8
             ) -> float:
    """The least time of `blocks` blocks of calls, after a warm-up: the least is the one least disturbed by whatever
    else the machine runs."""
    for _ in range(3):
        call(x)
    best = float("inf")
    for _ in range(blocks):
        start = time.perf_counter()
        for _ in range(per_block):
            call(x)
        best = min(best, time.perf_counter() - start)
    return best
