"""Triton fused ops: RMSNorm with an optional residual add in the same pass, and rotate-half rotary embedding."""

import torch
import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]


@triton.jit  # type: ignore[untyped-decorator]
def _rms_norm_kernel(  # type: ignore[no-untyped-def]
        x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_cols, eps, s_x, s_r, s_o, s_ro,
        HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    # One program per row, the whole row in registers: each element is read once and written once.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * s_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * s_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # rounded like torch's residual + x
        tl.store(res_out_ptr + row * s_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, 0) / n_cols + eps)
    # As the reference: normalise in float32, round to x's dtype, then multiply by the weight.
    normed = (xf * inv).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * s_o + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit  # type: ignore[untyped-decorator]
def _rotary_kernel(  # type: ignore[no-untyped-def]
        x_ptr, cos_ptr, sin_ptr, out_ptr, num_heads, s_xt, s_xh, s_ct, s_st, s_ot, s_oh,
        HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    # One program: one token, BLOCK_H of its heads; the first and second halves of each head rotate as pairs.
    t = tl.program_id(0).to(tl.int64)
    hd = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]
    i = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (hd < num_heads) & (i < HALF)
    x_row = x_ptr + t * s_xt + hd * s_xh
    x1 = tl.load(x_row + i, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + HALF + i, mask=mask, other=0.0).to(tl.float32)
    c1 = tl.load(cos_ptr + t * s_ct + i, mask=i < HALF, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + t * s_ct + HALF + i, mask=i < HALF, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + t * s_st + i, mask=i < HALF, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + t * s_st + HALF + i, mask=i < HALF, other=0.0).to(tl.float32)
    out_row = out_ptr + t * s_ot + hd * s_oh
    tl.store(out_row + i, (x1 * c1 - x2 * s1).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_row + HALF + i, (x2 * c2 + x1 * s2).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, hidden] with a contiguous last dimension (a view when the strides allow it)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
          eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, residual + x), or (normed, x) without a residual."""
    hidden = x.shape[-1]
    xr = _rows(x)
    rr = _rows(residual) if residual is not None else xr
    out = torch.empty(xr.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    ro = torch.empty_like(xr) if residual is not None else out
    if xr.shape[0]:
        block = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(xr.shape[0],)](
            xr, rr, weight.contiguous(), out, ro, hidden, eps, xr.stride(0), rr.stride(0), out.stride(0), ro.stride(0),
            HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=min(16, max(1, block // 256)))
    return out.view(x.shape), ro.view(x.shape) if residual is not None else x


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """reference.rms_norm over the last dimension of x [..., hidden]."""
    return _norm(x, None, weight, eps)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """reference.add_rms_norm: (RMSNorm of residual + x, residual + x) in one read of each."""
    if residual.dtype != x.dtype:
        raise ValueError(f"residual dtype {residual.dtype} differs from x's {x.dtype}")
    return _norm(x, residual, weight, eps)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """reference.rotary: x [T, heads, D] (any token and head strides), cos/sin [T, D]; float32 inside."""
    t, heads, d = x.shape
    for y in (x, cos, sin):
        if y.stride(-1) != 1:
            raise ValueError(f"the last dimension must be contiguous (strides {y.stride()})")
    out = torch.empty((t, heads, d), dtype=x.dtype, device=x.device) if out is None else out
    if t == 0:
        return out
    block_h = min(16, triton.next_power_of_2(heads))
    _rotary_kernel[(t, triton.cdiv(heads, block_h))](
        x, cos, sin, out, heads, x.stride(0), x.stride(1), cos.stride(0), sin.stride(0), out.stride(0), out.stride(1),
        HALF=d // 2, BLOCK_HALF=triton.next_power_of_2(d // 2), BLOCK_H=block_h, num_warps=4)
    return out
