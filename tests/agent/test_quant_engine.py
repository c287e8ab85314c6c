"""Engines with on-load INT8/INT4 weights, on a checkpoint written by transformers' save_pretrained.

The reference for a quantized engine is an fp32 engine on the same checkpoint with every decoder linear
replaced by its dequantized weights: the two must agree to within the bf16 rounding of the activations,
so anything else the quantized path changed (a wrong scale, a shard cut in the wrong place) shows.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from engine_probes import greedy, prompt_logprobs
from hf_llama import save_hf_llama
from safetensors.torch import load_file, save_file

from kvfleet_agent import LLM
from kvfleet_agent.config import EngineConfig
from kvfleet_agent.layers.quant.onload import quantize

transformers = pytest.importorskip("transformers")

OPTIONS = {"kv_cache_memory_bytes": 4 << 20, "max_num_seqs": 8, "max_model_len": 96, "dtype": "float32",
           "enable_prefix_caching": False}
PROMPTS = [[5, 17, 300, 42, 8, 99, 123], [7, 7, 7, 1, 250], list(range(20, 60))]


@pytest.fixture(scope="module")
def hf_ckpt(tmp_path_factory: pytest.TempPathFactory, tiny_checkpoint: Callable[..., str]) -> Path:
    """A Llama saved by transformers (hidden 128, intermediate 256: int4 groups of 128 fit both), with the tiny
    checkpoint's tokenizer beside it."""
    return save_hf_llama(tmp_path_factory.mktemp("hf-llama"), tiny_checkpoint("llama"), 0, 128, 256, tie=False,
                         max_positions=256)


def dequantized_copy(src: Path, dst: Path, method: str) -> Path:
    """The checkpoint with each decoder linear's weight replaced by quantize-then-dequantize (the reference)."""
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    for name, t in tensors.items():
        if name.startswith("model.layers.") and name.endswith("proj.weight"):
            tensors[name] = quantize(t.float(), method).dequantize().to(t.dtype)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst






@pytest.mark.parametrize("method", ["int8", "int4", "fp8"])
def test_a_quantized_engine_computes_what_its_dequantized_weights_do(hf_ckpt: Path, tmp_path: Path,
                                                                       method: str) -> None:
    quant = LLM(model=str(hf_ckpt), quantization=method, **OPTIONS)
    reference = LLM(model=str(dequantized_copy(hf_ckpt, tmp_path / "deq", method)), **OPTIONS)
    full = LLM(model=str(hf_ckpt), **OPTIONS)
    got, want, fp = (prompt_logprobs(llm, PROMPTS) for llm in (quant, reference, full))
    assert got.shape == want.shape and len(got) > 40
    gap = (got - want).abs().max().item()
    assert gap < 0.05, f"{method}: the engine differs from its dequantized weights by {gap} (bf16 activations only)"
    # ...and the quantization itself is visible: the reference is not simply the fp32 model again.
    assert (want - fp).abs().max().item() > 1e-4


def test_quantized_weights_hold_a_fraction_of_the_dense_bytes(hf_ckpt: Path) -> None:
    dense = LLM(model=str(hf_ckpt), **OPTIONS).engine.runner
    int8 = LLM(model=str(hf_ckpt), quantization="int8", **OPTIONS).engine.runner
    int4 = LLM(model=str(hf_ckpt), quantization="int4", **OPTIONS).engine.runner
    linear = 2 * (128 * (128 + 2 * 64) + 128 * 128 + 2 * 256 * 128 + 128 * 256) * 4  # fp32 bytes of the linears
    rest = dense.param_bytes() - linear  # embeddings, LM head, norms: dense in every format
    assert int8.param_bytes() - rest < linear * 0.27  # one byte a weight, a 4-byte scale a row
    assert int4.param_bytes() - rest < linear * 0.16  # half a byte a weight, bf16 scale and zero a group of 128
    for m in int4.model.modules():  # and no dense copy of a quantized weight lingers anywhere
        if getattr(m, "quant", None):
            assert m.weight.is_meta and m.qmm is not None and m.qmm.path == "cpu-int4"


@pytest.mark.parametrize("method", ["int8", "int4", "fp8"])
def test_tensor_parallel_ranks_cut_one_grid_so_tp2_equals_tp1(hf_ckpt: Path, method: str) -> None:
    one = greedy(LLM(model=str(hf_ckpt), quantization=method, **OPTIONS), PROMPTS, 12)
    with LLM(model=str(hf_ckpt), quantization=method, tensor_parallel_size=2, **OPTIONS) as two:
        assert greedy(two, PROMPTS, 12) == one


def test_an_unknown_quantization_is_refused_naming_the_choices() -> None:
    with pytest.raises(ValueError, match=r"quantization='nf4' is invalid: choose one of int8, int4, gptq"):
        EngineConfig(model="unused", quantization="nf4")


def test_int4_on_inputs_no_group_divides_says_to_use_int8(tiny_checkpoint: Callable[..., str]) -> None:
    odd = tiny_checkpoint("llama", intermediate_size=100)  # down_proj's inputs: 100, not a multiple of 16
    with pytest.raises(ValueError, match=r"multiple of 16: use --quantization int8"):
        LLM(model=odd, quantization="int4", **OPTIONS)
