"""The kernel benchmark: its byte and FLOP counts, its CPU message, and every case run end to end at tiny shapes."""

from __future__ import annotations

import io
from collections.abc import Callable
from contextlib import redirect_stdout

import pytest
import torch
from kernel_helpers import small_case_runner

from kvfleet_kernels import bench

pytest.importorskip("triton")


def test_work_counts() -> None:
    # Decode: every cached K and V once, plus q in and the output out.
    assert bench.decode_bytes([3, 5], h=4, kvh=2, d=8, elt=2) == 8 * 2 * 8 * 2 * 2 + 2 * 2 * 4 * 8 * 2
    # Prefill of 2 queries after 3 cached tokens: they see 4 and 5 keys; two products of 2 FLOP per pair and dim.
    assert bench.prefill_flops(2, 3, h=1, d=1) == 4 * (4 + 5)
    assert bench.prefill_flops(4, 0, h=32, d=128) == 4 * 32 * 128 * (1 + 2 + 3 + 4)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the message is for machines without a GPU")
def test_without_a_gpu_it_says_so_and_exits_zero() -> None:
    out = io.StringIO()
    with redirect_stdout(out):
        assert bench.main([]) == 0
    assert "needs a CUDA GPU" in out.getvalue()


def check_every_case_runs(device: torch.device) -> None:
    """Each case builds its inputs, checks the kernel against the reference, and prints one line without FAILED."""
    saved = bench.time_ms, bench.graph_ms, bench.rotations
    bench.rotations = lambda bytes_per_call: 2  # tiny inputs would otherwise take hundreds of copies
    if device.type != "cuda":  # no CUDA events here: run each call once and pretend it took 1 ms
        bench.time_ms = bench.graph_ms = lambda fn, warmup, reps: (fn(), 1.0)[1]
    try:
        b = bench.Bench(torch.float32, 1, 2, device=device.type, shapes=(8, 2, 64, 256, 16))
        b.copy_gbs, b.matmul_tflops = 1000.0, 100.0
        out = io.StringIO()
        with redirect_stdout(out):
            b.decode([5, 20, 1], "ragged")
            b.prefill(7, 0)
            b.prefill(7, 9)
            b.kv_write(5)
            b.norm(3, residual=False)
            b.norm(3, residual=True)
            b.rotary(4)
        lines = out.getvalue().splitlines()
        assert len(lines) == 7, lines
        assert not [line for line in lines if "FAILED" in line], lines
    finally:
        bench.time_ms, bench.graph_ms, bench.rotations = saved


@pytest.fixture(scope="module")
def small() -> Callable[..., None]:
    return small_case_runner()


def test_every_case_runs_at_tiny_shapes(small: Callable[..., None]) -> None:
    small(check_every_case_runs)
