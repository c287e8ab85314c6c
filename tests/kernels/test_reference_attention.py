"""Tests of the reference attention kernels and PagedAttention against dense causal attention written out longhand."""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import HEADS, assert_close_at, gen

from kvfleet_agent.layers.attention import AttentionMetadata, DecodeGroup, PagedAttention, PrefillSpan
from kvfleet_kernels import reference

GARBAGE = 50.0  # scale of whatever sits in cache slots a sequence does not own: huge if ever attended to


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    q_positions: torch.Tensor) -> torch.Tensor:
    """q [T, H, D] at positions q_positions over k/v [L, KVH, D]; query i sees keys 0..q_positions[i]. float64.

    Explicit softmax(QKᵀ·scale + mask)·V, key/value heads repeated for grouped-query attention.
    """
    h, kvh = q.shape[1], k.shape[1]
    group = h // kvh
    qd, kd, vd = q.double(), k.double().repeat_interleave(group, dim=1), v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,lhd->htl", qd, kd) * scale  # [H, T, L]
    visible = torch.arange(k.shape[0])[None, :] <= q_positions[:, None]  # [T, L]
    scores = scores.masked_fill(~visible[None], float("-inf"))
    return torch.einsum("htl,lhd->thd", torch.softmax(scores, dim=-1), vd)


def empty_cache(num_blocks: int, bs: int, kvh: int, d: int, dtype: torch.dtype, g: torch.Generator
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """A K and V pool full of large random garbage (never zeros, so reading a wrong slot shows)."""
    k = (torch.randn(num_blocks, bs, kvh, d, generator=g) * GARBAGE).to(dtype)
    v = (torch.randn(num_blocks, bs, kvh, d, generator=g) * GARBAGE).to(dtype)
    return k, v


def slots_of(block_table: torch.Tensor, positions: torch.Tensor, bs: int) -> torch.Tensor:
    return block_table[positions // bs] * bs + positions % bs


def scatter_sequences(lengths: list[int], bs: int, kvh: int, d: int, dtype: torch.dtype, g: torch.Generator,
                      spare_blocks: int = 3) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor],
                                                       list[torch.Tensor], list[torch.Tensor]]:
    """Random K/V for each sequence, written with write_kv into a random permutation of the pool's blocks.

    Returns the caches, each sequence's block table, and each sequence's dense K and V.
    """
    need = [-(-n // bs) for n in lengths]
    num_blocks = sum(need) + spare_blocks
    k_cache, v_cache = empty_cache(num_blocks, bs, kvh, d, dtype, g)
    perm = torch.randperm(num_blocks, generator=g)
    tables, ks, vs = [], [], []
    start = 0
    for n, nb in zip(lengths, need, strict=True):
        table = perm[start:start + nb].clone()
        start += nb
        k = torch.randn(n, kvh, d, generator=g).to(dtype)
        v = torch.randn(n, kvh, d, generator=g).to(dtype)
        reference.write_kv(k_cache, v_cache, k, v, slots_of(table, torch.arange(n), bs))
        tables.append(table)
        ks.append(k)
        vs.append(v)
    return k_cache, v_cache, tables, ks, vs


def padded_tables(tables: list[torch.Tensor], num_blocks: int, g: torch.Generator) -> torch.Tensor:
    """[B, max_blocks] int64, padded with random (valid) block ids, as the contract allows."""
    width = max(len(t) for t in tables)
    out = torch.randint(0, num_blocks, (len(tables), width), generator=g, dtype=torch.int64)
    for i, t in enumerate(tables):
        out[i, :len(t)] = t
    return out


# ---------------------------------------------------------------------------------------------
# write_kv


@pytest.mark.parametrize("bs", [1, 4, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_writes_exactly_its_slots(bs: int, dtype: torch.dtype) -> None:
    g = gen(bs)
    num_blocks, kvh, d, t = 7, 2, 8, 5
    k_cache, v_cache = empty_cache(num_blocks, bs, kvh, d, dtype, g)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    slots = torch.randperm(num_blocks * bs, generator=g)[:t]
    k = torch.randn(t, kvh, d, generator=g).to(dtype)
    v = torch.randn(t, kvh, d, generator=g).to(dtype)
    reference.write_kv(k_cache, v_cache, k, v, slots)
    expect_k, expect_v = k_before.view(-1, kvh, d).clone(), v_before.view(-1, kvh, d).clone()
    expect_k[slots], expect_v[slots] = k, v
    assert torch.equal(k_cache.view(-1, kvh, d), expect_k)
    assert torch.equal(v_cache.view(-1, kvh, d), expect_v)
    # Each token sits at block slot // bs, offset slot % bs.
    for i, s in enumerate(slots.tolist()):
        assert torch.equal(k_cache[s // bs, s % bs], k[i])
        assert torch.equal(v_cache[s // bs, s % bs], v[i])
    untouched = torch.ones(num_blocks * bs, dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(k_cache.view(-1, kvh, d)[untouched], k_before.view(-1, kvh, d)[untouched])
    assert torch.equal(v_cache.view(-1, kvh, d)[untouched], v_before.view(-1, kvh, d)[untouched])


def test_write_kv_skips_negative_slots_as_the_kernel_does() -> None:
    # Padding rows of a fixed-size batch (and a profiling pass) carry slot -1: nothing of theirs is stored.
    g = gen(3)
    k_cache, v_cache = empty_cache(4, 4, 2, 8, torch.float32, g)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    slots = torch.tensor([5, -1, 11, -1])
    k, v = torch.randn(4, 2, 8, generator=g), torch.randn(4, 2, 8, generator=g)
    reference.write_kv(k_cache, v_cache, k, v, slots)
    expect_k, expect_v = k_before.view(-1, 2, 8).clone(), v_before.view(-1, 2, 8).clone()
    expect_k[[5, 11]], expect_v[[5, 11]] = k[[0, 2]], v[[0, 2]]
    assert torch.equal(k_cache.view(-1, 2, 8), expect_k) and torch.equal(v_cache.view(-1, 2, 8), expect_v)
    reference.write_kv(k_cache, v_cache, k, v, torch.full((4,), -1))  # all padding: nothing at all
    assert torch.equal(k_cache.view(-1, 2, 8), expect_k)


def test_gather_kv_returns_a_sequence_in_token_order() -> None:
    g = gen(0)
    k_cache, v_cache, tables, ks, vs = scatter_sequences([13, 6], 4, 2, 8, torch.float32, g)
    for table, k, v in zip(tables, ks, vs, strict=True):
        assert torch.equal(reference.gather_kv(k_cache, table, len(k)), k)
        assert torch.equal(reference.gather_kv(v_cache, table, len(v)), v)


# ---------------------------------------------------------------------------------------------
# attention


@pytest.mark.parametrize(("h", "kvh"), HEADS)
@pytest.mark.parametrize(("t", "length"), [(1, 1), (7, 7), (1, 9), (5, 23)])
def test_causal_attention_matches_dense(h: int, kvh: int, t: int, length: int) -> None:
    g = gen(100 * h + 10 * t + length)
    d = 16
    q = torch.randn(t, h, d, generator=g)
    k = torch.randn(length, kvh, d, generator=g)
    v = torch.randn(length, kvh, d, generator=g)
    scale = d ** -0.5
    out = reference.causal_attention(q, k, v, scale)
    assert out.shape == (t, h, d)
    want = dense_attention(q, k, v, scale, torch.arange(length - t, length))
    assert_close_at(out.double(), want, torch.float32)
    if t == length:
        # The first query sees only the first key: its output is exactly that value (per head group).
        torch.testing.assert_close(out[0], v[0].repeat_interleave(h // kvh, dim=0), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(("h", "kvh"), HEADS)
@pytest.mark.parametrize("bs", [1, 4, 16])
@pytest.mark.parametrize("explicit_max", [False, True])
def test_paged_decode_attention_matches_dense(h: int, kvh: int, bs: int, explicit_max: bool) -> None:
    g = gen(1000 * h + 10 * bs + kvh)
    d = 16
    lengths = [1, 5, 17, 33, 50]  # mostly not multiples of the block size, different per sequence
    k_cache, v_cache, tables, ks, vs = scatter_sequences(lengths, bs, kvh, d, torch.float32, g)
    block_tables = padded_tables(tables, k_cache.shape[0], g)
    q = torch.randn(len(lengths), h, d, generator=g)
    scale = 0.7 * d ** -0.5
    seq_lens = torch.tensor(lengths, dtype=torch.int64)
    out = reference.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale,
                                           max(lengths) if explicit_max else None)
    assert out.shape == (len(lengths), h, d)
    for i, n in enumerate(lengths):
        want = dense_attention(q[i:i + 1], ks[i], vs[i], scale, torch.tensor([n - 1]))
        assert_close_at(out[i:i + 1].double(), want, torch.float32)


@pytest.mark.parametrize(("h", "kvh"), HEADS)
@pytest.mark.parametrize("bs", [1, 4, 16])
@pytest.mark.parametrize(("t", "length"), [(1, 2), (5, 37), (13, 50), (16, 16), (20, 23)])
def test_paged_prefill_attention_with_cached_prefix_matches_dense(h: int, kvh: int, bs: int, t: int,
                                                                  length: int) -> None:
    g = gen(7 * h + 3 * bs + t + 100 * length)
    d = 16
    # The sequence of interest shares the pool with another one, scattered over a random permutation.
    k_cache, v_cache, tables, ks, vs = scatter_sequences([11, length], bs, kvh, d, torch.float32, g)
    q = torch.randn(t, h, d, generator=g)
    scale = d ** -0.5
    out = reference.paged_prefill_attention(q, k_cache, v_cache, tables[1], length, scale)
    assert out.shape == (t, h, d)
    want = dense_attention(q, ks[1], vs[1], scale, torch.arange(length - t, length))
    assert_close_at(out.double(), want, torch.float32)


@pytest.mark.parametrize(("h", "kvh"), [(4, 4), (8, 2)])
def test_paged_attention_bfloat16(h: int, kvh: int) -> None:
    g = gen(h + kvh)
    bs, d, dtype = 4, 32, torch.bfloat16
    lengths = [3, 18, 29]
    k_cache, v_cache, tables, ks, vs = scatter_sequences(lengths, bs, kvh, d, dtype, g)
    scale = d ** -0.5
    q = torch.randn(len(lengths), h, d, generator=g).to(dtype)
    out = reference.paged_decode_attention(q, k_cache, v_cache, padded_tables(tables, k_cache.shape[0], g),
                                           torch.tensor(lengths), scale)
    assert out.dtype == dtype
    for i, n in enumerate(lengths):
        want = dense_attention(q[i:i + 1], ks[i], vs[i], scale, torch.tensor([n - 1]))
        assert_close_at(out[i:i + 1].double(), want, dtype)
    t = 9
    qp = torch.randn(t, h, d, generator=g).to(dtype)
    out = reference.paged_prefill_attention(qp, k_cache, v_cache, tables[2], lengths[2], scale)
    assert out.dtype == dtype
    want = dense_attention(qp, ks[2], vs[2], scale, torch.arange(lengths[2] - t, lengths[2]))
    assert_close_at(out.double(), want, dtype)


def test_paged_attention_layer_mixed_batch_matches_dense() -> None:
    """One step through PagedAttention: two decodes, a fresh prompt and a chunk after a cached prefix."""
    g = gen(42)
    h, kvh, d, bs = 8, 2, 16, 4
    layer = PagedAttention(h, kvh, d)
    lengths = [9, 22, 6, 17]  # full context of each sequence after this step
    new = [1, 1, 6, 5]  # tokens this step: decode, decode, whole prompt, chunk after 12 cached tokens
    need = [-(-n // bs) for n in lengths]
    num_blocks = sum(need) + 2
    layer.k_cache, layer.v_cache = empty_cache(num_blocks, bs, kvh, d, torch.float32, g)
    perm = torch.randperm(num_blocks, generator=g)
    tables = [perm[sum(need[:i]):sum(need[:i + 1])] for i in range(4)]
    ks = [torch.randn(n, kvh, d, generator=g) for n in lengths]
    vs = [torch.randn(n, kvh, d, generator=g) for n in lengths]
    for table, k, v, n, m in zip(tables, ks, vs, lengths, new, strict=True):  # the context computed earlier
        reference.write_kv(layer.k_cache, layer.v_cache, k[:n - m], v[:n - m], slots_of(table, torch.arange(n - m), bs))
    q = torch.randn(sum(new), h, d, generator=g)
    positions = torch.cat([torch.arange(n - m, n) for n, m in zip(lengths, new, strict=True)])
    seq = torch.cat([torch.full((m,), i) for i, m in enumerate(new)])
    k_new = torch.cat([k[n - m:] for k, n, m in zip(ks, lengths, new, strict=True)])
    v_new = torch.cat([v[n - m:] for v, n, m in zip(vs, lengths, new, strict=True)])
    slot_mapping = torch.cat([slots_of(tables[i], positions[seq == i], bs) for i in range(4)])
    decode_tables, decode_lens = padded_tables(tables[:2], num_blocks, g), torch.tensor(lengths[:2])
    meta = AttentionMetadata(
        slot_mapping=slot_mapping,
        decode_groups=[DecodeGroup(0, 2, decode_tables, decode_lens, max(lengths[:2]), bs)],
        prefills=[PrefillSpan(2, 6, 0, tables[2]), PrefillSpan(8, 5, 12, tables[3])],
    )
    out = layer(q, k_new, v_new, meta)
    for i in range(4):
        rows = seq == i
        want = dense_attention(q[rows], ks[i], vs[i], layer.scale, positions[rows])
        assert_close_at(out[rows].double(), want, torch.float32)
    # The step's K/V landed in the cache.
    for i in range(4):
        torch.testing.assert_close(reference.gather_kv(layer.k_cache, tables[i], lengths[i]), ks[i], atol=0, rtol=0)
        torch.testing.assert_close(reference.gather_kv(layer.v_cache, tables[i], lengths[i]), vs[i], atol=0, rtol=0)
