"""The CPU paged decode attention kernel (kvfleet_kernels.cpu_attention) against reference.planned_decode_attention."""

# Tolerance: both compute in float32 from the same (dequantized) cache values; the kernel's online softmax,
# polynomial exp and summation order differ from SDPA's only in rounding: REL_TOL[float32] = 1e-5 of the Triton
# kernels' tests (~3e-7 seen).

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from kernel_helpers import REL_TOL, assert_fallback_runs, assert_matches, gen, paged_pool, rel_err, strided_heads

from kvfleet_kernels import cpu_attention, dispatch, kv_quant, reference
from kvfleet_kernels.plan import decode_plan

Opt = torch.Tensor | None
Case = tuple[torch.Tensor, torch.Tensor, torch.Tensor, Opt, Opt, torch.Tensor, torch.Tensor]
QUANTIZED = (torch.int8, torch.float8_e4m3fn)


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    """The kernel, built once (into the user's cache); without a compiler there is nothing to test here."""
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler: decode attention runs the reference (see the fallback test)")
    assert cpu_attention.available(), "a compiler is present but the kernel did not build: see the log"


def case(lengths: list[int], h: int, kvh: int, d: int, dtype: torch.dtype = torch.float32, bs: int = 16,
         seed: int = 0) -> Case:
    """(q, k_cache, v_cache, k_scale, v_scale, tables, seq_lens): garbage in every slot a row does not own,
    blocks permuted, table rows strided, q a strided view; a quantized cache quantizes the garbage too."""
    g = gen(seed)
    k_cache, v_cache, tables = paged_pool(lengths, bs, kvh, d, torch.float32, g)
    k_scale = v_scale = None
    if dtype in QUANTIZED:
        k_cache, k_scale = kv_quant.quantize(k_cache, dtype)
        v_cache, v_scale = kv_quant.quantize(v_cache, dtype)
    q = strided_heads(len(lengths), h, d, g, torch.float32)
    return q, k_cache.to(dtype), v_cache.to(dtype), k_scale, v_scale, tables, torch.tensor(lengths)


def expected(c: Case, scale: float) -> torch.Tensor:
    """The reference on the same values in float32; a row with no context gives zeros (the reference's NaN)."""
    q, k_cache, v_cache, k_scale, v_scale, tables, lens = c
    if k_cache.dtype not in QUANTIZED:
        k_cache, v_cache = k_cache.float(), v_cache.float()
    flat, valid = decode_plan(tables, lens, k_cache.shape[1])
    out = reference.planned_decode_attention(q.float(), k_cache, v_cache, flat, valid, scale, k_scale, v_scale)
    return out.masked_fill((lens == 0)[:, None, None], 0.0)


def planned(c: Case, scale: float, chunk: int = 0, portable: bool = False) -> torch.Tensor:
    q, k_cache, v_cache, k_scale, v_scale, tables, lens = c
    flat, valid = decode_plan(tables, lens, k_cache.shape[1])
    return cpu_attention.decode(q, k_cache, v_cache, flat.view(q.shape[0], -1), valid, scale, k_scale, v_scale,
                                chunk, portable)


LENGTHS = [1, 16, 33, 64, 200, 5, 48]  # ragged: 1, exact block multiples, partial blocks


@pytest.mark.parametrize("portable", [False, True], ids=["avx2-if-present", "portable"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int8], ids=["f32", "int8"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize(("h", "kvh"), [(4, 4), (4, 2), (8, 2)], ids=["g1", "g2", "g4"])
def test_matches_the_reference(h: int, kvh: int, d: int, dtype: torch.dtype, portable: bool) -> None:
    for seed in range(2):
        c = case(LENGTHS, h, kvh, d, dtype, seed=seed)
        ref = expected(c, d ** -0.5)
        assert_matches(planned(c, d ** -0.5, portable=portable), ref, torch.float32)
        q, k_cache, v_cache, k_scale, v_scale, tables, lens = c  # the seq_lens form, from the padded table
        out = cpu_attention.paged_decode_attention(q, k_cache, v_cache, tables, lens, d ** -0.5, None, k_scale,
                                                   v_scale)
        assert_matches(out, ref, torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
@pytest.mark.parametrize("portable", [False, True], ids=["avx2-if-present", "portable"])
def test_bf16_and_fp8_caches(dtype: torch.dtype, portable: bool) -> None:
    c = case(LENGTHS, 8, 2, 64, dtype)
    assert_matches(planned(c, 0.125, portable=portable), expected(c, 0.125), torch.float32)


@pytest.mark.parametrize(("h", "kvh", "d", "bs"), [(6, 2, 64, 16), (12, 2, 64, 8), (16, 1, 64, 32), (3, 1, 80, 16),
                                                   (4, 2, 36, 16), (2, 1, 8, 1)],
                         ids=["g3", "g6-bs8", "g16-bs32", "d80", "d36", "d8-bs1"])
@pytest.mark.parametrize("chunk", [0, 1, 7, 4096], ids=["default", "chunk1", "chunk7", "two-pass"])
def test_odd_groups_head_sizes_blocks_and_chunks(h: int, kvh: int, d: int, bs: int, chunk: int) -> None:
    """Groups that are not a power of 2 or over 8 (several passes), D off the 64-wide loop or off 8 (portable)."""
    c = case([1, 31, 300, 2, 64], h, kvh, d, torch.int8 if h == 12 else torch.float32, bs)
    assert_matches(planned(c, d ** -0.5, chunk=chunk), expected(c, d ** -0.5), torch.float32)


def test_a_long_context() -> None:
    c = case([2048, 1500], 8, 4, 64)
    assert_matches(planned(c, 0.125), expected(c, 0.125), torch.float32)


def test_rows_without_context_give_zeros() -> None:
    c = case([0, 17, 0], 4, 2, 64)
    out = planned(c, 0.125)
    assert torch.equal(out[[0, 2]], torch.zeros(2, 4, 64))
    assert_matches(out[1], expected(c, 0.125)[1], torch.float32)
    q, k_cache, v_cache, _, _, tables, _ = c
    zeros = cpu_attention.decode(q, k_cache, v_cache, tables, torch.zeros(3, dtype=torch.long), 0.125)
    assert torch.equal(zeros, torch.zeros(3, 4, 64))
    empty = cpu_attention.decode(q[:0], k_cache, v_cache, tables[:0], torch.zeros(0, dtype=torch.long), 0.125)
    assert empty.shape == (0, 4, 64)


@pytest.mark.parametrize("lengths", [[700], [5, 700, 90, 1, 300] * 4], ids=["one-row", "twenty-rows"])
def test_results_do_not_depend_on_the_thread_count(lengths: list[int]) -> None:
    """Threads split whole (sequence, KV heads) items, never a head's sums, so every output has the same bits."""
    c = case(lengths, 8, 4, 64, torch.int8)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = planned(c, 0.125)
        torch.set_num_threads(2)
        two = planned(c, 0.125)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_bf16_queries_come_back_in_bf16() -> None:
    q, k_cache, v_cache, _, _, tables, lens = case(LENGTHS, 8, 2, 64, torch.bfloat16)
    q = q.bfloat16()
    flat, valid = decode_plan(tables, lens, 16)
    out = cpu_attention.planned_decode_attention(q, k_cache, v_cache, flat, valid, 0.125)
    assert out.dtype == torch.bfloat16
    assert rel_err(out, reference.planned_decode_attention(q, k_cache, v_cache, flat, valid, 0.125)) < \
        REL_TOL[torch.bfloat16]


def test_paged_max_seq_len_limits_the_context_as_the_reference_does() -> None:
    q, k_cache, v_cache, _, _, tables, lens = case([40, 70], 4, 2, 64)
    out = cpu_attention.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125, 33)
    assert_matches(out, reference.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125, 33),
                   torch.float32)


@pytest.mark.parametrize("bad", ["not-prefix", "block-id", "too-long", "no-scales", "scales", "q-dtype", "heads"])
def test_bad_inputs_are_refused(bad: str) -> None:
    q, k_cache, v_cache, _, _, tables, lens = case([20, 9], 4, 2, 64)
    flat, valid = decode_plan(tables, lens, 16)
    tables, scales = flat.view(2, -1).clone(), None
    if bad == "not-prefix":
        valid[1, 3] = False
    elif bad == "block-id":
        tables[0, 1] = k_cache.shape[0]
    elif bad == "too-long":
        valid = torch.ones(2, 64, dtype=torch.bool)
    elif bad == "no-scales":
        k_cache = v_cache = k_cache.to(torch.int8)
    elif bad == "scales":
        scales = torch.ones(k_cache.shape[:3])
    elif bad == "q-dtype":
        q = q.double()
    else:
        q = q[:, :3]
    with pytest.raises(RuntimeError):
        torch.ops.kvfleet_cpu_attention.decode_attention(q, k_cache, v_cache, tables, valid, 0.125, scales, scales)


def test_the_avx2_loop_runs_where_the_cpu_has_it() -> None:
    has = torch.ops.kvfleet_cpu_attention.has_avx2()
    assert has == (torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"))


def test_dispatch_sends_cpu_decode_to_the_kernel_and_the_rest_to_the_reference(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(dispatch.FORCE_ENV, raising=False)
    q, k_cache, v_cache, k_scale, v_scale, tables, lens = case([20, 9], 4, 2, 64, torch.int8)
    flat, valid = decode_plan(tables, lens, 16)
    kernel = cpu_attention.planned_decode_attention(q, k_cache, v_cache, flat, valid, 0.125, k_scale, v_scale)
    assert torch.equal(dispatch.planned_decode_attention(q, k_cache, v_cache, flat, valid, 0.125, k_scale, v_scale),
                       kernel)
    assert torch.equal(dispatch.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125, None, k_scale,
                                                       v_scale), kernel)
    half = k_cache.to(torch.float16), v_cache.to(torch.float16)  # a cache dtype the kernel does not read
    assert torch.equal(dispatch.planned_decode_attention(q.half(), *half, flat, valid, 0.125),
                       reference.planned_decode_attention(q.half(), *half, flat, valid, 0.125))


FALLBACK = """
import torch
from kvfleet_kernels import cpu_attention, dispatch, reference
from kvfleet_kernels.plan import decode_plan
assert not cpu_attention.available()
g = torch.Generator().manual_seed(0)
k_cache, v_cache = torch.randn(6, 16, 2, 64, generator=g), torch.randn(6, 16, 2, 64, generator=g)
q = torch.randn(2, 4, 64, generator=g)
flat, valid = decode_plan(torch.tensor([[4, 1], [2, 0]]), torch.tensor([20, 9]), 16)
assert torch.equal(dispatch.planned_decode_attention(q, k_cache, v_cache, flat, valid, 0.125),
                   reference.planned_decode_attention(q, k_cache, v_cache, flat, valid, 0.125))
print("fallback ok")
"""


@pytest.mark.parametrize("why", ["no-compiler", "disabled"])
def test_without_the_kernel_decode_runs_the_reference(why: str, tmp_path: Path) -> None:
    assert_fallback_runs(FALLBACK, why, tmp_path, cpu_attention.ENABLE_ENV, cpu_attention.NAME)
