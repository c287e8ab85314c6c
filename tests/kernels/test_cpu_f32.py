"""The CPU fp32 few-row kernel (kvfleet_kernels.cpu_f32) against x · wᵀ in float64, and its tile layout."""

# Tolerance: fp32 products accumulated in fp32 over K terms, against a float64 reference:
# ‖y − ref‖ / ‖ref‖ < 1e-5 (as the INT8 kernel's tests; ~1e-7 seen).

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch
from kernel_helpers import TILE_SHAPES, assert_fp32_near

from kvfleet_kernels import cpu_f32


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    """The kernel, built once (into the user's cache); without a compiler there is nothing to test here."""
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler: few rows run F.linear (tests/agent/test_linear.py checks that path)")
    assert cpu_f32.available(), "a compiler is present but the kernel did not build: see the log"


def case(m: int, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)


def assert_close(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    assert_fp32_near(y, x.double() @ w.double().T)


@pytest.mark.parametrize("portable", [False, True], ids=["avx2-if-present", "portable"])
@pytest.mark.parametrize(("m", "n", "k"), TILE_SHAPES)
def test_matches_the_reference(m: int, n: int, k: int, portable: bool) -> None:
    """Row counts around the 6-row register block and the 96-row pass, N and K off every tile multiple."""
    x, w = case(m, n, k)
    assert_close(cpu_f32.linear(x, cpu_f32.pack(w), n, portable=portable), x, w)


def test_no_rows_and_no_columns() -> None:
    x, w = case(0, 40, 64)
    assert cpu_f32.linear(x, cpu_f32.pack(w), 40).shape == (0, 40)
    x, w = case(3, 40, 0)
    assert torch.equal(cpu_f32.linear(x, cpu_f32.pack(w), 40), torch.zeros(3, 40))


@pytest.mark.parametrize("layout", ["row-strided", "column-strided", "transposed"])
def test_non_contiguous_activations(layout: str) -> None:
    _, w = case(1, 50, 96)
    g = torch.Generator().manual_seed(1)
    x = {"row-strided": lambda: torch.randn(9, 130, generator=g)[:, 7:103],
         "column-strided": lambda: torch.randn(9, 192, generator=g)[:, ::2],
         "transposed": lambda: torch.randn(96, 9, generator=g).T}[layout]()
    assert not x.is_contiguous()
    assert_close(cpu_f32.linear(x, cpu_f32.pack(w), 50), x, w)


def test_pack_pads_to_whole_tiles_with_zero_columns() -> None:
    _, w = case(1, 20, 24)
    tiles = cpu_f32.pack(w)
    assert tiles.shape == (2, 24, 16) and tiles.dtype == torch.float32 and tiles.is_contiguous()
    assert torch.equal(tiles[1, :, 4:], torch.zeros(24, 12))
    assert torch.equal(tiles.transpose(1, 2).reshape(32, 24)[:20], w)


def test_results_do_not_depend_on_the_thread_count() -> None:
    """Threads split whole tiles, never a dot product, so every element is summed in the same order."""
    x, w = case(11, 300, 256)
    tiles = cpu_f32.pack(w)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_f32.linear(x, tiles, 300)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(cpu_f32.linear(x, tiles, 300), one)


@pytest.mark.parametrize(("bad", "match"), [("dtype", "fp32"), ("columns", "columns"), ("n", "n does not match"),
                                            ("tiles", "fp32 \\[NT, K, 16\\] tiles")])
def test_bad_inputs_are_refused(bad: str, match: str) -> None:
    x, w = case(2, 20, 32)
    tiles = cpu_f32.pack(w)
    if bad == "dtype":
        x = x.double()
    elif bad == "columns":
        x = x[:, :16]
    elif bad == "tiles":
        tiles = tiles.double()
    with pytest.raises(RuntimeError, match=match):
        cpu_f32.linear(x, tiles, 40 if bad == "n" else 20)


def test_a_rows_result_does_not_depend_on_the_rows_beside_it() -> None:
    """Batch invariance: every row is summed in one order whatever the block it lands in, so a request's output is
    the same alone, in a batch of 9 or of 16 (a padded step)."""
    x, w = case(16, 70, 129)
    tiles = cpu_f32.pack(w)
    whole = cpu_f32.linear(x, tiles, 70)
    for m in (1, 2, 3, 5, 9):
        assert torch.equal(cpu_f32.linear(x[:m], tiles, 70), whole[:m])
    assert torch.equal(cpu_f32.linear(x[7:8], tiles, 70), whole[7:8])


def test_the_avx2_loop_where_avx512_runs() -> None:
    """KVFLEET_CPU_AVX512=0 keeps the AVX2 loop on a CPU with AVX-512 (read once per process: a child runs it). Both
    loops match the reference; they sum in different orders (AVX-512 splits k four ways), so only to rounding."""
    code = ("import torch; from kvfleet_kernels import cpu_f32; assert cpu_f32.available(); "
            "g = torch.Generator().manual_seed(0); "
            "x = torch.randn(7, 129, generator=g); w = torch.randn(70, 129, generator=g); "
            "y = cpu_f32.linear(x, cpu_f32.pack(w), 70); ref = x.double() @ w.double().T; "
            "print(float((y.double() - ref).norm() / ref.norm()))")
    for flag in ("0", "1"):
        env = {**os.environ, "KVFLEET_CPU_AVX512": flag}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        assert float(out.stdout.strip().splitlines()[-1]) < 1e-5
