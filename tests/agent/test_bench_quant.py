"""bench.gptq (calibrated INT4 in AutoGPTQ's layout) and bench.quant's arithmetic; a written GPTQ checkpoint served."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hf_llama import save_hf_llama

from kvfleet_agent import LLM, SamplingParams
from kvfleet_agent.bench.gptq import pack_gptq, quantize_gptq, write_gptq
from kvfleet_agent.bench.quant import agreement, parse_format
from kvfleet_agent.layers.quant.formats import read_quantized
from kvfleet_agent.layers.quant.spec import spec_from_config

transformers = pytest.importorskip("transformers")

GPTQ_CONFIG = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True,
               "checkpoint_format": "gptq"}


def correlated_inputs(n: int, cols: int, seed: int) -> torch.Tensor:
    """Activations with a few dominant directions, as a layer's inputs have (where GPTQ beats rounding)."""
    g = torch.Generator().manual_seed(seed)
    basis = torch.randn(8, cols, generator=g)
    return torch.randn(n, 8, generator=g) @ basis * 3 + torch.randn(n, cols, generator=g) * 0.3


def test_the_packed_tensors_read_back_as_the_grid_they_were_packed_from() -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (48, 64), generator=g, dtype=torch.int8)
    scales, zeros = torch.rand(48, 2, generator=g) + 0.1, torch.randint(1, 16, (48, 2), generator=g).float()
    tensors = pack_gptq(q, scales, zeros)
    assert tensors["qweight"].shape == (8, 48) and tensors["qzeros"].shape == (2, 6)
    spec = spec_from_config({"quantization_config": {**GPTQ_CONFIG, "sym": False}}, None)
    assert spec is not None
    got = read_quantized(spec, tensors)
    want = (q.float() - zeros.repeat_interleave(32, dim=1)) * scales.half().float().repeat_interleave(32, dim=1)
    torch.testing.assert_close(got.dequantize(), want, rtol=0, atol=0)


def test_gptq_spreads_rounding_error_so_the_layer_output_beats_round_to_nearest() -> None:
    x = correlated_inputs(512, 64, seed=1)
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(2)) * 0.1
    hessian = 2 * x.t() @ x / len(x)
    q, s, z = quantize_gptq(w, hessian, group=32, sym=True)
    gptq = (q.float() - z.repeat_interleave(32, 1)) * s.repeat_interleave(32, 1)
    rtn_scale = (w.view(32, 2, 32).abs().amax(-1) * 2 / 15).repeat_interleave(32, 1)
    rtn = (torch.clamp(torch.round(w / rtn_scale) + 8, 0, 15) - 8) * rtn_scale
    err_gptq = (x @ (w - gptq).t()).norm()
    err_rtn = (x @ (w - rtn).t()).norm()
    assert err_gptq < 0.8 * err_rtn, f"GPTQ output error {err_gptq:.3f} against rounding's {err_rtn:.3f}"


def test_agreement_counts_tokens_up_to_the_first_difference() -> None:
    ref = [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert agreement(ref, ref) == (1.0, 1.0)
    assert agreement(ref, [[1, 2, 9, 4], [5, 6, 7, 8]]) == (6 / 8, 0.5)  # the 4 after the 9 does not count


def test_formats_name_a_flag_or_a_directory_and_a_kv_cache_dtype() -> None:
    assert parse_format("int8", "/m") == ("int8", "/m", "int8", "auto")
    assert parse_format("fp32", "/m") == ("fp32", "/m", None, "auto")
    assert parse_format("gptq=/ckpt", "/m") == ("gptq", "/ckpt", None, "auto")
    assert parse_format("kv-int8", "/m") == ("kv-int8", "/m", None, "int8")
    assert parse_format("int4+kv-fp8", "/m") == ("int4+kv-fp8", "/m", "int4", "fp8")
    assert parse_format("gptq+kv-int8=/ckpt", "/m") == ("gptq+kv-int8", "/ckpt", None, "int8")


def test_a_written_gptq_checkpoint_serves_what_its_dequantized_weights_compute(
        tmp_path: Path, tiny_checkpoint: Callable[..., str]) -> None:
    src = save_hf_llama(tmp_path / "fp", tiny_checkpoint("llama"), 0, 64, 128, tie=True, sharpen=False)
    windows = torch.randint(4, 512, (4, 64), generator=torch.Generator().manual_seed(3))
    write_gptq(str(src), str(tmp_path / "gptq"), windows, group=32)
    assert json.loads((tmp_path / "gptq" / "config.json").read_text())["quantization_config"]["bits"] == 4
    options = {"dtype": "float32", "kv_cache_memory_bytes": 2 << 20, "max_model_len": 64}
    prompts = [{"prompt_token_ids": [5, 9, 200, 31, 7, 7, 100, 64]}]
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    served = LLM(model=str(tmp_path / "gptq"), **options)
    assert all(m.qmm is not None for m in served.engine.runner.model.modules() if getattr(m, "quant", None))
    # The reference: the fp model with each linear replaced by the dequantized GPTQ weights, in fp32 throughout.
    spec = spec_from_config({"quantization_config": GPTQ_CONFIG}, None)
    assert spec is not None
    from safetensors.torch import load_file, save_file
    packed = load_file(str(tmp_path / "gptq" / "model.safetensors"))
    dense = load_file(str(src / "model.safetensors"))
    for prefix in {k.rpartition(".")[0] for k in packed if k.endswith(".qweight")}:
        parts = {s: packed[f"{prefix}.{s}"] for s in ("qweight", "qzeros", "scales", "g_idx")}
        dense[f"{prefix}.weight"] = read_quantized(spec, parts).dequantize()
    shutil.copytree(src, tmp_path / "ref")
    save_file(dense, str(tmp_path / "ref" / "model.safetensors"), metadata={"format": "pt"})
    got = served.generate(prompts, params, use_tqdm=False)[0].prompt_logprobs
    want = LLM(model=str(tmp_path / "ref"), **options).generate(prompts, params, use_tqdm=False)[0].prompt_logprobs
    assert got is not None and want is not None
    gaps = [abs(a.logprob - b.logprob) for a, b in zip(got[1:], want[1:], strict=True) if a and b]
    assert len(gaps) == 7 and max(gaps) < 0.05, gaps  # bf16 activations in the int4 kernel, nothing else


def test_a_written_fp8_checkpoint_serves_its_e4m3_weights(tmp_path: Path, tiny_checkpoint: Callable[..., str]) -> None:
    from safetensors.torch import load_file, save_file

    from kvfleet_agent.bench.fp8_checkpoint import E4M3_MAX, write_fp8

    src = tiny_checkpoint("llama")
    write_fp8(src, str(tmp_path / "fp8"))
    tensors = load_file(str(tmp_path / "fp8" / "model.safetensors"))
    w = tensors["model.layers.0.mlp.down_proj.weight"]
    assert w.dtype == torch.float8_e4m3fn and tensors["model.layers.0.mlp.down_proj.weight_scale"].shape == (64, 1)
    assert float(w.float().abs().amax(dim=1).min()) == E4M3_MAX  # each row's largest weight on the grid's end
    # The reference: the E4M3 values times their scales, as a plain fp32 checkpoint. On CPU FP8 runs dequantized
    # in fp32, so the two must agree to rounding; a misread scale (per tensor, transposed) would not.
    dense = {name: t for name, t in tensors.items() if not name.endswith("weight_scale")}
    for name, t in dense.items():
        if t.dtype == torch.float8_e4m3fn:
            dense[name] = t.float() * tensors[name.removesuffix("weight") + "weight_scale"]
    shutil.copytree(src, tmp_path / "ref")
    save_file(dense, str(tmp_path / "ref" / "model.safetensors"), metadata={"format": "pt"})
    options = {"dtype": "float32", "kv_cache_memory_bytes": 2 << 20, "max_model_len": 64}
    prompts = [{"prompt_token_ids": [5, 9, 200, 31, 7, 7, 100, 64]}]
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    got = LLM(model=str(tmp_path / "fp8"), **options).generate(prompts, params, use_tqdm=False)[0].prompt_logprobs
    want = LLM(model=str(tmp_path / "ref"), **options).generate(prompts, params, use_tqdm=False)[0].prompt_logprobs
    assert got is not None and want is not None
    gaps = [abs(a.logprob - b.logprob) for a, b in zip(got[1:], want[1:], strict=True) if a and b]
    assert len(gaps) == 7 and max(gaps) < 1e-4, gaps


def test_a_gptq_checkpoint_at_tp2_equals_tp1(tmp_path: Path, tiny_checkpoint: Callable[..., str]) -> None:
    """Row-parallel ranks cut the checkpoint's groups and scales where the columns split; column-parallel ones
    cut rows: TP=2 must compute what TP=1 does, token for token."""
    src = save_hf_llama(tmp_path / "fp", tiny_checkpoint("llama"), 1, 64, 128, tie=False)
    write_gptq(str(src), str(tmp_path / "gptq"), torch.randint(4, 512, (4, 64)), group=32)
    options = {"dtype": "float32", "kv_cache_memory_bytes": 2 << 20, "max_model_len": 64}
    prompts = [{"prompt_token_ids": p} for p in ([5, 9, 200, 31, 7], [100, 64, 3], list(range(40, 60)))]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    one = [o.outputs[0].token_ids for o in LLM(model=str(tmp_path / "gptq"), **options).generate(prompts, params)]
    with LLM(model=str(tmp_path / "gptq"), tensor_parallel_size=2, **options) as two:
        assert [o.outputs[0].token_ids for o in two.generate(prompts, params)] == one
