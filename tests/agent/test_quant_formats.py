"""Quantized checkpoint tensors (GPTQ, AWQ, compressed-tensors, FP8) read into QuantWeight, checked against dense."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from kvfleet_agent.layers.quant.formats import is_ignored, is_quantized, read_quantized, split_name
from kvfleet_agent.layers.quant.spec import QuantSpec, spec_from_config

OUT, IN = 64, 256
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's WQLinear_GEMM: nibble i of a word holds column AWQ_ORDER[i]
FP8 = torch.float8_e4m3fn


def spec(q: dict[str, Any]) -> QuantSpec:
    """The spec of a config.json with this quantization_config."""
    s = spec_from_config({"architectures": ["LlamaForCausalLM"], "quantization_config": q}, None)
    assert s is not None
    return s


def pack(vals: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """Unsigned ints [rows, n] into int32 words along dim 1, slot by slot from the lowest bits (as the packers loop)."""
    per = 32 // bits
    v = vals.to(torch.int64).reshape(vals.shape[0], -1, per)
    word = torch.zeros(v.shape[:2], dtype=torch.int64)
    for slot in range(per):
        word |= v[..., slot if order is None else order[slot]] << (bits * slot)
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)  # the bit pattern, as int32 stores it


def rtn(w: torch.Tensor, bits: int, col_group: torch.Tensor, sym: bool) -> tuple[torch.Tensor, ...]:
    """GPTQ/AWQ's min/max grid per (row, group): q unsigned, scale fp16 (as stored), zero, and the dense reference."""
    maxq, groups = 2**bits - 1, int(col_group.max()) + 1
    lo = torch.stack([w[:, col_group == g].amin(1) for g in range(groups)], 1).clamp(max=0)
    hi = torch.stack([w[:, col_group == g].amax(1) for g in range(groups)], 1).clamp(min=0)
    if sym:
        hi = torch.maximum(hi, -lo)
        scale, zero = (2 * hi / maxq).half(), torch.full_like(hi, (maxq + 1) // 2)
    else:
        scale = ((hi - lo) / maxq).half()
        zero = torch.round(-lo / scale.float()).clamp(0, maxq)
    s, z = scale.float()[:, col_group], zero[:, col_group]
    q = (torch.round(w / s) + z).clamp(0, maxq).to(torch.int64)
    return q, scale, zero.to(torch.int64), (q - z) * s


@pytest.mark.parametrize(("bits", "sym", "act_order", "fmt"), [
    (4, True, False, "gptq"), (4, False, False, "gptq"), (4, True, True, "gptq"), (4, False, True, "gptq"),
    (8, True, False, "gptq"), (8, False, True, "gptq"), (4, False, False, "gptq_v2")])
def test_gptq_dequantizes_to_the_grid_it_was_packed_from(bits: int, sym: bool, act_order: bool, fmt: str) -> None:
    torch.manual_seed(bits + 2 * sym + 4 * act_order)
    w, gs = torch.randn(OUT, IN), 64
    col_group = torch.arange(IN) // gs
    if act_order:  # GPTQ desc_act: groups follow a column permutation, g_idx names each column's group
        col_group = torch.empty(IN, dtype=torch.int64)
        col_group[torch.randperm(IN)] = torch.arange(IN) // gs
    q, scale, zero, ref = rtn(w, bits, col_group, sym)
    stored = zero - 1 if fmt == "gptq" else zero  # v1 stores zero - 1
    tensors = {"qweight": pack(q, bits).t().contiguous(), "qzeros": pack(stored.t() & (2**bits - 1), bits),
               "scales": scale.t().contiguous(), "g_idx": col_group.to(torch.int32)}
    s = spec({"quant_method": "gptq", "bits": bits, "group_size": gs, "desc_act": act_order, "sym": sym,
              "damp_percent": 0.01, "true_sequential": True, "checkpoint_format": fmt})
    qw = read_quantized(s, tensors)
    assert qw.shape == (OUT, IN) and qw.q.dtype == torch.int8 and qw.group_size == gs
    torch.testing.assert_close(qw.dequantize(), ref, rtol=0, atol=1e-6)
    assert (w - ref).abs().max() <= scale.float().max()  # the reference is a real quantization of w
    assert (qw.g_idx is not None) == act_order  # the trivial g_idx of plain groups is dropped
    if bits == 4:
        assert int(qw.q.min()) >= 0 and int(qw.q.max()) <= 15 and qw.zero is not None
    else:
        assert (qw.zero is None) == sym  # 8-bit symmetric: zero 128 folded into signed q
        assert int(qw.q.min()) < 0


def test_gptq_split_and_missing_tensors() -> None:
    s = spec({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": False})
    assert split_name("model.layers.0.self_attn.q_proj.qweight", s) == ("model.layers.0.self_attn.q_proj", "qweight")
    assert split_name("model.layers.0.self_attn.q_proj.g_idx", s) == ("model.layers.0.self_attn.q_proj", "g_idx")
    for plain in ("lm_head.weight", "model.norm.weight", "model.layers.0.self_attn.q_proj.bias", "qweight"):
        assert split_name(plain, s) is None
    assert not is_quantized(s, {"weight": torch.zeros(2, 2)})
    with pytest.raises(ValueError, match=r"q_proj\.qzeros"):
        read_quantized(s, {"qweight": torch.zeros(32, 64, dtype=torch.int32),
                           "scales": torch.ones(2, 64, dtype=torch.float16)}, name="q_proj")
    with pytest.raises(ValueError, match=r"scales has shape"):
        read_quantized(s, {"qweight": torch.zeros(32, 64, dtype=torch.int32),
                           "qzeros": torch.zeros(2, 8, dtype=torch.int32), "scales": torch.ones(3, 64)})


def awq_checkpoint() -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """AutoAWQ GEMM tensors of a random weight (group 128, zero points) and their dense reference [out, in]."""
    torch.manual_seed(7)
    w = torch.randn(OUT, IN)
    q, scale, zero, ref = rtn(w, 4, torch.arange(IN) // 128, sym=False)
    return {"qweight": pack(q.t(), 4, AWQ_ORDER), "qzeros": pack(zero.t(), 4, AWQ_ORDER),
            "scales": scale.t().contiguous()}, ref


AWQ_CONFIG = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}


def test_awq_gemm_dequantizes_to_its_grid() -> None:
    tensors, ref = awq_checkpoint()
    assert tensors["qweight"].shape == (IN, OUT // 8) and tensors["qzeros"].shape == (IN // 128, OUT // 8)
    qw = read_quantized(spec(AWQ_CONFIG), tensors)
    torch.testing.assert_close(qw.dequantize(), ref, rtol=0, atol=1e-6)
    assert qw.g_idx is None and qw.zero is not None and qw.group_size == 128


def test_awq_reading_agrees_with_compressed_tensors_converter() -> None:
    """compressed-tensors' own AutoAWQ converter and decompressor read the same tensors to the same weight."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.entrypoints.convert.converters import AutoAWQConverter

    tensors, ref = awq_checkpoint()
    conv = AutoAWQConverter(bits=4, group_size=128, zero_point=True)
    ct = conv.process({f"proj.{k}": v for k, v in tensors.items()})
    scheme = conv.update_config(None).config_groups["config_group_0"]
    local = {k.removeprefix("proj."): v for k, v in ct.items()}
    local["weight_scale"] = local["weight_scale"].float()  # the library dequantizes in the scale's dtype: keep fp32
    dense = PackedQuantizationCompressor.decompress(local, scheme)
    torch.testing.assert_close(dense["weight"].float(), ref, rtol=0, atol=1e-6)
    ours = read_quantized(spec(AWQ_CONFIG), tensors).dequantize()
    torch.testing.assert_close(ours, dense["weight"].float(), rtol=0, atol=1e-6)


class TwoLinears(torch.nn.Module):
    """A quantized projection beside an ignored lm_head."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(IN, OUT, bias=False)
        self.lm_head = torch.nn.Linear(OUT, 32, bias=False)


def ct_checkpoint(tmp_path: Path, weights: dict[str, Any], acts: dict[str, Any] | None,
                  fmt: str) -> tuple[QuantSpec, dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """A two-linear model compressed by compressed-tensors itself: its spec, proj's tensors, expected and w."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    torch.manual_seed(3)
    model = TwoLinears()
    args = QuantizationArgs(**weights)
    scheme = QuantizationScheme(targets=["Linear"], weights=args,
                                input_activations=None if acts is None else QuantizationArgs(**acts))
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["re:.*lm_head"]))
    proj = model.proj
    w = proj.weight.data.clone()
    if args.strategy == "group":
        ws = w.reshape(OUT, -1, args.group_size)
        lo, hi = ws.amin(-1), ws.amax(-1)
    elif args.strategy == "block":
        r, c = args.block_structure
        lo, hi = (f(w.reshape(OUT // r, r, IN // c, c), (1, 3)) for f in (torch.amin, torch.amax))
    elif args.strategy == "channel":
        lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    else:
        lo, hi = w.amin().reshape(1), w.amax().reshape(1)
    scale, zero = calculate_qparams(lo, hi, args)  # min/max calibration, llm-compressor's default observer
    params = dict(proj.named_parameters())
    params["weight_scale"].data.copy_(scale)
    if "weight_zero_point" in params:
        params["weight_zero_point"].data.copy_(zero)
    if "input_scale" in params:  # static activations: any calibrated value
        params["input_scale"].data.fill_(0.05)
    expected = fake_quantize(w, scale, zero, args)
    comp = ModelCompressor.from_pretrained_model(model, fmt)
    comp.compress_model(model)
    comp.update_config(str(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    s = spec_from_config(config, None)
    assert s is not None and s.format == fmt
    names = {n: split_name(n, s) for n in model.state_dict()}
    tensors = {sfx: model.state_dict()[n] for n, ps in names.items() if ps and ps[0] == "proj" for sfx in [ps[1]]}
    assert is_quantized(s, tensors) and is_ignored("lm_head", s) and not is_ignored("proj", s)
    return s, tensors, expected, w


CT_CASES = {
    "w4a16-group-sym": (dict(num_bits=4, strategy="group", group_size=128, symmetric=True), None, "pack-quantized"),
    "w4a16-group-asym": (dict(num_bits=4, strategy="group", group_size=128, symmetric=False), None, "pack-quantized"),
    "w8a16-channel": (dict(num_bits=8, strategy="channel", symmetric=True), None, "pack-quantized"),
    "w8a8-int8": (dict(num_bits=8, strategy="channel", symmetric=True),
                  dict(num_bits=8, strategy="token", dynamic=True), "int-quantized"),
    "w8a8-fp8-channel": (dict(num_bits=8, type="float", strategy="channel"),
                         dict(num_bits=8, type="float", strategy="token", dynamic=True), "float-quantized"),
    "w8a8-fp8-block": (dict(num_bits=8, type="float", strategy="block", block_structure=[32, 128]),
                       dict(num_bits=8, type="float", strategy="group", group_size=128, dynamic=True),
                       "float-quantized"),
    "w8a8-fp8-tensor-static": (dict(num_bits=8, type="float", strategy="tensor"),
                               dict(num_bits=8, type="float", strategy="tensor"), "float-quantized"),
}


@pytest.mark.parametrize("case", sorted(CT_CASES))
def test_compressed_tensors_match_the_library_grid(tmp_path: Path, case: str) -> None:
    weights, acts, fmt = CT_CASES[case]
    s, tensors, expected, w = ct_checkpoint(tmp_path, weights, acts, fmt)
    assert ("weight_packed" in tensors) == (fmt == "pack-quantized")
    qw = read_quantized(s, tensors)
    assert qw.shape == (OUT, IN) and qw.bits == weights["num_bits"] and qw.g_idx is None
    torch.testing.assert_close(qw.dequantize(), expected.float(), rtol=1e-6, atol=1e-6)
    assert 0 < (qw.dequantize() - w).abs().max() < w.abs().max() / 4  # quantized, not a copy, not garbage
    assert qw.is_fp8 == (weights.get("type") == "float")
    assert (qw.zero is None) == (weights["num_bits"] == 8)  # 8-bit symmetric folds its zero away
    assert s.activation_scheme == (None if acts is None else "dynamic" if acts.get("dynamic") else "static")


def fp8_weight(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """w / scale in E4M3, saturated as the FP8 writers do."""
    return (w / scale).clamp(-448, 448).to(FP8)


@pytest.mark.parametrize("per_channel", [False, True])
def test_fp8_per_tensor_and_per_channel(per_channel: bool) -> None:
    torch.manual_seed(11)
    w = torch.randn(OUT, IN)
    scale = w.abs().amax(1, keepdim=True) / 448 if per_channel else w.abs().max() / 448
    q = fp8_weight(w, scale)
    s = spec({"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]})
    assert split_name("model.layers.0.mlp.down_proj.weight", s) == ("model.layers.0.mlp.down_proj", "weight")
    assert not is_quantized(s, {"weight": torch.ones(IN)})  # a norm's .weight: no scale beside it
    tensors = {"weight": q, "weight_scale": scale.reshape(OUT, 1) if per_channel else scale.reshape(()),
               "input_scale": torch.tensor(0.02)}
    assert is_quantized(s, tensors)
    qw = read_quantized(s, tensors)
    assert qw.is_fp8 and qw.scale.shape == (OUT, 1) and qw.group_size == IN
    torch.testing.assert_close(qw.dequantize(), q.float() * scale, rtol=0, atol=0)
    assert (qw.dequantize() - w).abs().max() < 0.07 * w.abs().max()


def test_fp8_block_scales_match_compressed_tensors_dequantizer() -> None:
    out, cols = 200, 320  # neither a multiple of the 128x128 block: the edge blocks are partial
    torch.manual_seed(5)
    w = torch.randn(out, cols)
    sinv = torch.rand(2, 3) / 100 + 1e-3
    full = sinv.repeat_interleave(128, 0)[:out].repeat_interleave(128, 1)[:, :cols]
    q = fp8_weight(w, full)
    s = spec({"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]})
    qw = read_quantized(s, {"weight": q, "weight_scale_inv": sinv})
    torch.testing.assert_close(qw.dequantize(), q.float() * full, rtol=0, atol=0)
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.entrypoints.convert.converters import FP8BlockDequantizer

    dense = FP8BlockDequantizer(dtype=torch.float32).process({"m.weight": q, "m.weight_scale_inv": sinv})["m.weight"]
    torch.testing.assert_close(qw.dequantize(), dense, rtol=0, atol=0)
    with pytest.raises(ValueError, match="weight_scale_inv has shape"):
        read_quantized(s, {"weight": q, "weight_scale_inv": torch.ones(1, 3)})
