"""The CPU row argmax (kvfleet_kernels.cpu_argmax) against torch.argmax: exactly equal indices, ties, NaN and inf."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from kernel_helpers import assert_fallback_runs, gen

from kvfleet_kernels import cpu_argmax, dispatch

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
PORTABLE = pytest.mark.parametrize("portable", [False, True], ids=["avx2-if-present", "portable"])


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    """The kernel, built once (into the user's cache); without a compiler there is nothing to test here."""
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler: torch.argmax runs (see the fallback test)")
    assert cpu_argmax.available(), "a compiler is present but the kernel did not build: see the log"


def check(x: torch.Tensor, portable: bool) -> None:
    got = cpu_argmax.argmax(x, portable)
    assert got.dtype == torch.int64 and got.shape == (x.shape[0],)
    assert torch.equal(got, torch.argmax(x, dim=-1))


@DTYPES
@PORTABLE
# 1, 7, 31: no full vector pass; 33, 1000: a tail; 32000 x 64: the threaded path.
@pytest.mark.parametrize(("rows", "vocab"), [(1, 1), (3, 7), (2, 31), (5, 33), (9, 1000), (1, 32000), (64, 32000)])
def test_random_rows(dtype: torch.dtype, portable: bool, rows: int, vocab: int) -> None:
    check(torch.randn(rows, vocab, generator=gen(rows * vocab)).to(dtype), portable)


@DTYPES
@PORTABLE
def test_ties_go_to_the_first_index_in_any_lane(dtype: torch.dtype, portable: bool) -> None:
    """Equal maxima across the kernel's 32 lanes and its tail: the first one wins, as in torch."""
    x = torch.zeros(6, 100, dtype=dtype)
    for r, places in enumerate([[99, 3], [40, 8, 72], [31, 32], [97, 98, 99], [64, 1], [0, 50]]):
        x[r, places] = 2.0
    check(x, portable)
    check(torch.full((3, 77), -1.5, dtype=dtype), portable)  # every element the maximum: index 0


@DTYPES
@PORTABLE
def test_nan_and_infinities_as_torch(dtype: torch.dtype, portable: bool) -> None:
    x = torch.randn(7, 200, generator=gen(3)).to(dtype)
    x[0, 150] = float("nan")  # a NaN is argmax's answer, in the vector loop ...
    x[1, 199] = float("nan")  # ... or in the tail
    x[2, [10, 120]] = float("nan")  # the first of two
    x[3, 77] = float("inf")
    x[4] = float("-inf")  # all -inf: index 0
    x[5, :100] = float("-inf")
    x[6, [5, 180]] = float("inf")
    check(x, portable)


@DTYPES
def test_reads_rows_of_a_wider_tensor_in_place(dtype: torch.dtype) -> None:
    wide = torch.randn(16, 300, generator=gen(5)).to(dtype)
    check(wide[:, 7:263], False)  # row stride 300, 256 columns
    check(wide[::3], False)


def test_refuses_what_it_does_not_read() -> None:
    assert not cpu_argmax.supports(torch.randn(4, 8, dtype=torch.float16))
    assert not cpu_argmax.supports(torch.randn(8))
    assert not cpu_argmax.supports(torch.randn(8, 4).t())  # columns, not rows
    assert not cpu_argmax.supports(torch.empty(3, 0))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        cpu_argmax.argmax(torch.zeros(2, 3, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="unit last stride"):
        cpu_argmax.argmax(torch.randn(8, 4).t())


def test_dispatch_takes_the_kernel_on_cpu_and_torch_for_what_it_refuses() -> None:
    x = torch.randn(4, 500, generator=gen(9))
    assert torch.equal(dispatch.argmax(x), x.argmax(-1))
    half = x.half()
    assert torch.equal(dispatch.argmax(half), half.argmax(-1))


FALLBACK = """
import torch
from kvfleet_kernels import cpu_argmax, dispatch
assert not cpu_argmax.available()
x = torch.randn(3, 50)
assert torch.equal(dispatch.argmax(x), x.argmax(-1))
print("fallback ok")
"""


@pytest.mark.parametrize("why", ["no-compiler", "disabled"])
def test_without_the_kernel_torch_argmax_runs(why: str, tmp_path: Path) -> None:
    assert_fallback_runs(FALLBACK, why, tmp_path, cpu_argmax.ENABLE_ENV, cpu_argmax.NAME)
