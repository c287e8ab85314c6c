"""The CPU INT8 weight-only kernel (kvfleet_kernels.cpu_int8) against x · (q · s)ᵀ, and QuantMatmul's use of it."""

# Tolerance: the kernel multiplies exact int8 values and applies each column's scale to the finished sum, so
# against a float64 reference only fp32 accumulation (and one rounding of the scale product) differs:
# ‖y − ref‖ / ‖ref‖ < 1e-5 (REL_TOL float32 of the Triton kernels' tests; ~1e-7 seen).

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from kernel_helpers import TILE_SHAPES, TOL, assert_fallback_runs, assert_fp32_near

from kvfleet_kernels import cpu_int8


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    """The kernel, built once (into the user's cache); without a compiler there is nothing to test here."""
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler: QuantMatmul runs PyTorch's INT8 kernels (see the fallback test)")
    assert cpu_int8.available(), "a compiler is present but the kernel did not build: see the log"


def case(m: int, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    return torch.randn(m, k, generator=g), q, torch.rand(n, generator=g) * 0.02 + 1e-3


def assert_exact(y: torch.Tensor, x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> None:
    assert_fp32_near(y, x.double() @ (q.double() * s.double()[:, None]).T)


@pytest.mark.parametrize("portable", [False, True], ids=["avx2-if-present", "portable"])
@pytest.mark.parametrize(("m", "n", "k"), TILE_SHAPES)
def test_matches_the_dequantized_reference(m: int, n: int, k: int, portable: bool) -> None:
    """Row counts around the 6-row register block and the 96-row pass, N and K off every tile multiple."""
    x, q, s = case(m, n, k)
    tiles, scale = cpu_int8.pack(q, s)
    assert_exact(cpu_int8.linear(x, tiles, scale, n, portable=portable), x, q, s)


def test_the_avx2_loop_runs_where_the_cpu_has_it() -> None:
    assert torch.ops.kvfleet_cpu_int8.has_avx2() == (torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"))


def test_no_rows_and_no_columns() -> None:
    x, q, s = case(0, 40, 64)
    assert cpu_int8.linear(x, *cpu_int8.pack(q, s), 40).shape == (0, 40)
    x, q, s = case(3, 40, 0)
    assert torch.equal(cpu_int8.linear(x, *cpu_int8.pack(q, s), 40), torch.zeros(3, 40))


@pytest.mark.parametrize("layout", ["row-strided", "column-strided", "transposed"])
def test_non_contiguous_activations(layout: str) -> None:
    _, q, s = case(1, 50, 96)
    g = torch.Generator().manual_seed(1)
    x = {"row-strided": lambda: torch.randn(9, 130, generator=g)[:, 7:103],  # rows 130 apart, columns dense
         "column-strided": lambda: torch.randn(9, 192, generator=g)[:, ::2],
         "transposed": lambda: torch.randn(96, 9, generator=g).T}[layout]()
    assert not x.is_contiguous()
    assert_exact(cpu_int8.linear(x, *cpu_int8.pack(q, s), 50), x, q, s)


def test_pack_pads_to_whole_tiles_with_zero_columns() -> None:
    _, q, s = case(1, 20, 24)
    tiles, scale = cpu_int8.pack(q, s)
    assert tiles.shape == (2, 24, 16) and tiles.dtype == torch.int8 and tiles.is_contiguous()
    assert torch.equal(tiles[1, :, 4:], torch.zeros(24, 12, dtype=torch.int8))
    assert torch.equal(tiles.transpose(1, 2).reshape(32, 24)[:20], q)
    assert scale.shape == (32,) and torch.equal(scale[:20], s) and not bool(scale[20:].any())


def test_results_do_not_depend_on_the_thread_count() -> None:
    """Threads split whole tiles, never a dot product, so every element is summed in the same order."""
    x, q, s = case(11, 300, 256)
    packed = cpu_int8.pack(q, s)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_int8.linear(x, *packed, 300)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(cpu_int8.linear(x, *packed, 300), one)


@pytest.mark.parametrize(("bad", "match"), [("dtype", "fp32"), ("columns", "columns"), ("n", "n does not match")])
def test_bad_inputs_are_refused(bad: str, match: str) -> None:
    x, q, s = case(2, 20, 32)
    tiles, scale = cpu_int8.pack(q, s)
    if bad == "dtype":
        x = x.double()
    elif bad == "columns":
        x = x[:, :16]
    with pytest.raises(RuntimeError, match=match):
        cpu_int8.linear(x, tiles, scale, 40 if bad == "n" else 20)


@pytest.mark.parametrize("rows", [1, 5, 16, 40])
@pytest.mark.parametrize("zero", [False, True])
def test_quant_matmul_runs_it_for_fp32_exactly_and_keeps_one_int8_copy(rows: int, zero: bool) -> None:
    from kvfleet_agent.layers.quant.matmul import QuantMatmul
    from kvfleet_agent.layers.quant.onload import quantize_int8
    from kvfleet_agent.layers.quant.weight import QuantWeight

    w = torch.randn(72, 136, generator=torch.Generator().manual_seed(2)) * 0.05
    qw = quantize_int8(w)
    if zero:
        qw = QuantWeight(q=qw.q, scale=qw.scale, zero=torch.full((72, 1), 3.0), bits=8, group_size=136)
    mm = QuantMatmul(qw, torch.float32)
    assert mm.path == "cpu-int8" and mm.dense is None and hasattr(mm, "tiles") and not hasattr(mm, "q8")
    assert mm.nbytes <= 80 * 136 + 3 * 80 * 4  # the int8 tiles (N padded to 80) and per-channel fp32 vectors
    x = torch.randn(rows, 136)
    ref = x.double() @ qw.dequantize().double().T
    assert float((mm(x).double() - ref).norm() / ref.norm()) < TOL[torch.float32]


FALLBACK = """
import torch
from kvfleet_kernels import cpu_int8
from kvfleet_agent.layers.quant.matmul import QuantMatmul
from kvfleet_agent.layers.quant.onload import quantize_int8
assert not cpu_int8.available()
qw = quantize_int8(torch.randn(32, 64) * 0.05)
mm = QuantMatmul(qw, torch.float32)
assert mm.path == "cpu-int8" and hasattr(mm, "q8") and not hasattr(mm, "tiles")
x = torch.randn(3, 64)
ref = x @ qw.dequantize().T
assert float((mm(x) - ref).norm() / ref.norm()) < 1e-2  # bf16 activations in PyTorch's kernel
print("fallback ok")
"""


@pytest.mark.parametrize("why", ["no-compiler", "disabled"])
def test_without_the_kernel_int8_weights_take_pytorchs(why: str, tmp_path: Path) -> None:
    assert_fallback_runs(FALLBACK, why, tmp_path, cpu_int8.ENABLE_ENV, cpu_int8.NAME)
