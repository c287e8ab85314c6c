"""Checkpoint formats: one linear's GPTQ, AWQ, compressed-tensors or FP8 tensors read into a QuantWeight."""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from kvfleet_agent.layers.quant.spec import QuantSpec
from kvfleet_agent.layers.quant.weight import FP8, QuantWeight

# AWQ GEMM packs output columns 0..7 of each int32 into nibbles in the order 0, 2, 4, 6, 1, 3, 5, 7:
# column k of a word sits in nibble AWQ_REVERSE[k].
AWQ_REVERSE = (0, 4, 1, 5, 2, 6, 3, 7)
_PLAIN = ("weight", "weight_scale", "weight_zero_point", "weight_g_idx", "input_scale", "input_zero_point")


def quant_suffixes(spec: QuantSpec) -> tuple[str, ...]:
    """The tensor-name suffixes a quantized linear has in the spec's format (none for on-load quantization)."""
    if spec.method == "gptq":
        return ("qweight", "qzeros", "scales", "g_idx")
    if spec.method == "awq":
        return ("qweight", "qzeros", "scales")
    if spec.method == "compressed-tensors":
        if spec.format == "pack-quantized":
            return ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx",
                    "input_scale", "input_zero_point")
        return _PLAIN
    if spec.method == "fp8":
        return ("weight", "weight_scale", "weight_scale_inv", "input_scale")
    return ()


def split_name(name: str, spec: QuantSpec) -> tuple[str, str] | None:
    """(module prefix, suffix) when `name` ends in one of the format's suffixes, else None.

    Where the format keeps a plain `.weight` (FP8, compressed-tensors int-/float-quantized) every `.weight` is a
    candidate, norms and embeddings included: gather the prefix's tensors and ask `is_quantized`.
    """
    prefix, dot, suffix = name.rpartition(".")
    if dot and prefix and suffix in quant_suffixes(spec):
        return prefix, suffix
    return None


def is_quantized(spec: QuantSpec, tensors: Mapping[str, torch.Tensor]) -> bool:
    """Whether one prefix's tensors (keyed by suffix) hold a quantized linear rather than a plain weight."""
    if spec.method in ("gptq", "awq"):
        return "qweight" in tensors
    if spec.method == "compressed-tensors" and spec.format == "pack-quantized":
        return "weight_packed" in tensors
    if spec.method in ("compressed-tensors", "fp8"):
        return "weight" in tensors and ("weight_scale" in tensors or "weight_scale_inv" in tensors)
    return False


def is_ignored(prefix: str, spec: QuantSpec) -> bool:
    """Whether the module `prefix` is on the spec's ignore list (exact names, or "re:" regexes from the start)."""
    for pattern in spec.ignore:
        if pattern.startswith("re:"):
            if re.match(pattern[3:], prefix):
                return True
        elif pattern == prefix:
            return True
    return False


def read_quantized(spec: QuantSpec, tensors: Mapping[str, torch.Tensor], name: str = "") -> QuantWeight:
    """One linear's checkpoint tensors (all of them, keyed by suffix) as the full QuantWeight [out, in].

    `name`, the module's prefix, only makes error messages name the tensor in full.
    """
    name = f"{name}." if name else ""  # from here on, what goes before a suffix in messages
    if spec.method == "gptq":
        return _gptq(spec, tensors, name)
    if spec.method == "awq":
        return _awq(spec, tensors, name)
    if spec.method == "compressed-tensors" and spec.format == "pack-quantized":
        return _ct_packed(spec, tensors, name)
    if spec.method == "compressed-tensors" and not spec.fp8:
        return _ct_int(spec, tensors, name)
    if spec.method in ("compressed-tensors", "fp8"):
        return _fp8(spec, tensors, name)
    raise ValueError(f"{spec.method} quantizes on load: there are no quantized tensors to read")


def _need(tensors: Mapping[str, torch.Tensor], suffix: str, spec: QuantSpec, name: str) -> torch.Tensor:
    """A tensor the format requires, or an error naming it."""
    t = tensors.get(suffix)
    if t is None:
        raise ValueError(f"the {spec.method} checkpoint has no {name}{suffix} (found "
                         f"{', '.join(sorted(tensors)) or 'nothing'})")
    return t


def _unpack(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Integers packed along dim 1, 32 // bits per int32, lowest bits first → int32 [rows, count], unsigned."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    # >> on int32 sign-extends; the mask keeps only each field's own bits
    vals = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return vals.reshape(packed.shape[0], -1)[:, :count]


def _check(t: torch.Tensor, shape: tuple[int, ...], what: str, name: str) -> None:
    """A tensor's shape as the layout requires, or an error naming both."""
    if tuple(t.shape) != shape:
        raise ValueError(f"{name}{what} has shape {tuple(t.shape)}, the layout needs {shape}")


def _groups(spec: QuantSpec, cols: int) -> tuple[int, int]:
    """(group size, group count) for `cols` inputs: a group of -1 (or wider than cols) is one per output channel."""
    g = spec.group_size if 0 < spec.group_size < cols else cols
    return g, -(-cols // g)


def _act_order(g_idx: torch.Tensor | None, cols: int, group: int, groups: int, name: str) -> torch.Tensor | None:
    """The g_idx to keep: None where it is absent or just i // group (fast kernels need plain groups)."""
    if g_idx is None:
        return None
    g = g_idx.to(torch.int64).reshape(-1)
    if g.numel() != cols or (cols and (int(g.min()) < 0 or int(g.max()) >= groups)):
        raise ValueError(f"{name} must give each of the {cols} columns a group in 0..{groups - 1}")
    if torch.equal(g, torch.arange(cols, device=g.device) // group):
        return None
    return g


def _int_weight(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, group: int,
                g_idx: torch.Tensor | None) -> QuantWeight:
    """QuantWeight from unsigned integers q (0..2^bits-1) and zero points in the same units."""
    zero = zero.to(torch.float32)
    if bits == 8:  # unsigned 0..255 to QuantWeight's signed int8: shift q and zero alike, (q - zero) is unchanged
        q, zero = q - 128, zero - 128
    z: torch.Tensor | None = zero
    if bits == 8 and not bool(zero.any()):
        z = None  # symmetric: the int8 kernels skip the zero-point term
    return QuantWeight(q=q.to(torch.int8).contiguous(), scale=scale.to(torch.float32).contiguous(),
                       zero=None if z is None else z.contiguous(), bits=bits, group_size=group, g_idx=g_idx)


def _gptq(spec: QuantSpec, t: Mapping[str, torch.Tensor], name: str) -> QuantWeight:
    """GPTQ: qweight [in/pack, out] packed along the inputs; qzeros [groups, out/pack]; scales [groups, out]."""
    bits, pack = spec.bits, 32 // spec.bits
    qweight, scales = _need(t, "qweight", spec, name), _need(t, "scales", spec, name)
    cols, out = int(qweight.shape[0]) * pack, int(qweight.shape[1])
    group, groups = _groups(spec, cols)
    _check(scales, (groups, out), "scales", name)
    q = _unpack(qweight.t(), bits, cols)  # [out, in]
    if "qzeros" in t:
        _check(t["qzeros"], (groups, -(-out // pack)), "qzeros", name)
        zero = _unpack(t["qzeros"], bits, out).t()
        # v1 (AutoGPTQ) stored zero - 1; like the reference kernels, add it back without wrapping
        if spec.format != "gptq_v2":
            zero = zero + 1
    elif spec.symmetric:
        zero = torch.full((out, groups), 1 << (bits - 1), dtype=torch.int32, device=qweight.device)
    else:
        raise ValueError(f"the asymmetric gptq checkpoint has no {name}qzeros")
    g_idx = _act_order(t.get("g_idx"), cols, group, groups, f"{name}g_idx")
    if spec.act_order and "g_idx" not in t:
        raise ValueError(f"desc_act is set but the checkpoint has no {name}g_idx")
    return _int_weight(q, scales.t(), zero, bits, group, g_idx)


def _awq(spec: QuantSpec, t: Mapping[str, torch.Tensor], name: str) -> QuantWeight:
    """AWQ GEMM: qweight [in, out/8] and qzeros [groups, out/8] packed along the outputs in AWQ's order."""
    qweight, qzeros, scales = (_need(t, s, spec, name) for s in ("qweight", "qzeros", "scales"))
    cols, out = int(qweight.shape[0]), int(qweight.shape[1]) * 8
    group, groups = _groups(spec, cols)
    _check(scales, (groups, out), "scales", name)
    _check(qzeros, (groups, out // 8), "qzeros", name)
    order = torch.tensor(AWQ_REVERSE, device=qweight.device)

    def unpack(p: torch.Tensor) -> torch.Tensor:
        rows = int(p.shape[0])
        return _unpack(p, 4, out).reshape(rows, out // 8, 8)[..., order].reshape(rows, out).t()

    return _int_weight(unpack(qweight), scales.t(), unpack(qzeros), 4, group, None)


def _ct_zero(spec: QuantSpec, t: Mapping[str, torch.Tensor], scale: torch.Tensor, out: int,
             name: str) -> torch.Tensor:
    """compressed-tensors zero points, unsigned: packed int32 along the outputs, or plain signed [out, groups]."""
    offset = 1 << (spec.bits - 1)
    if spec.symmetric:
        return torch.full(tuple(scale.shape), offset, dtype=torch.int32, device=scale.device)
    zp = _need(t, "weight_zero_point", spec, name)
    words = -(-out * spec.bits // 32)
    if zp.dtype == torch.int32 and zp.dim() == 2 and zp.shape[0] == words and words != out:
        return _unpack(zp.t(), spec.bits, out).t()  # stored with the offset already added
    if zp.numel() == 1:
        zp = zp.reshape(1, 1).expand(tuple(scale.shape))
    _check(zp, tuple(scale.shape), "weight_zero_point", name)
    return zp.to(torch.int32) + offset


def _ct_scale(spec: QuantSpec, t: Mapping[str, torch.Tensor], out: int, cols: int,
              name: str) -> tuple[torch.Tensor, int]:
    """weight_scale as [out, groups] with its group size: per tensor, per channel or per group."""
    s = _need(t, "weight_scale", spec, name).to(torch.float32)
    if s.numel() == 1:  # per tensor: every row repeats the one scale
        return s.reshape(1, 1).expand(out, 1).contiguous(), cols
    if s.dim() == 1 and s.numel() == out:
        return s.reshape(out, 1), cols
    group, groups = _groups(spec, cols) if spec.weight_strategy == "group" else (cols, 1)
    _check(s, (out, groups), "weight_scale", name)
    return s, group


def _ct_packed(spec: QuantSpec, t: Mapping[str, torch.Tensor], name: str) -> QuantWeight:
    """pack-quantized: weight_packed [out, in·bits/32] along the inputs, each value stored plus 2^(bits-1)."""
    packed = _need(t, "weight_packed", spec, name)
    out = int(packed.shape[0])
    shape = t.get("weight_shape")
    cols = int(shape.reshape(-1)[1]) if shape is not None else int(packed.shape[1]) * 32 // spec.bits
    _check(packed, (out, -(-cols * spec.bits // 32)), "weight_packed", name)
    scale, group = _ct_scale(spec, t, out, cols, name)
    zero = _ct_zero(spec, t, scale, out, name)
    g_idx = _act_order(t.get("weight_g_idx"), cols, group, int(scale.shape[1]), f"{name}weight_g_idx")
    return _int_weight(_unpack(packed, spec.bits, cols), scale, zero, spec.bits, group, g_idx)


def _ct_int(spec: QuantSpec, t: Mapping[str, torch.Tensor], name: str) -> QuantWeight:
    """int-quantized / naive-quantized: signed integers one per int8 element in `weight` [out, in]."""
    w = _need(t, "weight", spec, name)
    if w.dtype != torch.int8:
        raise ValueError(f"{name}weight is {w.dtype}; {spec.format} integer weights are int8")
    out, cols = (int(n) for n in w.shape)
    scale, group = _ct_scale(spec, t, out, cols, name)
    zero = _ct_zero(spec, t, scale, out, name)
    g_idx = _act_order(t.get("weight_g_idx"), cols, group, int(scale.shape[1]), f"{name}weight_g_idx")
    return _int_weight(w.to(torch.int32) + (1 << (spec.bits - 1)), scale, zero, spec.bits, group, g_idx)


def _fp8(spec: QuantSpec, t: Mapping[str, torch.Tensor], name: str) -> QuantWeight:
    """FP8 E4M3 weight [out, in] times its scale: per tensor, per channel, per group, or per block."""
    w = _need(t, "weight", spec, name)
    if w.dtype != FP8:
        raise ValueError(f"{name}weight is {w.dtype}; kvfleet reads FP8 weights as float8_e4m3fn")
    out, cols = (int(n) for n in w.shape)
    if spec.weight_strategy == "block" or "weight_scale_inv" in t:
        if spec.block_size is None:
            raise ValueError(f"block-wise FP8 scales of {name}weight need the config's weight_block_size")
        rows, bcols = spec.block_size
        # DeepSeek-style weight_scale_inv multiplies despite its name: w = weight · scale per [rows, bcols] block
        key = "weight_scale_inv" if "weight_scale_inv" in t else "weight_scale"
        s = _need(t, key, spec, name)
        _check(s, (-(-out // rows), -(-cols // bcols)), key, name)
        # a block's scale repeats down its rows: QuantWeight's [out, groups] grid holds blocks exactly
        scale = s.to(torch.float32).repeat_interleave(rows, dim=0)[:out].contiguous()
        return QuantWeight(q=w, scale=scale, zero=None, bits=8, group_size=bcols if bcols < cols else cols)
    scale, group = _ct_scale(spec, t, out, cols, name)
    return QuantWeight(q=w, scale=scale, zero=None, bits=8, group_size=group)
