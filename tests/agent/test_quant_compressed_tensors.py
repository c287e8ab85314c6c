"""A whole Llama compressed by compressed-tensors itself (what llm-compressor writes) served by kvfleet: at TP=1 it
computes what the library's own fake-quantized weights compute, and TP=2 equals TP=1."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_llama import copy_tokenizer, hf_llama
from safetensors.torch import save_file

from kvfleet_agent import LLM, SamplingParams

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

OPTIONS = {"dtype": "float32", "kv_cache_memory_bytes": 2 << 20, "max_model_len": 64}
PROMPTS = [{"prompt_token_ids": p} for p in ([5, 9, 200, 31, 7, 7, 100, 64], [3, 1, 4, 1, 5, 9, 2, 6], [400, 12, 77])]


def compress(model: Any, out: Path, weights: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Quantize the decoder linears with compressed-tensors (min/max per group, its default observer), write the
    packed checkpoint to `out` and return each linear's fake-quantized weight (the library's own dequantization)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    args = QuantizationArgs(**weights)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
    expected = {}
    for name, module in model.named_modules():
        if not (isinstance(module, torch.nn.Linear) and name.startswith("model.layers.")):
            continue
        w = module.weight.data
        grouped = w.reshape(w.shape[0], -1, args.group_size) if args.strategy == "group" else w[:, None, :]
        scale, zero = calculate_qparams(grouped.amin(-1), grouped.amax(-1), args)
        params = dict(module.named_parameters())
        params["weight_scale"].data.copy_(scale)
        if "weight_zero_point" in params:
            params["weight_zero_point"].data.copy_(zero)
        expected[f"{name}.weight"] = fake_quantize(w, scale, zero, args).clone()
    compressor = ModelCompressor.from_pretrained_model(model, "pack-quantized")
    compressor.compress_model(model)
    model.config.save_pretrained(out)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    compressor.update_config(str(out))
    return expected


@pytest.mark.parametrize("weights", [
    {"num_bits": 4, "strategy": "group", "group_size": 64, "symmetric": False},  # W4A16, asymmetric
    {"num_bits": 8, "strategy": "channel", "symmetric": True},  # W8A16
], ids=["w4a16", "w8a16"])
def test_a_compressed_tensors_llama_serves_its_library_grid_and_tp2_equals_tp1(
        tmp_path: Path, tiny_checkpoint: Callable[..., str], weights: dict[str, Any]) -> None:
    packed, reference = tmp_path / "packed", tmp_path / "reference"
    model = hf_llama(5, 128, 256, tie=False)
    dense = {k: v.clone() for k, v in model.state_dict().items()}
    expected = compress(model, packed, weights)
    assert json.loads((packed / "config.json").read_text())["quantization_config"]["format"] == "pack-quantized"
    reference.mkdir()
    model.config.save_pretrained(reference)
    dense.update(expected)
    save_file({k: v.contiguous() for k, v in dense.items()}, str(reference / "model.safetensors"),
              metadata={"format": "pt"})
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    served = LLM(model=copy_tokenizer(tiny_checkpoint("llama"), packed), **OPTIONS)
    kernels = {m.qmm.path for m in served.engine.runner.model.modules() if getattr(m, "qmm", None) is not None}
    assert kernels == {"cpu-int4" if weights["num_bits"] == 4 else "cpu-int8"}
    got = [lp.logprob for o in served.generate(PROMPTS, params, use_tqdm=False) for lp in o.prompt_logprobs[1:]]
    ref_llm = LLM(model=copy_tokenizer(tiny_checkpoint("llama"), reference), **OPTIONS)
    want = [lp.logprob for o in ref_llm.generate(PROMPTS, params, use_tqdm=False) for lp in o.prompt_logprobs[1:]]
    gap = max(abs(a - b) for a, b in zip(got, want, strict=True))
    assert len(got) == 16 and gap < 0.05, gap  # bf16 activations in the CPU kernels, nothing else
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    one = [o.outputs[0].token_ids for o in served.generate(PROMPTS, greedy, use_tqdm=False)]
    with LLM(model=str(packed), tensor_parallel_size=2, **OPTIONS) as two:
        assert [o.outputs[0].token_ids for o in two.generate(PROMPTS, greedy, use_tqdm=False)] == one
