"""Triton paged attention over the [N, block_size, KVH, D] cache: decode (split along the context) and prefill."""

import functools
import math

import torch
import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]

from kvfleet_kernels.kv_codec import decode as decode_codes
from kvfleet_kernels.kv_write import as_codes, kv_quant_mode

LOG2E = 1.4426950408889634  # softmax in base 2: exp2 is one instruction, exp is two
MIN_SPLIT_LEN = 256  # context tokens below which splitting costs more (partials, a second launch) than it gains
MASK_CHUNK = 1024  # decode plan's valid mask is summed in chunks of this many slots


@triton.jit  # type: ignore[untyped-decorator]
def _dequant_tile(k, v, ks_ptr, vs_ptr, s_off, n_ok, dtype: tl.constexpr,  # type: ignore[no-untyped-def]
                  KV_QUANT: tl.constexpr):
    # A quantized tile's codes become the query's dtype unscaled (int8 and E4M3 values are exact in fp16/bf16),
    # so the dots stay 16-bit; the per-key scales are applied to the scores and the probabilities instead
    # (s · k_scale, (p · v_scale) · V): one multiply per key rather than per element.
    if KV_QUANT:  # a constexpr branch: only one side is compiled, so k and v may change type
        ks = tl.load(ks_ptr + s_off, mask=n_ok, other=0.0)
        vs = tl.load(vs_ptr + s_off, mask=n_ok, other=0.0)
        k = decode_codes(k, KV_QUANT, dtype)
        v = decode_codes(v, KV_QUANT, dtype)
    else:  # unused: _keys and _probs leave a float cache's tiles as they were
        ks = n_ok
        vs = n_ok
    return k, v, ks, vs


@triton.jit  # type: ignore[untyped-decorator]
def _keys(s, ks, scale_log2e, KV_QUANT: tl.constexpr):  # type: ignore[no-untyped-def]
    # Scores q·kᵀ in base 2: times each key's scale too when the cache is quantized.
    if KV_QUANT:  # noqa: SIM108 (a constexpr branch, as the kernels spell them)
        s = s * (ks[None, :] * scale_log2e)
    else:
        s = s * scale_log2e
    return s


@triton.jit  # type: ignore[untyped-decorator]
def _probs(p, vs, KV_QUANT: tl.constexpr):  # type: ignore[no-untyped-def]
    # Probabilities times each value row's scale when the cache is quantized, before the product with V.
    if KV_QUANT:
        p = p * vs[None, :]
    return p


@triton.jit  # type: ignore[untyped-decorator]
def _decode_kernel(  # type: ignore[no-untyped-def]
        q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, tables_ptr, lens_ptr, valid_ptr, out_ptr, part_ml_ptr, part_acc_ptr,
        scale_log2e, split_len, padded_len,
        s_qb, s_qh, s_kn, s_ks, s_kh, s_vn, s_vs, s_vh, s_sn, s_ss, s_sh, s_tb, s_validb, s_ob, s_oh,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, USE_VALID: tl.constexpr, SPLIT: tl.constexpr,
        PRECISION: tl.constexpr, CHUNK: tl.constexpr, KV_QUANT: tl.constexpr):
    # One program: one sequence, one KV head with all its GROUP query heads (each K/V tile is read once
    # for the whole group), one slice of the context. Rows of the [BLOCK_G, D] query tile past GROUP are padding.
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    if USE_VALID:  # the decode plan's mask is a prefix of valid slots: its sum is the length
        seq_len = 0
        for i in range(0, padded_len, CHUNK):
            idx = i + tl.arange(0, CHUNK)
            seq_len += tl.sum(tl.load(valid_ptr + b * s_validb + idx, mask=idx < padded_len, other=0).to(tl.int32))
    else:
        seq_len = tl.load(lens_ptr + b).to(tl.int32)
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_ok = g < GROUP
    d_ok = d < HEAD_DIM
    heads = kvh * GROUP + g
    q = tl.load(q_ptr + b * s_qb + heads[:, None] * s_qh + d[None, :], mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < end
        block = tl.load(tables_ptr + b * s_tb + n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        slot = n % BLOCK_SIZE
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + (block * s_kn + slot * s_ks + kvh * s_kh)[:, None] + d[None, :], mask=kv_mask, other=0)
        v = tl.load(v_ptr + (block * s_vn + slot * s_vs + kvh * s_vh)[:, None] + d[None, :], mask=kv_mask, other=0)
        k, v, ks, vs = _dequant_tile(k, v, ks_ptr, vs_ptr, block * s_sn + slot * s_ss + kvh * s_sh, n_ok, q.dtype,
                                     KV_QUANT)
        s = _keys(tl.dot(q, tl.trans(k), input_precision=PRECISION), ks, scale_log2e, KV_QUANT)
        s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every tile holds at least one valid slot
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(_probs(p, vs, KV_QUANT).to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    if SPLIT:  # partial results (max and sum in base 2, unnormalised output), combined by _combine_kernel
        row = (b * tl.num_programs(1) * GROUP + heads) * tl.num_programs(2) + split
        tl.store(part_ml_ptr + row * 2, m_i, mask=g_ok)
        tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=g_ok)
        tl.store(part_acc_ptr + row[:, None] * HEAD_DIM + d[None, :], acc, mask=g_ok[:, None] & d_ok[None, :])
    else:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # length 0 (a padded graph row): zeros, not NaN
        tl.store(out_ptr + b * s_ob + heads[:, None] * s_oh + d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=g_ok[:, None] & d_ok[None, :])


@triton.jit  # type: ignore[untyped-decorator]
def _combine_kernel(  # type: ignore[no-untyped-def]
        part_ml_ptr, part_acc_ptr, out_ptr, num_splits, s_ob, s_oh,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    # One program per (sequence, query head): rescale each split's partial to the global max and sum.
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_ok = s < num_splits
    row = (b * tl.num_programs(1) + h) * num_splits + s
    m = tl.load(part_ml_ptr + row * 2, mask=s_ok, other=float("-inf"))
    l_s = tl.load(part_ml_ptr + row * 2 + 1, mask=s_ok, other=0.0)
    acc = tl.load(part_acc_ptr + row[:, None] * HEAD_DIM + d[None, :], mask=s_ok[:, None] & (d < HEAD_DIM)[None, :],
                  other=0.0)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # every split empty (length 0): weights 0, output 0
    w = tl.exp2(m - m_max)
    total = tl.sum(w * l_s, 0)
    out = tl.sum(w[:, None] * acc, 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + b * s_ob + h * s_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


@triton.jit  # type: ignore[untyped-decorator]
def _prefill_kernel(  # type: ignore[no-untyped-def]
        q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, table_ptr, out_ptr, scale_log2e, q_len, seq_len,
        s_qt, s_qh, s_kn, s_ks, s_kh, s_vn, s_vs, s_vh, s_sn, s_ss, s_sh, s_t, s_ot, s_oh,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        PAGED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
        KV_QUANT: tl.constexpr):
    # One program: BLOCK_M consecutive queries of one head. Query i sits at position seq_len - q_len + i and
    # sees keys 0..that position: through the block table (PAGED) or in a dense [L, KVH, D] tensor.
    mb = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // GROUP
    m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    pos = seq_len - q_len + m
    q = tl.load(q_ptr + m[:, None] * s_qt + h * s_qh + d[None, :], mask=(m < q_len)[:, None] & d_ok[None, :],
                other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    hi = tl.minimum(seq_len, seq_len - q_len + (mb + 1) * BLOCK_M)  # keys past the tile's last query are unseen
    for n0 in range(0, hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < seq_len
        if PAGED:
            block = tl.load(table_ptr + (n // BLOCK_SIZE) * s_t, mask=n_ok, other=0).to(tl.int64)
            k_off = block * s_kn + (n % BLOCK_SIZE) * s_ks
            v_off = block * s_vn + (n % BLOCK_SIZE) * s_vs
            s_off = block * s_sn + (n % BLOCK_SIZE) * s_ss
        else:
            k_off = n.to(tl.int64) * s_kn
            v_off = n.to(tl.int64) * s_vn
            s_off = k_off  # unused: a dense K/V is never quantized
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + (k_off + kvh * s_kh)[:, None] + d[None, :], mask=kv_mask, other=0)
        v = tl.load(v_ptr + (v_off + kvh * s_vh)[:, None] + d[None, :], mask=kv_mask, other=0)
        k, v, ks, vs = _dequant_tile(k, v, ks_ptr, vs_ptr, s_off + kvh * s_sh, n_ok, q.dtype, KV_QUANT)
        s = _keys(tl.dot(q, tl.trans(k), input_precision=PRECISION), ks, scale_log2e, KV_QUANT)
        s = tl.where((n[None, :] <= pos[:, None]) & n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: key 0 is visible to every row, so the first tile sets it
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(_probs(p, vs, KV_QUANT).to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(out_ptr + m[:, None] * s_ot + h * s_oh + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=(m < q_len)[:, None] & d_ok[None, :])


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # tf32 only names the default; 16-bit dots ignore it


# Keys per tile and warps per program, by whether the cache is 16-bit. A gathered tile holds a 64-bit
# address per element: these sizes are the largest without register spills on sm_90 (ptxas, Triton 3.9;
# test_triton_compile.py keeps them so).
DECODE_WARPS = PREFILL_WARPS = 8


def _block_n(dtype: torch.dtype, quantized: bool = False, prefill: bool = False) -> int:
    # A quantized tile's decode to the compute dtype needs registers of its own: smaller tiles (measured as above).
    if dtype == torch.float32:
        return 16 if quantized else 32
    return 32 if quantized and prefill else 64


def _prefill_block_m(dtype: torch.dtype, quantized: bool, t: int) -> int:
    """Queries per prefill tile: up to 64, 16 for float32 queries over a quantized cache (no spills at 32)."""
    return min(16 if quantized and dtype == torch.float32 else 64, max(16, int(triton.next_power_of_2(t))))


def _last_dim_contiguous(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.stride(-1) != 1:
            raise ValueError(f"the head dimension must be contiguous (strides {t.stride()})")


@functools.cache  # looked up on every call, once per layer and step
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: small, so that tests split short contexts too
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def decode_splits(programs: int, max_len: int, block_n: int, sm_count: int) -> tuple[int, int]:
    """(number of splits, tokens per split): about two programs per multiprocessor, no split under MIN_SPLIT_LEN."""
    want = max(1, math.ceil(2 * sm_count / max(programs, 1)))
    splits = max(1, min(want, max_len // MIN_SPLIT_LEN))
    split_len = triton.cdiv(triton.cdiv(max_len, splits), block_n) * block_n
    return triton.cdiv(max_len, split_len), split_len


def _scales(k_cache: torch.Tensor, k_scale: torch.Tensor | None,
            v_scale: torch.Tensor | None) -> tuple[int, torch.Tensor, torch.Tensor, tuple[int, ...]]:
    """(KV_QUANT, the scale tensors, their strides) for a cache; a float cache passes itself as unused pointers."""
    mode = kv_quant_mode(k_cache)
    if not mode:
        return 0, k_cache, k_cache, (0, 0, 0)
    if k_scale is None or v_scale is None:
        raise ValueError(f"a {k_cache.dtype} KV cache needs its k_scale and v_scale tensors")
    return mode, k_scale, v_scale, tuple(k_scale.stride()[:3])


def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
            lens: torch.Tensor | None, valid: torch.Tensor | None, max_len: int, scale: float,
            out: torch.Tensor | None, num_splits: int | None, block_n: int | None,
            k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    b, h, d = q.shape
    mode, ks, vs, s_strides = _scales(k_cache, k_scale, v_scale)
    kvh, bs = k_cache.shape[2], k_cache.shape[1]
    _last_dim_contiguous(q, k_cache, v_cache)
    out = torch.empty_like(q) if out is None else out
    if b == 0:
        return out
    block_n = block_n or _block_n(q.dtype, mode > 0)
    splits, split_len = decode_splits(b * kvh, max(max_len, 1), block_n, _sm_count(q.device))
    if num_splits is not None:  # tests and tuning
        split_len = triton.cdiv(triton.cdiv(max(max_len, 1), num_splits), block_n) * block_n
        splits = triton.cdiv(max(max_len, 1), split_len)
    group = h // kvh
    block_d = triton.next_power_of_2(d)
    parts = (torch.empty(b * h * splits * 2, dtype=torch.float32, device=q.device),
             torch.empty(b * h * splits * d, dtype=torch.float32, device=q.device)) if splits > 1 else (out, out)
    lens_arg = lens if lens is not None else tables  # unused pointer when the valid mask gives the lengths
    valid_arg = valid.view(torch.uint8) if valid is not None else tables
    _decode_kernel[(b, kvh, splits)](
        q, as_codes(k_cache), as_codes(v_cache), ks, vs, tables, lens_arg, valid_arg, out, parts[0], parts[1],
        scale * LOG2E, split_len, valid.shape[1] if valid is not None else 0,
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3], *s_strides, tables.stride(0),
        valid.stride(0) if valid is not None else 0, out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_SIZE=bs,
        BLOCK_N=block_n, USE_VALID=valid is not None, SPLIT=splits > 1, PRECISION=_precision(q.dtype), CHUNK=MASK_CHUNK,
        KV_QUANT=mode, num_warps=DECODE_WARPS)
    if splits > 1:
        _combine_kernel[(b, h)](parts[0], parts[1], out, splits, out.stride(0), out.stride(1),
                                HEAD_DIM=d, BLOCK_D=block_d, BLOCK_S=triton.next_power_of_2(splits), num_warps=4)
    return out


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           max_seq_len: int | None = None, k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None, *, out: torch.Tensor | None = None,
                           num_splits: int | None = None, block_n: int | None = None) -> torch.Tensor:
    """reference.paged_decode_attention. Without max_seq_len the table width bounds the context (no host sync)."""
    max_len = max_seq_len if max_seq_len is not None else block_tables.shape[1] * k_cache.shape[1]
    return _decode(q, k_cache, v_cache, block_tables, seq_lens, None, max_len, scale, out, num_splits, block_n,
                   k_scale, v_scale)


def planned_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             flat_block_index: torch.Tensor, valid: torch.Tensor, scale: float,
                             k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None, *,
                             out: torch.Tensor | None = None, num_splits: int | None = None,
                             block_n: int | None = None) -> torch.Tensor:
    """reference.planned_decode_attention: the plan's flat index is the block tables, its mask the lengths."""
    tables = flat_block_index.view(q.shape[0], -1) if q.shape[0] else flat_block_index.view(0, 0)
    return _decode(q, k_cache, v_cache, tables, None, valid, valid.shape[1], scale, out, num_splits, block_n,
                   k_scale, v_scale)


def _prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor | None, seq_len: int,
             scale: float, out: torch.Tensor | None, block_m: int | None, block_n: int | None,
             k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    t, h, d = q.shape
    mode, ks, vs, s_strides = _scales(k, k_scale, v_scale)
    _last_dim_contiguous(q, k, v)
    out = torch.empty_like(q) if out is None else out
    if t == 0:
        return out
    paged = table is not None
    kvh = k.shape[2] if paged else k.shape[1]
    block_m = block_m or _prefill_block_m(q.dtype, mode > 0, t)
    block_n = block_n or _block_n(q.dtype, mode > 0, prefill=True)
    # Paged: strides of [N, bs, KVH, D]; dense: [L, KVH, D] read as blocks of one token.
    k_strides = k.stride()[:3] if paged else (k.stride(0), 0, k.stride(1))
    v_strides = v.stride()[:3] if paged else (v.stride(0), 0, v.stride(1))
    _prefill_kernel[(triton.cdiv(t, block_m), h)](
        q, as_codes(k), as_codes(v), ks, vs, table if paged else k, out, scale * LOG2E, t, seq_len,
        q.stride(0), q.stride(1), *k_strides, *v_strides, *s_strides, table.stride(0) if table is not None else 0,
        out.stride(0), out.stride(1),
        GROUP=h // kvh, HEAD_DIM=d, BLOCK_D=triton.next_power_of_2(d), BLOCK_SIZE=k.shape[1] if paged else 1,
        PAGED=paged, BLOCK_M=block_m, BLOCK_N=block_n, PRECISION=_precision(q.dtype), KV_QUANT=mode,
        num_warps=PREFILL_WARPS)
    return out


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                            seq_len: int, scale: float, k_scale: torch.Tensor | None = None,
                            v_scale: torch.Tensor | None = None, *, out: torch.Tensor | None = None,
                            block_m: int | None = None, block_n: int | None = None) -> torch.Tensor:
    """reference.paged_prefill_attention: the chunk's last-T queries over the sequence's paged context."""
    return _prefill(q, k_cache, v_cache, block_table, seq_len, scale, out, block_m, block_n, k_scale, v_scale)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, *,
                     out: torch.Tensor | None = None, block_m: int | None = None,
                     block_n: int | None = None) -> torch.Tensor:
    """reference.causal_attention: queries [T, H, D], the last T of dense keys/values [L, KVH, D]."""
    return _prefill(q, k, v, None, k.shape[0], scale, out, block_m, block_n)
