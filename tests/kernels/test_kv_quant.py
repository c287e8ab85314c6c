"""The int8 / fp8 KV cache: the reference's rounding, the Triton write and attention kernels against it, its error."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from kernel_helpers import (
    POISON,
    assert_matches,
    device_gen,
    paged_pool,
    randn,
    small_case_runner,
    strided_heads,
    triton_ops,
)

from kvfleet_kernels import kv_quant, plan, reference

CACHE_DTYPES = [torch.int8, torch.float8_e4m3fn]
Run = Callable[..., None]


def quantized_pool(k_cache: torch.Tensor, v_cache: torch.Tensor,
                   cache_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A float pool's whole contents quantized row by row, as write_kv would have stored them."""
    kq, ks = kv_quant.quantize(k_cache, cache_dtype)
    vq, vs = kv_quant.quantize(v_cache, cache_dtype)
    return kq, vq, ks, vs


# ---------------------------------------------------------------------------------------------
# The reference


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
def test_a_row_comes_back_within_its_format_step(cache_dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn((64, 4, 128), generator=g) * torch.logspace(-3, 3, 64)[:, None, None]  # rows of every scale
    x[3, 1] = 0.0  # a row of zeros: finite scale, zeros back
    values, scales = kv_quant.quantize(x, cache_dtype)
    assert values.dtype == cache_dtype and scales.shape == (64, 4) and bool(torch.isfinite(scales).all())
    back = kv_quant.dequantize(values, scales, torch.float32)
    assert torch.equal(back[3, 1], torch.zeros(128))
    amax = x.abs().amax(-1, keepdim=True)
    if cache_dtype == torch.int8:  # a uniform grid: half a step of amax/127 at most
        assert bool(((back - x).abs() <= amax / 127 * 0.5001).all())
    else:  # E4M3 keeps 3 mantissa bits: relative error ≤ 2^-4 above its subnormals (amax · 2^-6 / 448)
        tiny = amax * 2.0 ** -6 / 448
        rel_ok = (back - x).abs() <= x.abs() * 2.0 ** -4 * 1.0001 + tiny
        assert bool(rel_ok.all())
    assert bool((values.float().abs().amax(-1)[torch.arange(64) != 3] == kv_quant.QMAX[cache_dtype]).all())


def test_int8_rounds_half_away_from_zero_not_to_even() -> None:
    x = torch.tensor([[127.0, 0.5, -0.5, 1.5, -2.5]])  # scale 1: ties are exact
    values, scales = kv_quant.quantize(x, torch.int8)
    assert float(scales[0]) == 1.0
    assert values.tolist() == [[127, 1, -1, 2, -3]]


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
def test_reference_write_stores_codes_and_scales_and_skips_padding(cache_dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    k_cache = torch.zeros((4, 8, 2, 64), dtype=cache_dtype)
    v_cache = torch.zeros_like(k_cache)
    k_scale, v_scale = torch.full((4, 8, 2), -1.0), torch.full((4, 8, 2), -1.0)
    k, v = torch.randn((5, 2, 64), generator=g), torch.randn((5, 2, 64), generator=g)
    slots = torch.tensor([9, -1, 0, 31, 17])
    reference.write_kv(k_cache, v_cache, k, v, slots, k_scale, v_scale)
    want_k, want_ks = kv_quant.quantize(k, cache_dtype)
    flat, flat_s = k_cache.view(-1, 2, 64), k_scale.view(-1, 2)
    for row, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(flat[slot].float(), want_k[row].float()) and torch.equal(flat_s[slot], want_ks[row])
    assert int((k_scale > 0).sum()) == 4 * 2 and int((v_scale > 0).sum()) == 4 * 2  # the padding row wrote nothing


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
def test_attention_over_a_quantized_cache_stays_near_full_precision(cache_dtype: torch.dtype) -> None:
    g = device_gen(torch.device("cpu"), 2)
    lengths = [1, 17, 50, 33]
    k_cache, v_cache, tables = paged_pool(lengths, 16, 2, 64, torch.float32, g, spare_blocks=1)
    q = randn((len(lengths), 8, 64), g, torch.float32)
    seq_lens = torch.tensor(lengths)
    exact = reference.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.125)
    kq, vq, ks, vs = quantized_pool(k_cache, v_cache, cache_dtype)
    got = reference.paged_decode_attention(q, kq, vq, tables, seq_lens, 0.125, None, ks, vs)
    err = float((got - exact).norm() / exact.norm())
    assert err < (0.01 if cache_dtype == torch.int8 else 0.05), err  # fp8's 3 mantissa bits cost ~10x int8's 7
    assert err > 0  # the quantized values were read, not a float copy


# ---------------------------------------------------------------------------------------------
# Triton: the interpreter on CPU, compiled on a GPU


@pytest.fixture(scope="module")
def small() -> Run:
    pytest.importorskip("triton")
    return small_case_runner()


def check_fp8_codec(device: torch.device) -> None:
    """Every finite E4M3 value and random fp32 inputs round exactly as PyTorch's conversion; every byte decodes."""
    codes = torch.arange(256, dtype=torch.int32, device=device)
    finite = (codes & 0x7F) != 0x7F
    all_values = codes.to(torch.uint8).view(torch.float8_e4m3fn).float()[finite]
    g = device_gen(device, 3)
    x = torch.cat([all_values, randn((4000,), g, torch.float32, 100.0).clamp(-448, 448),
                   randn((1000,), g, torch.float32, 0.01), all_values[:-1] + all_values.diff() / 2])  # ties too
    x = x[: x.numel() // 64 * 64].view(-1, 1, 64)
    k_cache = torch.zeros((x.shape[0], 1, 1, 64), dtype=torch.float8_e4m3fn, device=device)
    v_cache = torch.zeros_like(k_cache)
    scales = torch.zeros((x.shape[0], 1, 1), device=device)
    slots = torch.arange(x.shape[0], device=device)
    triton_ops("kv_write").write_kv(k_cache, v_cache, x, x, slots, scales, scales.clone())
    want, want_scale = kv_quant.quantize(x, torch.float8_e4m3fn)
    torch.testing.assert_close(scales.view(-1), want_scale.view(-1), rtol=1e-6, atol=0)
    assert torch.equal(k_cache.view(-1, 64).float(), want.view(-1, 64).float())
    # and back: attention reads every byte through the kernel's own decoder, checked by the decode cases below


def check_write(device: torch.device, cache_dtype: torch.dtype, dtype: torch.dtype, seed: int) -> None:
    g = device_gen(device, seed)
    t, kvh, d, bs, n = 9, 2, 64, 4, 6
    k_cache = torch.zeros((n, bs, kvh, d), dtype=cache_dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    k_scale, v_scale = (torch.full((n, bs, kvh), -1.0, device=device) for _ in range(2))
    k, v = strided_heads(t, kvh, d, g, dtype), strided_heads(t, kvh, d, g, dtype)
    slots = torch.randperm(n * bs, generator=g, device=device)[:t]
    slots[2] = -1
    want = [x.clone() for x in (k_cache, v_cache, k_scale, v_scale)]
    real = slots >= 0
    reference.write_kv(*want[:2], k[real], v[real], slots[real], *want[2:])
    triton_ops("kv_write").write_kv(k_cache, v_cache, k, v, slots, k_scale, v_scale)
    for got, exp in zip((k_scale, v_scale), want[2:], strict=True):
        torch.testing.assert_close(got, exp, rtol=1e-6, atol=0)  # untouched slots stay -1 in both
    for got, exp in zip((k_cache, v_cache), want[:2], strict=True):
        if device.type == "cpu":  # the interpreter computes as PyTorch does: the same bytes
            assert torch.equal(got.float(), exp.float())
        else:  # a GPU's fast division may put x · qmax/amax across a rounding boundary: one step at most, rarely
            step = 1.0 if cache_dtype == torch.int8 else exp.float().abs() / 8 + 2.0 ** -9
            assert bool(((got.float() - exp.float()).abs() <= step).all())


def check_attention(device: torch.device, cache_dtype: torch.dtype, dtype: torch.dtype, seed: int, *,
                    kind: str, num_splits: int | None = None) -> None:
    g = device_gen(device, seed)
    lengths, bs, h, kvh, d = [1, 5, 16, 17, 50], 16, 8, 2, 64
    k_cache, v_cache, tables = paged_pool(lengths, bs, kvh, d, torch.float32, g)
    kq, vq, ks, vs = quantized_pool(k_cache, v_cache, cache_dtype)
    ops = triton_ops("paged_attention")
    scale = 0.7 * d ** -0.5
    seq_lens = torch.tensor(lengths, device=device)
    if kind == "prefill":
        q = strided_heads(13, h, d, g, dtype)
        out = torch.full(q.shape, POISON, dtype=dtype, device=device)
        want = reference.paged_prefill_attention(q.float(), kq, vq, tables[4], 50, scale, ks, vs)
        got = ops.paged_prefill_attention(q, kq, vq, tables[4], 50, scale, ks, vs, out=out)
    else:
        q = strided_heads(len(lengths), h, d, g, dtype)
        out = torch.full(q.shape, POISON, dtype=dtype, device=device)
        want = reference.paged_decode_attention(q.float(), kq, vq, tables, seq_lens, scale, None, ks, vs)
        if kind == "planned":
            flat, valid = plan.decode_plan(tables, seq_lens, bs)
            got = ops.planned_decode_attention(q, kq, vq, flat, valid, scale, ks, vs, out=out, num_splits=num_splits,
                                               block_n=16)
        else:
            got = ops.paged_decode_attention(q, kq, vq, tables, seq_lens, scale, None, ks, vs, out=out,
                                             num_splits=num_splits, block_n=16)
    assert got is out
    assert_matches(got.float(), want, dtype)


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
def test_triton_write_quantizes_as_the_reference(small: Run, cache_dtype: torch.dtype) -> None:
    small(check_write, cache_dtype, torch.float32, seed=4)
    small(check_write, cache_dtype, torch.float16, seed=5)


def test_triton_fp8_encoding_equals_pytorchs_rounding(small: Run) -> None:
    small(check_fp8_codec)


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize(("kind", "num_splits"), [("paged", 1), ("paged", 3), ("planned", 2), ("prefill", None)])
def test_triton_attention_reads_a_quantized_cache_as_the_reference(small: Run, cache_dtype: torch.dtype, kind: str,
                                                                    num_splits: int | None) -> None:
    small(check_attention, cache_dtype, torch.float32, seed=6, kind=kind, num_splits=num_splits)


def test_triton_attention_over_a_quantized_cache_in_float16(small: Run) -> None:
    small(check_attention, torch.int8, torch.float16, seed=7, kind="paged", num_splits=2)
    small(check_attention, torch.float8_e4m3fn, torch.float16, seed=7, kind="prefill")


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_quantized_cache_full_size_on_gpu(cache_dtype: torch.dtype, dtype: torch.dtype) -> None:
    cuda = torch.device("cuda")
    check_write(cuda, cache_dtype, dtype, seed=8)
    check_fp8_codec(cuda)
    for kind in ("paged", "planned", "prefill"):
        check_attention(cuda, cache_dtype, dtype, seed=9, kind=kind, num_splits=4 if kind != "prefill" else None)
