"""Tests of load_weights (through ModelRunner): bad tensors are named, and what loads equals the checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from loader_helpers import copy_of, edit_config
from safetensors.torch import load_file, save_file

from kvfleet_agent import EngineConfig
from kvfleet_agent.models.config import ModelConfig
from kvfleet_agent.models.llama import LlamaForCausalLM
from kvfleet_agent.models.tiny import ARCHS, init_tiny
from kvfleet_agent.worker.model_runner import ModelRunner


def edit_tensors(d: Path, drop: tuple[str, ...] = (), add: dict[str, torch.Tensor] | None = None) -> None:
    """Re-save an unsharded checkpoint's model.safetensors without `drop` and with `add`."""
    path = d / "model.safetensors"
    tensors = load_file(str(path))
    for name in drop:
        del tensors[name]
    tensors.update(add or {})
    save_file(tensors, str(path), metadata={"format": "pt"})


def checkpoint_tensors(d: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def load_model(d: Path, dtype: str = "float32") -> LlamaForCausalLM:
    cfg = ModelConfig.from_dir(str(d))
    runner = ModelRunner(EngineConfig(model=str(d), device="cpu", dtype=dtype), cfg, 64)
    return runner.model


def params_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's values; a prepacked linear's weight (left on meta: one copy) read back from its packing."""
    out = {}
    for n, p in model.named_parameters():
        module = model.get_submodule(n.rpartition(".")[0])
        out[n] = module.packed.to_dense() if p.is_meta else p.detach()
    return out


# ---------------------------------------------------------------------------------------------
# weights: errors


def test_no_safetensors(ckpts: dict[str, Path], tmp_path: Path) -> None:
    d = copy_of(ckpts["llama"], tmp_path)
    (d / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors"):
        load_model(d)


def test_index_listing_a_missing_shard(ckpts: dict[str, Path], tmp_path: Path) -> None:
    d = copy_of(ckpts["llama-sharded"], tmp_path)
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"model-00002-of-00002\.safetensors") as info:
        load_model(d)
    assert "model.safetensors.index.json" in str(info.value)


def test_index_without_weight_map(ckpts: dict[str, Path], tmp_path: Path) -> None:
    d = copy_of(ckpts["llama-sharded"], tmp_path)
    (d / "model.safetensors.index.json").write_text('{"metadata": {}}', encoding="utf-8")
    with pytest.raises(ValueError, match="weight_map"):
        load_model(d)


@pytest.mark.parametrize(("arch", "dropped", "listed"), [
    ("llama", "model.layers.1.self_attn.k_proj.weight", "layers.1.self_attn.qkv_proj.weight (k)"),
    ("llama", "model.layers.0.mlp.up_proj.weight", "layers.0.mlp.gate_up_proj.weight (up)"),
    ("qwen2", "model.layers.0.self_attn.v_proj.bias", "layers.0.self_attn.qkv_proj.bias (v)"),
    ("llama", "model.layers.1.input_layernorm.weight", "layers.1.input_layernorm.weight"),
    ("llama", "model.norm.weight", "norm.weight"),
    ("llama", "lm_head.weight", "lm_head.weight"),
    ("qwen2", "model.embed_tokens.weight", "embed_tokens.weight"),
])
def test_missing_tensor_is_named(ckpts: dict[str, Path], tmp_path: Path, arch: str, dropped: str,
                                 listed: str) -> None:
    d = copy_of(ckpts[arch], tmp_path)
    edit_tensors(d, drop=(dropped,))
    with pytest.raises(ValueError, match="lacks tensors for: ") as info:
        load_model(d)
    # Exactly the dropped tensor's parameter (and packed shard) is reported, nothing else.
    assert str(info.value).split("lacks tensors for: ", 1)[1] == listed


@pytest.mark.parametrize("extra", ["model.layers.0.self_attn.extra_proj.weight", "model.layers.7.mlp.gate_proj.weight",
                                   "model.vision_tower.weight"])
def test_unexpected_tensor_is_named(ckpts: dict[str, Path], tmp_path: Path, extra: str) -> None:
    d = copy_of(ckpts["llama"], tmp_path)
    edit_tensors(d, add={extra: torch.randn(8, 64)})
    with pytest.raises(ValueError, match="has no place for") as info:
        load_model(d)
    assert repr(extra) in str(info.value)


def test_rotary_inv_freq_buffers_in_old_checkpoints_are_ignored(ckpts: dict[str, Path], tmp_path: Path) -> None:
    d = copy_of(ckpts["llama"], tmp_path)
    edit_tensors(d, add={f"model.layers.{i}.self_attn.rotary_emb.inv_freq": torch.rand(8) for i in range(2)})
    model = load_model(d)
    torch.testing.assert_close(model.norm.weight, checkpoint_tensors(d)["model.norm.weight"], atol=0, rtol=0)


@pytest.mark.parametrize("changes", [{"hidden_size": 32}, {"vocab_size": 1000}, {"vocab_size": 700}])
def test_config_that_does_not_match_the_weights_names_the_shapes(ckpts: dict[str, Path], tmp_path: Path,
                                                                 changes: dict[str, int]) -> None:
    d = copy_of(ckpts["llama"], tmp_path)
    edit_config(d, **changes)
    with pytest.raises(ValueError, match="shape") as info:
        load_model(d)
    assert "config.json" in str(info.value)


@pytest.mark.parametrize("changes", [{"intermediate_size": 128}, {"num_key_value_heads": 1},
                                     {"num_attention_heads": 2, "num_key_value_heads": 1}, {"head_dim": 8},
                                     {"intermediate_size": 200}])
def test_linear_size_mismatch_names_the_shapes(ckpts: dict[str, Path], tmp_path: Path,
                                               changes: dict[str, int]) -> None:
    d = copy_of(ckpts["llama"], tmp_path)
    edit_config(d, **changes)
    with pytest.raises(ValueError, match="shape"):
        load_model(d)


@pytest.mark.parametrize("size", [1, 32])
def test_norm_weight_of_the_wrong_shape_names_the_shapes(ckpts: dict[str, Path], tmp_path: Path, size: int) -> None:
    d = copy_of(ckpts["llama"], tmp_path)
    edit_tensors(d, add={"model.norm.weight": 1 + torch.rand(size)})
    with pytest.raises(ValueError, match="shape"):
        load_model(d)


# ---------------------------------------------------------------------------------------------
# weights: what gets loaded


def test_sharded_and_unsharded_checkpoints_load_identically(ckpts: dict[str, Path], tmp_path: Path) -> None:
    assert len(list(ckpts["llama-sharded"].glob("model-*-of-00002.safetensors"))) == 2
    three = Path(init_tiny(str(tmp_path / "three"), "llama", seed=11, num_shards=3))
    a = params_of(load_model(ckpts["llama"]))
    for d in (ckpts["llama-sharded"], three):
        b = params_of(load_model(d))
        assert a.keys() == b.keys()
        for name in a:
            assert torch.equal(a[name], b[name]), name
    # A different seed gives different weights (the comparison above is not vacuous).
    other = params_of(load_model(Path(init_tiny(str(tmp_path / "other"), "llama", seed=12))))
    assert not torch.equal(a["layers.0.self_attn.qkv_proj.weight"], other["layers.0.self_attn.qkv_proj.weight"])


def test_tied_embeddings_share_the_lm_head(ckpts: dict[str, Path], tmp_path: Path) -> None:
    model = load_model(ckpts["qwen2"])
    assert model.lm_head.weight is model.embed_tokens.weight
    embed = checkpoint_tensors(ckpts["qwen2"])["model.embed_tokens.weight"]
    torch.testing.assert_close(model.lm_head.weight, embed, atol=0, rtol=0)
    hidden = torch.randn(3, embed.shape[1])
    torch.testing.assert_close(model.compute_logits(hidden), hidden @ embed.T, atol=1e-5, rtol=1e-5)
    # An lm_head.weight saved beside tied embeddings is ignored, as transformers does.
    d = copy_of(ckpts["qwen2"], tmp_path)
    edit_tensors(d, add={"lm_head.weight": torch.randn_like(embed)})
    model = load_model(d)
    torch.testing.assert_close(model.lm_head.weight, embed, atol=0, rtol=0)
    # Untied: two separate matrices, each from its own tensor.
    llama = load_model(ckpts["llama"])
    t = checkpoint_tensors(ckpts["llama"])
    assert llama.lm_head.weight is not llama.embed_tokens.weight
    assert llama.lm_head.weight.is_meta, "an untied head keeps only its packed copy"
    torch.testing.assert_close(params_of(llama)["lm_head.weight"], t["lm_head.weight"], atol=0, rtol=0)
    torch.testing.assert_close(llama.embed_tokens.weight, t["model.embed_tokens.weight"], atol=0, rtol=0)


def expected_params(hf: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our parameter names → the HF tensors they must equal (q/k/v and gate/up concatenated in that order)."""
    out = {"embed_tokens.weight": hf["model.embed_tokens.weight"], "norm.weight": hf["model.norm.weight"]}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = hf["lm_head.weight"]
    for i in range(cfg.num_layers):
        src, dst = f"model.layers.{i}", f"layers.{i}"
        for kind in ("weight", "bias"):
            parts = [f"{src}.self_attn.{p}.{kind}" for p in ("q_proj", "k_proj", "v_proj")]
            if parts[0] in hf:
                out[f"{dst}.self_attn.qkv_proj.{kind}"] = torch.cat([hf[p] for p in parts])
            parts = [f"{src}.mlp.{p}.{kind}" for p in ("gate_proj", "up_proj")]
            if parts[0] in hf:
                out[f"{dst}.mlp.gate_up_proj.{kind}"] = torch.cat([hf[p] for p in parts])
            for plain in ("self_attn.o_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm"):
                if f"{src}.{plain}.{kind}" in hf:
                    out[f"{dst}.{plain}.{kind}"] = hf[f"{src}.{plain}.{kind}"]
    return out


@pytest.mark.parametrize("arch", [*ARCHS, "llama+biases", "llama-bf16"])
def test_every_parameter_equals_its_hf_tensors(ckpts: dict[str, Path], tmp_path: Path, arch: str) -> None:
    if arch == "llama+biases":
        d = Path(init_tiny(str(tmp_path / arch), "llama", seed=5, attention_bias=True, mlp_bias=True))
    elif arch == "llama-bf16":
        d = Path(init_tiny(str(tmp_path / arch), "llama", seed=5, dtype="bfloat16"))
    else:
        d = ckpts[arch]
    hf = checkpoint_tensors(d)
    cfg = ModelConfig.from_dir(str(d))
    model = load_model(d)
    got = params_of(model)
    want = expected_params(hf, cfg)
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert got[name].dtype == torch.float32
        torch.testing.assert_close(got[name], tensor.float(), atol=0, rtol=0, msg=name)
    if arch == "llama+biases":
        assert {"layers.0.self_attn.o_proj.bias", "layers.0.mlp.down_proj.bias"} <= got.keys()
    # Packed order spot check: the k rows of qkv_proj are exactly k_proj.
    q_rows = cfg.num_heads * cfg.head_dim
    kv_rows = cfg.num_kv_heads * cfg.head_dim
    torch.testing.assert_close(got["layers.1.self_attn.qkv_proj.weight"][q_rows:q_rows + kv_rows],
                               hf["model.layers.1.self_attn.k_proj.weight"].float(), atol=0, rtol=0)


def test_bfloat16_compute_dtype_casts_the_weights(ckpts: dict[str, Path]) -> None:
    model = load_model(ckpts["mistral"], dtype="bfloat16")
    hf = checkpoint_tensors(ckpts["mistral"])
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    torch.testing.assert_close(params_of(model)["layers.0.mlp.down_proj.weight"],
                               hf["model.layers.0.mlp.down_proj.weight"].to(torch.bfloat16), atol=0, rtol=0)
