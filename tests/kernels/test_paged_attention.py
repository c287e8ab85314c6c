"""Triton paged attention against the reference: small cases in Triton's interpreter on CPU, 8B shapes on a GPU."""

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

from kvfleet_kernels import plan, reference

pytest.importorskip("triton")

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
SMALL_LENGTHS = [1, 5, 16, 17, 33, 50]  # a length-1 sequence, one exactly a block, the rest ragged
GPU_DTYPES = [torch.bfloat16, torch.float16, torch.float32]
Run = Callable[..., None]


@pytest.fixture(scope="module")
def small() -> Run:
    """Runs a check on the small cases: in-process on a GPU, else in Triton's interpreter (a worker process)."""
    return small_case_runner()


def check_decode(device: torch.device, dtype: torch.dtype, lengths: list[int], h: int, kvh: int, d: int, bs: int,
                 seed: int, *, planned: bool = False, num_splits: int | None = None,
                 block_n: int | None = None) -> None:
    g = device_gen(device, seed)
    k_cache, v_cache, tables = paged_pool(lengths, bs, kvh, d, dtype, g)
    q = strided_heads(len(lengths), h, d, g, dtype)
    seq_lens = torch.tensor(lengths, device=device)
    scale = 0.7 * d ** -0.5
    want = reference.paged_decode_attention(q.float(), k_cache.float(), v_cache.float(), tables, seq_lens, scale)
    out = torch.full(q.shape, POISON, dtype=dtype, device=device)
    ops = triton_ops("paged_attention")
    if planned:
        flat, valid = plan.decode_plan(tables, seq_lens, bs)
        got = ops.planned_decode_attention(q, k_cache, v_cache, flat, valid, scale, out=out, num_splits=num_splits,
                                           block_n=block_n)
    else:
        got = ops.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, scale, out=out,
                                         num_splits=num_splits, block_n=block_n)
    assert got is out and got.dtype == dtype
    assert_matches(got.float(), want, dtype)


def check_prefill(device: torch.device, dtype: torch.dtype, t: int, length: int, h: int, kvh: int, d: int,
                  bs: int, seed: int, *, paged: bool = True) -> None:
    g = device_gen(device, seed)
    scale = d ** -0.5
    q = strided_heads(t, h, d, g, dtype)
    out = torch.full(q.shape, POISON, dtype=dtype, device=device)
    ops = triton_ops("paged_attention")
    if paged:
        # The sequence shares the pool with another; its table is a column of a transposed copy (stride ≠ 1).
        k_cache, v_cache, tables = paged_pool([11, length], bs, kvh, d, dtype, g)
        table = tables.t().contiguous().t()[1]
        want = reference.paged_prefill_attention(q.float(), k_cache.float(), v_cache.float(), table, length, scale)
        got = ops.paged_prefill_attention(q, k_cache, v_cache, table, length, scale, out=out)
    else:
        k, v = strided_heads(length, kvh, d, g, dtype), strided_heads(length, kvh, d, g, dtype)
        want = reference.causal_attention(q.float(), k.float(), v.float(), scale)
        got = ops.causal_attention(q, k, v, scale, out=out)
    assert got is out and got.dtype == dtype
    assert_matches(got.float(), want, dtype)


# ---------------------------------------------------------------------------------------------
# CPU, Triton's interpreter, float32


@pytest.mark.parametrize(("h", "kvh"), [(4, 4), (8, 2)])  # GQA groups 1 and 4
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("num_splits", [1, 3])  # one pass, and the context split with partials combined
def test_decode_matches_reference(small: Run, h: int, kvh: int, d: int, num_splits: int) -> None:
    small(check_decode, torch.float32, SMALL_LENGTHS, h, kvh, d, 16, seed=h + d + num_splits,
                 num_splits=num_splits, block_n=16)


@pytest.mark.parametrize("bs", [1, 4, 16])
def test_decode_with_tiles_spanning_blocks_and_default_splits(small: Run, bs: int) -> None:
    small(check_decode, torch.float32, [3, 50, 1, 29], 8, 2, 64, bs, seed=bs)  # default tiles: 32 keys in fp32


@pytest.mark.parametrize(("h", "kvh"), [(4, 4), (8, 2)])
@pytest.mark.parametrize("num_splits", [1, 2])
def test_planned_decode_matches_reference(small: Run, h: int, kvh: int, num_splits: int) -> None:
    small(check_decode, torch.float32, SMALL_LENGTHS, h, kvh, 64, 16, seed=7 * h + num_splits, planned=True,
                 num_splits=num_splits, block_n=16)


@pytest.mark.parametrize(("h", "kvh", "d"), [(4, 4, 64), (8, 2, 128)])
@pytest.mark.parametrize(("t", "length"), [(1, 1), (1, 18), (5, 37), (16, 16), (20, 23), (13, 50)])
def test_prefill_with_cached_prefix_matches_reference(small: Run, h: int, kvh: int, d: int, t: int,
                                                     length: int) -> None:
    small(check_prefill, torch.float32, t, length, h, kvh, d, 16, seed=h + t + length)


@pytest.mark.parametrize(("h", "kvh", "d"), [(4, 4, 64), (8, 2, 128)])
@pytest.mark.parametrize("t", [1, 7, 20])
def test_dense_causal_matches_reference(small: Run, h: int, kvh: int, d: int, t: int) -> None:
    small(check_prefill, torch.float32, t, t, h, kvh, d, 16, seed=h + t, paged=False)


def check_empty_context_row(device: torch.device) -> None:
    g = device_gen(device, 3)
    k_cache, v_cache, tables = paged_pool([20, 1], 16, 2, 64, torch.float32, g)
    q = randn((2, 8, 64), g, torch.float32)
    ops = triton_ops("paged_attention")
    lens = torch.tensor([20, 0], device=device)
    for splits in (1, 2):
        out = ops.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125, num_splits=splits, block_n=16)
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        want = reference.paged_decode_attention(q[:1], k_cache, v_cache, tables[:1], lens[:1], 0.125)
        assert_matches(out[:1], want, torch.float32)


def test_float16_decode_and_prefill(small: Run) -> None:
    """16-bit operands (P rounded to V's dtype before the second product); the interpreter has no bfloat16."""
    small(check_decode, torch.float16, SMALL_LENGTHS, 8, 2, 64, 16, seed=1, num_splits=2, block_n=16)
    small(check_prefill, torch.float16, 13, 50, 8, 2, 64, 16, seed=1)


def test_decode_of_an_empty_context_row_is_zero_not_nan(small: Run) -> None:
    """A padded row (length 0, as in a CUDA graph batch padded to its captured size) must not poison the rest."""
    small(check_empty_context_row)


def check_empty_batches(device: torch.device) -> None:
    g = device_gen(device, 4)
    k_cache, v_cache, tables = paged_pool([5], 16, 2, 64, torch.float32, g)
    ops, kv, fused = triton_ops("paged_attention"), triton_ops("kv_write"), triton_ops("fused")
    q, none = torch.empty(0, 8, 64, device=device), torch.empty(0, dtype=torch.int64, device=device)
    assert ops.paged_decode_attention(q, k_cache, v_cache, tables[:0], none, 0.1).shape == (0, 8, 64)
    flat, valid = plan.decode_plan(tables[:1], torch.tensor([5], device=device), 16)
    assert ops.planned_decode_attention(q, k_cache, v_cache, flat[:0], valid[:0], 0.1).shape == (0, 8, 64)
    assert ops.paged_prefill_attention(q, k_cache, v_cache, tables[0], 5, 0.1).shape == (0, 8, 64)
    before = k_cache.clone()
    kv.write_kv(k_cache, v_cache, q[:, :2], q[:, :2], none)
    assert torch.equal(k_cache, before)
    assert fused.rotary(q, q[:, 0], q[:, 0]).shape == (0, 8, 64)
    assert fused.rms_norm(q[:, 0], torch.ones(64, device=device), 1e-5).shape == (0, 64)


def test_empty_batches(small: Run) -> None:
    small(check_empty_batches)


def test_split_plan_fills_the_gpu_without_tiny_splits() -> None:
    ops = triton_ops("paged_attention")  # decode_splits is plain Python
    assert ops.decode_splits(64 * 8, 4096, 64, 132) == (1, 4096)  # batch 64 alone fills 132 SMs
    splits, split_len = ops.decode_splits(1 * 8, 4096, 64, 132)  # batch 1: split to fill the GPU
    assert splits == 16 and split_len == 256
    assert ops.decode_splits(8, 100, 64, 132) == (1, 128)  # short contexts stay whole


# ---------------------------------------------------------------------------------------------
# GPU, Llama-3-8B shapes: 32 query heads, 8 KV heads, head size 128, contexts up to 4k


def gpu_lengths(batch: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 4097, (batch,), generator=g).tolist()
    lengths[0], lengths[-1] = 4096, 1
    return lengths


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize(("h", "kvh", "d"), [(32, 8, 128), (32, 32, 128), (32, 8, 64)])
@pytest.mark.parametrize("batch", [1, 64])  # batch 1 takes the split path, 64 the single pass
def test_decode_full_size(dtype: torch.dtype, h: int, kvh: int, d: int, batch: int) -> None:
    lengths = [4096] if batch == 1 else gpu_lengths(batch, batch + h + d)
    check_decode(CUDA, dtype, lengths, h, kvh, d, 16, seed=batch + h)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_planned_decode_full_size(dtype: torch.dtype) -> None:
    check_decode(CUDA, dtype, gpu_lengths(64, 5), 32, 8, 128, 16, seed=5, planned=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize(("t", "length"), [(512, 4096), (1000, 1003), (2048, 2048), (1, 4097)])
def test_prefill_full_size(dtype: torch.dtype, t: int, length: int) -> None:
    check_prefill(CUDA, dtype, t, length, 32, 8, 128, 16, seed=t)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_dense_causal_full_size(dtype: torch.dtype) -> None:
    check_prefill(CUDA, dtype, 2048, 2048, 32, 8, 128, 16, seed=11, paged=False)
