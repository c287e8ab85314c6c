"""AWQ and FP8 checkpoints at TP=2: the ranks cut each grid with its scales, so TP=2 equals TP=1 and the reference."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hf_llama import copy_tokenizer, hf_llama, save_hf_llama
from safetensors.torch import load_file, save_file
from test_quant_formats import AWQ_CONFIG, AWQ_ORDER, fp8_weight, pack, rtn

from kvfleet_agent import LLM, SamplingParams
from kvfleet_agent.bench.fp8_checkpoint import E4M3_MAX, write_fp8
from kvfleet_agent.llm import TokensPrompt

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

OPTIONS: dict[str, Any] = {"dtype": "float32", "kv_cache_memory_bytes": 2 << 20, "max_model_len": 64}
PROMPTS = [TokensPrompt(prompt_token_ids=p) for p in ([5, 9, 200, 31, 7, 7, 100, 64], [3, 1, 4, 1, 5, 9], [400, 12])]
# Per rank at TP=2: o_proj 64 and down_proj 192 input columns (2 and 6 groups of 32), q 64 and k, v 32 rows each.
HIDDEN, INTER, GROUP, SEED = 128, 384, 32, 3
BLOCK = (48, 32)  # 48-row blocks straddle the ranks' row cut (q's rows 0:64, k's 0:32) and end partial (k: 64 rows)
PACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
Dense = dict[str, torch.Tensor]  # a decoder linear's checkpoint name (….weight) → its dense reference weight


def linears(tensors: Dense) -> list[str]:
    """The decoder linears' weight names: what every format quantizes."""
    return [n for n in tensors if n.startswith("model.layers.") and n.endswith("proj.weight")]


def finish(dst: Path, tensors: Dense, quantization_config: dict[str, Any]) -> None:
    """Write the tensors and put quantization_config into dst's config.json."""
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"),
              metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "quantization_config": quantization_config}))


def write_awq(src: Path, dst: Path) -> Dense:
    """AutoAWQ's GEMM layout (group 32, zero points), packed as test_quant_formats checks against compressed-tensors'
    AutoAWQConverter; returns the grid each linear was packed from."""
    shutil.copytree(src, dst)
    tensors, refs = load_file(str(src / "model.safetensors")), {}
    for name in linears(tensors):
        w, prefix = tensors.pop(name).float(), name.removesuffix(".weight")
        q, scale, zero, refs[name] = rtn(w, 4, torch.arange(w.shape[1]) // GROUP, sym=False)
        tensors |= {f"{prefix}.qweight": pack(q.t(), 4, AWQ_ORDER), f"{prefix}.qzeros": pack(zero.t(), 4, AWQ_ORDER),
                    f"{prefix}.scales": scale.t()}
    finish(dst, tensors, {**AWQ_CONFIG, "group_size": GROUP})
    return refs


def write_fp8_scales(src: Path, dst: Path, scheme: str) -> Dense:
    """`quant_method: fp8` with a scale per channel (the bench's writer), per tensor, or per block (weight_scale_inv,
    as DeepSeek's checkpoints); returns q·scale, per block as compressed-tensors' FP8BlockDequantizer computes it."""
    from compressed_tensors.entrypoints.convert.converters import FP8BlockDequantizer  # type: ignore[import-untyped]

    write_fp8(str(src), str(dst))
    tensors, dense = load_file(str(dst / "model.safetensors")), load_file(str(src / "model.safetensors"))
    if scheme != "channel":
        for name in linears(dense):
            w, prefix, (r, c) = dense[name].float(), name.removesuffix(".weight"), BLOCK
            del tensors[f"{prefix}.weight_scale"]
            if scheme == "tensor":
                s = w.abs().amax() / E4M3_MAX
                tensors[name], tensors[f"{prefix}.weight_scale"] = fp8_weight(w, s), s
                continue
            rows, cols = w.shape
            s = F.pad(w.abs(), (0, -cols % c, 0, -rows % r)).reshape(-(-rows // r), r, -1, c).amax((1, 3)) / E4M3_MAX
            full = s.repeat_interleave(r, 0)[:rows].repeat_interleave(c, 1)[:, :cols]
            tensors[name], tensors[f"{prefix}.weight_scale_inv"] = fp8_weight(w, full), s
        block = {"weight_block_size": list(BLOCK)} if scheme == "block" else {}
        finish(dst, tensors, {"quant_method": "fp8", "activation_scheme": "dynamic", **block})
    blocks = FP8BlockDequantizer(weight_block_size=BLOCK, dtype=torch.float32)
    refs = {}
    for name in linears(tensors):
        prefix = name.removesuffix(".weight")
        if f"{prefix}.weight_scale_inv" in tensors:
            refs[name] = blocks.process({n: tensors[n] for n in (name, f"{prefix}.weight_scale_inv")})[name]
        else:
            refs[name] = tensors[name].float() * tensors[f"{prefix}.weight_scale"]
    return refs


def write_ct_fp8(src: Path, dst: Path, strategy: str) -> Dense:
    """compressed-tensors float-quantized FP8 (llm-compressor's FP8_DYNAMIC, or per block), compressed by the library
    itself from min/max scales; returns its own fake-quantized weights."""
    from compressed_tensors.compressors import ModelCompressor  # type: ignore[import-untyped]
    from compressed_tensors.quantization import (  # type: ignore[import-untyped]
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize  # type: ignore[import-untyped]
    from compressed_tensors.quantization.utils import calculate_qparams  # type: ignore[import-untyped]

    model = hf_llama(SEED, HIDDEN, INTER, tie=False)  # the weights save_hf_llama wrote to src
    block = {"block_structure": list(BLOCK)} if strategy == "block" else {}
    args = QuantizationArgs(num_bits=8, type="float", strategy=strategy, **block)
    acts = QuantizationArgs(num_bits=8, type="float", strategy="token", dynamic=True)
    scheme = QuantizationScheme(targets=["Linear"], weights=args, input_activations=acts)
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
    refs = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.startswith("model.layers."):
            w = module.weight.data
            r, c = BLOCK if strategy == "block" else (1, w.shape[1])
            blocks = F.pad(w, (0, -w.shape[1] % c, 0, -w.shape[0] % r)).reshape(-(-w.shape[0] // r), r, -1, c)
            scale, zero = calculate_qparams(blocks.amin((1, 3)), blocks.amax((1, 3)), args)
            dict(module.named_parameters())["weight_scale"].data.copy_(scale)
            refs[f"{name}.weight"] = fake_quantize(w, scale, zero, args).float()
    compressor = ModelCompressor.from_pretrained_model(model, "float-quantized")
    compressor.compress_model(model)
    dst.mkdir()
    model.config.save_pretrained(dst)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(dst / "model.safetensors"))
    compressor.update_config(str(dst))
    copy_tokenizer(src, dst)
    return refs


WRITERS: dict[str, Callable[[Path, Path], Dense]] = {
    "awq": write_awq,
    **{f"fp8-{s}": partial(write_fp8_scales, scheme=s) for s in ("tensor", "channel", "block")},
    **{f"ct-fp8-{s}": partial(write_ct_fp8, strategy=s) for s in ("channel", "block")},
}


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory, tiny_checkpoint: Callable[..., str]) -> Path:
    """The fp Llama every format quantizes, saved by transformers."""
    return save_hf_llama(tmp_path_factory.mktemp("fp"), tiny_checkpoint("llama"), SEED, HIDDEN, INTER, tie=False)


def prompt_logprobs(llm: LLM) -> torch.Tensor:
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    return torch.tensor([lp.logprob for o in outs for lp in (o.prompt_logprobs or [])[1:] if lp is not None])


def greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def rank0_shard(refs: Dense, module: str) -> torch.Tensor:
    """What rank 0 of 2 holds of a packed or row-parallel linear: each part's first half of rows, or half the inputs."""
    base, _, leaf = f"model.{module}".rpartition(".")  # the runner's modules drop the checkpoint's "model."
    if leaf in PACKED:
        return torch.cat([refs[f"{base}.{part}.weight"].chunk(2)[0] for part in PACKED[leaf]])
    return refs[f"{base}.{leaf}.weight"].chunk(2, dim=1)[0]


@pytest.mark.parametrize("fmt", sorted(WRITERS))
def test_a_quantized_checkpoint_at_tp2_computes_its_dequantized_weights_as_tp1_does(
        src: Path, tmp_path: Path, fmt: str) -> None:
    refs = WRITERS[fmt](src, tmp_path / fmt)
    assert len(refs) == 14
    shutil.copytree(src, tmp_path / "ref")  # the fp model with each linear replaced by its dequantized weight
    finish(tmp_path / "ref", {**load_file(str(src / "model.safetensors")), **refs}, {})
    tol = 0.05 if fmt == "awq" else 1e-4  # AWQ: the CPU int4 kernel's bf16 activations; FP8 runs dequantized
    want = prompt_logprobs(LLM(model=str(tmp_path / "ref"), **OPTIONS))
    one = LLM(model=str(tmp_path / fmt), **OPTIONS)
    assert (prompt_logprobs(one) - want).abs().max().item() < tol
    with LLM(model=str(tmp_path / fmt), tensor_parallel_size=2, **OPTIONS) as two:
        assert greedy(two) == greedy(one)
        got = prompt_logprobs(two)
        assert got.shape == want.shape and (got - want).abs().max().item() < tol
        # Each rank-0 linear applied to the identity reads back the weight that rank holds (kernel and all).
        held = {n: m.matmul(torch.eye(m.weight.shape[1]), None).t()
                for n, m in two.engine.runner.model.named_modules() if n.endswith("_proj")}
    assert len(held) == 8  # qkv, o, gate_up and down in each of 2 layers
    for name, w in held.items():
        shard = rank0_shard(refs, name)
        assert w.shape == shard.shape, name
        # AWQ: the int4 kernel's bf16 scales and output; FP8: no kernel on CPU, the rank's q·scale runs in fp32
        atol = 2**-6 * shard.abs().max().item() if fmt == "awq" else 0.0
        torch.testing.assert_close(w, shard, rtol=0, atol=atol, msg=name)
