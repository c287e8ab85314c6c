"""The CPU fused kernels (kvfleet_kernels.cpu_fused) against reference.rms_norm, add_rms_norm, rotary, silu * up."""

# Tolerance: REL_TOL[float32] (1e-5) in float32, where only the sum of squares' order and silu's exp differ from
# PyTorch's. In bfloat16 the kernels round where PyTorch's op sequence rounds, so outputs are PyTorch's bits but for
# a rare 1-ulp flip (a float32 value within ~1e-7 of a rounding boundary): beside REL_TOL[bfloat16], at most
# BF16_FLIPS of the elements may differ at all. A kernel that skipped a rounding (say RMSNorm's cast to x's dtype
# before the weight) changes a large share of them.

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from kernel_helpers import assert_fallback_runs, assert_matches, gen, randn

from kvfleet_kernels import cpu_fused, reference

DTYPES = [torch.float32, torch.bfloat16]
DTYPE_IDS = ["f32", "bf16"]
TOKENS = [1, 3, 64, 513]
HIDDEN = [64, 100, 256, 4096]  # 100: a vector loop's tail
BF16_FLIPS = 2e-3
EPS = 1e-6
PORTABLE = pytest.mark.parametrize("portable", [False, True], ids=["avx2-if-present", "portable"])


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    """The kernels, built once (into the user's cache); without a compiler there is nothing to test here."""
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler: the reference runs (see the fallback test)")
    assert cpu_fused.available(), "a compiler is present but the kernels did not build: see the log"


def check(out: torch.Tensor, ref: torch.Tensor, x_dtype: torch.dtype | None = None) -> None:
    """out has the reference's dtype and values: within REL_TOL of the precision x was rounded to (bf16 x under a
    float32 weight: a float32 output of bf16-rounded values), and then its bits but for rare 1-ulp flips."""
    assert out.dtype == ref.dtype
    assert out.is_contiguous()
    rounded = torch.bfloat16 in (out.dtype, x_dtype)
    assert_matches(out, ref, torch.bfloat16 if rounded else torch.float32)
    if rounded:
        flips = (out != ref).float().mean().item() if out.numel() else 0.0
        assert flips <= BF16_FLIPS, f"{flips:.2%} of the elements differ from the reference's"


def rows(t: int, h: int, dtype: torch.dtype, g: torch.Generator, strided: bool) -> torch.Tensor:
    """[t, h], or a column slice of a wider tensor (a row stride that is not h)."""
    return randn((t, h + 5), g, dtype)[:, 2:h + 2] if strided else randn((t, h), g, dtype)


def weight(h: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    return (randn((h,), g, torch.float32) * 0.5 + 1.0).to(dtype)


@PORTABLE
@pytest.mark.parametrize("w_dtype", DTYPES, ids=[f"w-{d}" for d in DTYPE_IDS])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("h", HIDDEN)
def test_rms_norm_matches_the_reference(h: int, dtype: torch.dtype, w_dtype: torch.dtype, portable: bool) -> None:
    """Output dtype promote_types(weight, x), as the reference's weight * normed.to(x.dtype)."""
    g = gen(h)
    w = weight(h, w_dtype, g)
    for t in TOKENS:
        for strided in (False, True):
            x = rows(t, h, dtype, g, strided) * 3.0
            before = x.clone()
            check(cpu_fused.rms_norm(x, w, EPS, portable), reference.rms_norm(x, w, EPS), dtype)
            assert torch.equal(x, before)


@PORTABLE
@pytest.mark.parametrize("w_dtype", DTYPES, ids=[f"w-{d}" for d in DTYPE_IDS])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("h", HIDDEN)
def test_add_rms_norm_matches_the_reference(h: int, dtype: torch.dtype, w_dtype: torch.dtype,
                                            portable: bool) -> None:
    """Both outputs: the normed sum, and the new residual (residual + x in x's dtype: exactly the reference's);
    neither input is written."""
    g = gen(100 + h)
    w = weight(h, w_dtype, g)
    for t in TOKENS:
        for strided in (False, True):
            x, residual = rows(t, h, dtype, g, strided), rows(t, h, dtype, g, not strided) * 2.0
            before = x.clone(), residual.clone()
            normed, new_residual = cpu_fused.add_rms_norm(x, residual, w, EPS, portable)
            ref_normed, ref_residual = reference.add_rms_norm(x, residual, w, EPS)
            assert new_residual.dtype == dtype and torch.equal(new_residual, ref_residual)
            assert new_residual.data_ptr() != residual.data_ptr()
            check(normed, ref_normed, dtype)
            assert torch.equal(x, before[0]) and torch.equal(residual, before[1])


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_norms_of_other_layouts(dtype: torch.dtype) -> None:
    """Rows of any shape (Qwen3's per-head q/k norm), a last dim that is not dense, a single row, an empty batch."""
    g = gen(7)
    w = weight(64, dtype, g)
    for x in (randn((5, 6, 64), g, dtype), randn((64, 9), g, dtype).t(), randn((64,), g, dtype),
              randn((3, 12, 64), g, dtype)[:, 1:9]):
        check(cpu_fused.rms_norm(x, w, EPS), reference.rms_norm(x, w, EPS), dtype)
        residual = randn(tuple(x.shape), g, dtype)
        normed, new_residual = cpu_fused.add_rms_norm(x, residual, w, EPS)
        ref_normed, ref_residual = reference.add_rms_norm(x, residual, w, EPS)
        check(normed, ref_normed, dtype)
        assert torch.equal(new_residual, ref_residual)
    empty = torch.empty(0, 64, dtype=dtype)
    assert cpu_fused.rms_norm(empty, w, EPS).shape == (0, 64)
    assert [o.shape for o in cpu_fused.add_rms_norm(empty, empty, w, EPS)] == [(0, 64), (0, 64)]


def test_rms_norm_eps_and_zero_rows() -> None:
    """eps inside the root (a zero row stays zero, not NaN), and it counts on small values."""
    x, w = torch.zeros(2, 100), torch.ones(100)
    x[1] = 1e-3
    out = cpu_fused.rms_norm(x, w, 1e-4)
    assert torch.equal(out[0], torch.zeros(100))
    assert_matches(out, reference.rms_norm(x, w, 1e-4), torch.float32)
    assert not torch.allclose(out, cpu_fused.rms_norm(x, w, 1e-8))


HEADS = [(12, 64), (6, 128), (3, 32), (2, 36)]  # (heads, head size); D 36: a half (18) off the 8-wide loop


def qk_view(t: int, heads: int, d: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """As the model rotates q and k: qkv [t, q_size + 2 kv_size] dense, x = qkv[:, :q_size + kv_size].view(...),
    with kv heads a third of the heads (so strides (q_size + 2 kv_size, D, 1))."""
    kvh = max(1, heads // 3)
    h = heads - kvh
    qkv = randn((t, (h + 2 * kvh) * d), g, dtype)
    x = qkv[:, :(h + kvh) * d].view(t, h + kvh, d)
    assert t == 1 or x.stride() == ((h + 2 * kvh) * d, d, 1)
    return x


def rope_tables(t: int, d: int, dtype: torch.dtype, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's cos / sin rows (RotaryEmbedding: the frequencies twice over) at random positions."""
    inv = 1.0 / 10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    pos = torch.randint(0, 4096, (t,), generator=g).float()
    emb = torch.cat((torch.outer(pos, inv),) * 2, dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


@PORTABLE
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(("heads", "d"), HEADS, ids=[f"{h}x{d}" for h, d in HEADS])
def test_rotary_matches_the_reference(heads: int, d: int, dtype: torch.dtype, portable: bool) -> None:
    """On the model's strided view of q and k; with the model's tables, and with random cos / sin (whose two
    halves differ, so a half read from the wrong place shows)."""
    g = gen(heads * d)
    for t in TOKENS:
        x = qk_view(t, heads, d, dtype, g)
        before = x.clone()
        for cos, sin in (rope_tables(t, d, dtype, g), (randn((t, d), g, dtype), randn((t, d), g, dtype))):
            out = cpu_fused.rotary(x, cos, sin, portable)
            assert out.shape == x.shape
            check(out, reference.rotary(x, cos, sin))
        assert torch.equal(x, before)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_rotary_of_other_layouts(dtype: torch.dtype) -> None:
    """A dense x, a head size that is not the last stride (a copy), strided cos / sin rows, no tokens."""
    g = gen(3)
    cos, sin = randn((5, 64 + 3), g, dtype)[:, :64], randn((5, 64 + 3), g, dtype)[:, 3:]
    for x in (randn((5, 4, 64), g, dtype), randn((5, 64, 4), g, dtype).transpose(1, 2),
              randn((4, 5, 64), g, dtype).transpose(0, 1)):
        check(cpu_fused.rotary(x, cos, sin), reference.rotary(x, cos, sin))
    empty = torch.empty(0, 4, 64, dtype=dtype)
    assert cpu_fused.rotary(empty, cos[:0], sin[:0]).shape == (0, 4, 64)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """The reference: F.silu(gate) * up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@PORTABLE
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("n", [64, 100, 688, 4096])
def test_silu_and_mul_matches_the_reference(n: int, dtype: torch.dtype, portable: bool) -> None:
    g = gen(n)
    for t in TOKENS:
        for strided in (False, True):
            gate_up = rows(t, 2 * n, dtype, g, strided) * 4.0  # gates out to ±16: silu's curved part and its tails
            out = cpu_fused.silu_and_mul(gate_up, portable)
            assert out.shape == (t, n)
            check(out, silu_mul(gate_up))


@PORTABLE
def test_silu_over_the_whole_float_range(portable: bool) -> None:
    """Gates where e^-g overflows or vanishes (|g| near and past 88), elementwise, tiny results included."""
    gate = torch.cat((torch.linspace(-120, 120, 2401), torch.tensor([0.0, -0.0, 1e-30, -1e-30, 3e38, -3e38])))
    gate_up = torch.cat((gate, torch.linspace(-2, 2, gate.numel()))).view(1, -1)
    torch.testing.assert_close(cpu_fused.silu_and_mul(gate_up, portable), silu_mul(gate_up), rtol=1e-5, atol=1e-30)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_silu_and_mul_of_other_shapes(dtype: torch.dtype) -> None:
    g = gen(5)
    for gate_up in (randn((2, 3, 200), g, dtype), randn((200,), g, dtype), randn((200, 6), g, dtype).t()):
        check(cpu_fused.silu_and_mul(gate_up), silu_mul(gate_up))
    assert cpu_fused.silu_and_mul(torch.empty(0, 200, dtype=dtype)).shape == (0, 100)


def test_results_do_not_depend_on_the_thread_count() -> None:
    """Big calls split rows between threads, never a row, so every output has the same bits."""
    g = gen(11)
    f32 = torch.float32
    x, residual, w = randn((513, 4096), g, f32), randn((513, 4096), g, f32), weight(4096, f32, g)
    qk, cos, sin = qk_view(513, 12, 64, f32, g), randn((513, 64), g, f32), randn((513, 64), g, f32)

    def run() -> list[torch.Tensor]:
        return [cpu_fused.rms_norm(x, w, EPS), *cpu_fused.add_rms_norm(x, residual, w, EPS),
                cpu_fused.rotary(qk, cos, sin), cpu_fused.silu_and_mul(x)]

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run()
        torch.set_num_threads(2)
        two = run()
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(one, two, strict=True))


def test_supports() -> None:
    assert cpu_fused.supports(torch.zeros(2)) and cpu_fused.supports(torch.zeros(2, dtype=torch.bfloat16))
    assert not cpu_fused.supports(torch.zeros(2, dtype=torch.float16))
    assert not cpu_fused.supports(torch.zeros(2, dtype=torch.float64))
    assert not cpu_fused.supports(torch.zeros(2, device="meta"))


@pytest.mark.parametrize("bad", ["x-f16", "x-f64", "weight-f16", "weight-size", "residual-shape", "residual-dtype",
                                 "rotary-f16", "rotary-cos-dtype", "rotary-cos-shape", "rotary-odd-d", "rotary-2d",
                                 "silu-f16", "silu-odd"])
def test_bad_inputs_are_refused(bad: str) -> None:
    x, w = torch.randn(3, 64), torch.ones(64)
    qk, cs = torch.randn(3, 4, 64), torch.randn(3, 64)
    ops = torch.ops.kvfleet_cpu_fused
    with pytest.raises(RuntimeError, match="kvfleet_cpu_fused"):
        if bad == "x-f16":
            ops.rms_norm(x.half(), w, EPS)
        elif bad == "x-f64":
            ops.add_rms_norm(x.double(), x.double(), w, EPS)
        elif bad == "weight-f16":
            ops.rms_norm(x, w.half(), EPS)
        elif bad == "weight-size":
            ops.rms_norm(x, w[:63], EPS)
        elif bad == "residual-shape":
            ops.add_rms_norm(x, x[:2], w, EPS)
        elif bad == "residual-dtype":
            ops.add_rms_norm(x, x.bfloat16(), w, EPS)
        elif bad == "rotary-f16":
            ops.rotary(qk.half(), cs.half(), cs.half())
        elif bad == "rotary-cos-dtype":
            ops.rotary(qk.bfloat16(), cs, cs)
        elif bad == "rotary-cos-shape":
            ops.rotary(qk, cs[:2], cs)
        elif bad == "rotary-odd-d":
            ops.rotary(qk[..., :63], cs[:, :63], cs[:, :63])
        elif bad == "rotary-2d":
            ops.rotary(x, cs, cs)
        elif bad == "silu-f16":
            ops.silu_and_mul(x.half())
        else:
            ops.silu_and_mul(x[:, :63])


def test_dtype_refusals_say_what_is_supported() -> None:
    with pytest.raises(RuntimeError, match=r"Half, not supported \(float32 or bfloat16\)"):
        cpu_fused.rms_norm(torch.randn(2, 8).half(), torch.ones(8), EPS)


def test_the_avx2_loop_runs_where_the_cpu_has_it() -> None:
    has = torch.ops.kvfleet_cpu_fused.has_avx2()
    assert has == (torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"))


FALLBACK = """
import torch
from kvfleet_kernels import cpu_fused
assert not cpu_fused.available()
assert not cpu_fused.supports(torch.zeros(2, 8))
print("fallback ok")
"""


@pytest.mark.parametrize("why", ["no-compiler", "disabled"])
def test_without_the_kernels_nothing_is_built(why: str, tmp_path: Path) -> None:
    assert_fallback_runs(FALLBACK, why, tmp_path, cpu_fused.ENABLE_ENV, cpu_fused.NAME)
