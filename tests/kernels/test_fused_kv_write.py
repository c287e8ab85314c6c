"""Triton KV write, fused RMSNorm (+ residual) and rotary against the reference: small cases and 8B shapes."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from kernel_helpers import (
    GARBAGE,
    POISON,
    assert_matches,
    device_gen,
    randn,
    small_case_runner,
    strided_heads,
    triton_ops,
)

from kvfleet_agent.layers.rotary import RotaryEmbedding
from kvfleet_kernels import reference

pytest.importorskip("triton")

CUDA = torch.device("cuda")
GPU_DTYPES = [torch.bfloat16, torch.float16, torch.float32]
Run = Callable[..., None]


@pytest.fixture(scope="module")
def small() -> Run:
    """Runs a check on the small cases: in-process on a GPU, else in Triton's interpreter (a worker process)."""
    return small_case_runner()


def check_write_kv(device: torch.device, dtype: torch.dtype, t: int, kvh: int, d: int, bs: int, num_blocks: int,
                   seed: int, padding: int = 0) -> None:
    g = device_gen(device, seed)
    k_cache = randn((num_blocks, bs, kvh, d), g, dtype, GARBAGE)
    v_cache = randn((num_blocks, bs, kvh, d), g, dtype, GARBAGE)
    k, v = strided_heads(t, kvh, d, g, dtype), strided_heads(t, kvh, d, g, dtype)  # slices of a packed QKV
    slots = torch.randperm(num_blocks * bs, generator=g, device=device)[:t]
    slots[torch.randperm(t, generator=g, device=device)[:padding]] = -1  # padding rows write nothing
    want_k, want_v = k_cache.clone(), v_cache.clone()
    real = slots >= 0
    reference.write_kv(want_k, want_v, k[real], v[real], slots[real])
    triton_ops("kv_write").write_kv(k_cache, v_cache, k, v, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)  # a copy: exact, other slots untouched


def check_rms_norm(device: torch.device, dtype: torch.dtype, shape: tuple[int, ...], eps: float, seed: int,
                   residual: bool) -> None:
    g = device_gen(device, seed)
    hidden = shape[-1]
    x = randn(shape, g, torch.float32, 3.0).add(0.5).to(dtype)
    w = randn((hidden,), g, torch.float32, 0.3).add(1.0).to(dtype)
    ops = triton_ops("fused")
    if residual:
        res = randn(shape, g, dtype, 2.0)
        normed, new_res = ops.add_rms_norm(x, res, w, eps)
        want, want_res = reference.add_rms_norm(x, res, w, eps)
        assert torch.equal(new_res, want_res)  # one rounding of the sum, as torch's
    else:
        normed, want = ops.rms_norm(x, w, eps), reference.rms_norm(x, w, eps)
    assert normed.dtype == want.dtype
    assert_matches(normed.float(), want.float(), dtype)


def check_rotary(device: torch.device, dtype: torch.dtype, t: int, h: int, kvh: int, d: int, seed: int,
                 rope_tables: bool = True) -> None:
    g = device_gen(device, seed)
    if rope_tables:
        rope = RotaryEmbedding(d, 4096, 500000.0, None, dtype).to(device)
        positions = torch.randint(0, 4096, (t,), generator=g, device=device)  # unsorted, repeats allowed
        cos, sin = rope.cos.index_select(0, positions), rope.sin.index_select(0, positions)
    else:  # unrelated halves, so a kernel that reads the wrong half of cos or sin fails
        cos, sin = randn((t, d), g, dtype), randn((t, d), g, dtype)
    qkv = randn((t, (h + 2 * kvh) * d), g, dtype)
    x = qkv[:, :(h + kvh) * d].view(t, h + kvh, d)  # as the model rotates q and k: a strided view
    out = torch.full((t, h + kvh, d), POISON, dtype=dtype, device=device)
    got = triton_ops("fused").rotary(x, cos, sin, out=out)
    assert got is out
    assert_matches(got.float(), reference.rotary(x.float(), cos.float(), sin.float()), dtype)


# ---------------------------------------------------------------------------------------------
# CPU, Triton's interpreter, float32


@pytest.mark.parametrize(("kvh", "d"), [(2, 64), (8, 128), (3, 16)])
@pytest.mark.parametrize("padding", [0, 3])
def test_write_kv_matches_reference(small: Run, kvh: int, d: int, padding: int) -> None:
    small(check_write_kv, torch.float32, 9, kvh, d, 16, 5, seed=kvh + d + padding, padding=padding)


@pytest.mark.parametrize("bs", [1, 4])
def test_write_kv_other_block_sizes(small: Run, bs: int) -> None:
    small(check_write_kv, torch.float32, 7, 2, 64, bs, 9, seed=bs)


@pytest.mark.parametrize("shape", [(9, 64), (5, 200), (2, 3, 96)])  # 200: a hidden size that is no power of two
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_matches_reference(small: Run, shape: tuple[int, ...], residual: bool) -> None:
    small(check_rms_norm, torch.float32, shape, 1e-5, seed=shape[-1], residual=residual)


@pytest.mark.parametrize(("h", "kvh", "d"), [(4, 4, 64), (8, 2, 128), (20, 4, 16)])  # 24 heads: two head tiles
@pytest.mark.parametrize("rope_tables", [True, False])
def test_rotary_matches_reference(small: Run, h: int, kvh: int, d: int, rope_tables: bool) -> None:
    small(check_rotary, torch.float32, 11, h, kvh, d, seed=h + d, rope_tables=rope_tables)


def test_float16(small: Run) -> None:
    """16-bit inputs through every op (the interpreter has no bfloat16: its conversion truncates)."""
    small(check_write_kv, torch.float16, 9, 2, 64, 16, 5, seed=1, padding=3)
    small(check_rms_norm, torch.float16, (5, 200), 1e-5, seed=1, residual=True)
    small(check_rotary, torch.float16, 11, 8, 2, 64, seed=1)


# ---------------------------------------------------------------------------------------------
# GPU, Llama-3-8B shapes: hidden 4096, 32 query heads, 8 KV heads, head size 128


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("t", [64, 8192])  # a decode batch, a prefill chunk
def test_write_kv_full_size(dtype: torch.dtype, t: int) -> None:
    check_write_kv(CUDA, dtype, t, 8, 128, 16, 4096, seed=t, padding=t // 8)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_full_size(dtype: torch.dtype, residual: bool) -> None:
    check_rms_norm(CUDA, dtype, (8192, 4096), 1e-5, seed=1, residual=residual)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_rotary_full_size(dtype: torch.dtype) -> None:
    check_rotary(CUDA, dtype, 8192, 32, 8, 128, seed=2)
