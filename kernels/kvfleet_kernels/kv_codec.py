"""Triton helpers for the quantized KV cache: a row's codes and scale on write, values back on read (kv_quant.py).

FP8 E4M3 is encoded and decoded with integer operations rather than Triton's float8 casts: those need sm_89+,
and Triton's interpreter rounds fp32 → fp8 wrongly (-31.1 became -16 in 3.x). Spelled out, the bytes equal
PyTorch's round-to-nearest-even conversion on every backend, and an fp8 cache also serves older GPUs.
"""

import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]

INT8 = tl.constexpr(1)  # the KV_QUANT values the kernels take: 0 is a float cache
FP8 = tl.constexpr(2)


@triton.jit
def _fp8_e4m3_bits(y):  # type: ignore[no-untyped-def]
    # y fp32 within ±448 → the E4M3FN byte (as int32), rounding to nearest even like torch's .to(float8_e4m3fn).
    a = tl.abs(y)
    bits = a.to(tl.int32, bitcast=True)
    rounded = bits + 0x7FFFF + ((bits >> 20) & 1)  # 23 mantissa bits to 3, ties to even (a carry bumps the exponent)
    normal = (((rounded >> 23) - 120) << 3) | ((rounded >> 20) & 7)  # exponent rebias 127 → 7
    sub = a * 512.0  # below 2^-6 the format steps by 2^-9: the code is that multiple, rounded half to even
    r = tl.floor(sub + 0.5)
    r = tl.where((r - sub == 0.5) & (r % 2 == 1), r - 1.0, r)
    code = tl.where(a >= 0.015625, normal, r.to(tl.int32))
    return code | tl.where(y < 0, 128, 0)


@triton.jit  # type: ignore[untyped-decorator]
def quantize_rows(x, QMAX: tl.constexpr, KV_QUANT: tl.constexpr, MIN_AMAX: tl.constexpr):  # type: ignore[no-untyped-def]
    """x [R, D] fp32 (masked entries 0) → (codes [R, D] int32 or fp32 for the cache's store, scales [R])."""
    amax = tl.maximum(tl.max(tl.abs(x), 1), MIN_AMAX)
    inv = QMAX / amax
    y = tl.minimum(tl.maximum(x * inv[:, None], -QMAX), QMAX)
    if KV_QUANT == FP8:  # noqa: SIM108 (a constexpr branch, as the kernels spell them)
        codes = _fp8_e4m3_bits(y)
    else:
        codes = tl.where(y >= 0, tl.floor(y + 0.5), tl.ceil(y - 0.5))  # half away from zero, as kv_quant
    return codes, amax / QMAX


@triton.jit  # type: ignore[untyped-decorator]
def decode(codes, KV_QUANT: tl.constexpr, dtype: tl.constexpr):  # type: ignore[no-untyped-def]
    """Cache entries loaded as int8 (KV_QUANT INT8) or uint8 E4M3 bytes (FP8) → their unscaled values in dtype
    (exact in fp16, bf16 and fp32: at most 4 significant bits, exponents within fp16's range)."""
    if KV_QUANT == FP8:
        b = codes.to(tl.int32)
        exp = (b >> 3) & 15
        mant = b & 7
        normal = ((exp + 120) << 23) | (mant << 20)  # rebias 7 → 127, 3 mantissa bits to the top of 23
        mag = tl.where(exp == 0, mant.to(tl.float32) * 0.001953125, normal.to(tl.float32, bitcast=True))
        out = tl.where(b >= 128, -mag, mag).to(dtype)
    else:
        out = codes.to(dtype)
    return out
