"""Tests of checkpoint reading: ModelConfig.from_dir, load_weights (through ModelRunner) and the engine's
start-up checks (through LLM), each error naming what is at fault.

Checkpoints are tiny random ones from kvfleet_agent.models.tiny; broken variants are made by editing
a copy of a good one (config.json rewritten, safetensors re-saved without or with extra tensors).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvfleet_agent import LLM, EngineConfig
from kvfleet_agent.engine.model_runner import ModelRunner
from kvfleet_agent.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from kvfleet_agent.models.llama import LlamaForCausalLM
from kvfleet_agent.models.tiny import ARCHS, init_tiny

# ---------------------------------------------------------------------------------------------
# fixtures and helpers


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One good checkpoint per architecture, plus a 2-shard llama; never modified (tests copy them)."""
    root = tmp_path_factory.mktemp("loader_ckpts")
    out = {arch: Path(init_tiny(str(root / arch), arch, seed=11)) for arch in ARCHS}
    out["llama-sharded"] = Path(init_tiny(str(root / "llama-sharded"), "llama", seed=11, num_shards=2))
    return out


def copy_of(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / src.name
    shutil.copytree(src, dst)
    return dst


def read_config(d: Path) -> dict[str, Any]:
    config: dict[str, Any] = json.loads((d / "config.json").read_text(encoding="utf-8"))
    return config


def edit_config(d: Path, **changes: Any) -> None:
    config = read_config(d)
    for key, value in changes.items():
        if value is DELETE:
            del config[key]
        else:
            config[key] = value
    (d / "config.json").write_text(json.dumps(config), encoding="utf-8")


DELETE = object()


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
    return {n: p.detach() for n, p in model.named_parameters()}


# ---------------------------------------------------------------------------------------------
# config.json


def test_missing_config_json(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        ModelConfig.from_dir(str(tmp_path))


@pytest.mark.parametrize("text", ["{not json", "", '{"hidden_size": 64,}', "[1, 2, 3]", '"a string"'])
def test_malformed_config_json(ckpts: dict[str, Path], tmp_path: Path, text: str) -> None:
    d = copy_of(ckpts["llama"], tmp_path)
    (d / "config.json").write_text(text, encoding="utf-8")
    with pytest.raises(ValueError, match=r"config\.json"):
        ModelConfig.from_dir(str(d))


@pytest.mark.parametrize("changes", [
    {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"},
    {"architectures": DELETE, "model_type": "gpt2"},
])
def test_unsupported_architecture(ckpts: dict[str, Path], tmp_path: Path, changes: dict[str, Any]) -> None:
    d = copy_of(ckpts["llama"], tmp_path)
    edit_config(d, **changes)
    with pytest.raises(ValueError) as info:
        ModelConfig.from_dir(str(d))
    msg = str(info.value)
    assert ("GPT2LMHeadModel" if changes["architectures"] is not DELETE else "gpt2") in msg
    assert "config.json" in msg
    for arch in SUPPORTED_ARCHITECTURES:
        assert arch in msg


@pytest.mark.parametrize(("model_type", "arch"), [("llama", "LlamaForCausalLM"), ("mistral", "MistralForCausalLM"),
                                                  ("qwen2", "Qwen2ForCausalLM")])
def test_architecture_from_model_type_when_architectures_is_absent(ckpts: dict[str, Path], tmp_path: Path,
                                                                   model_type: str, arch: str) -> None:
    d = copy_of(ckpts["llama"], tmp_path)
    edit_config(d, architectures=DELETE, model_type=model_type)
    assert ModelConfig.from_dir(str(d)).architecture == arch


@pytest.mark.parametrize("field", ["hidden_size", "num_attention_heads", "vocab_size", "intermediate_size",
                                   "num_hidden_layers"])
def test_missing_required_field_is_named(ckpts: dict[str, Path], tmp_path: Path, field: str) -> None:
    d = copy_of(ckpts["llama"], tmp_path)
    edit_config(d, **{field: DELETE})
    with pytest.raises(ValueError, match=f"'{field}'") as info:
        ModelConfig.from_dir(str(d))
    assert "config.json" in str(info.value)


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 3), (6, 4), (2, 4)])
def test_heads_not_a_multiple_of_kv_heads(ckpts: dict[str, Path], tmp_path: Path, heads: int, kv_heads: int) -> None:
    d = copy_of(ckpts["llama"], tmp_path)
    edit_config(d, num_attention_heads=heads, num_key_value_heads=kv_heads)
    with pytest.raises(ValueError) as info:
        ModelConfig.from_dir(str(d))
    msg = str(info.value)
    assert f"num_attention_heads={heads}" in msg
    assert f"num_key_value_heads={kv_heads}" in msg
    assert "multiple" in msg


@pytest.mark.parametrize("arch", ARCHS)
def test_config_fields_are_read(ckpts: dict[str, Path], arch: str) -> None:
    raw = read_config(ckpts[arch])
    cfg = ModelConfig.from_dir(str(ckpts[arch]))
    assert cfg.architecture == raw["architectures"][0]
    assert (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        raw["hidden_size"], raw["num_attention_heads"], raw["num_key_value_heads"], raw["head_dim"])
    assert (cfg.vocab_size, cfg.intermediate_size, cfg.num_layers) == (
        raw["vocab_size"], raw["intermediate_size"], raw["num_hidden_layers"])
    assert cfg.rope_theta == raw["rope_theta"]
    assert cfg.rope_scaling == raw.get("rope_scaling")
    assert cfg.rms_norm_eps == raw["rms_norm_eps"]
    assert cfg.tie_word_embeddings == (arch == "qwen2")
    assert cfg.qkv_bias == (arch == "qwen2")
    assert not cfg.o_bias and not cfg.mlp_bias
    assert cfg.eos_token_ids == (raw["eos_token_id"],)


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
    torch.testing.assert_close(llama.lm_head.weight, t["lm_head.weight"], atol=0, rtol=0)
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


# ---------------------------------------------------------------------------------------------
# engine start-up


def test_engine_starts_and_generates(ckpts: dict[str, Path]) -> None:
    """The positive control for the errors below: the same options within limits work."""
    from kvfleet_agent import SamplingParams

    llm = LLM(str(ckpts["llama"]), device="cpu", max_model_len=512, kv_cache_memory_bytes=1 << 20, block_size=16)
    assert llm.engine.max_model_len == 512
    out = llm.generate([{"prompt_token_ids": [1, 5, 9, 33]}], SamplingParams(max_tokens=3, temperature=0,
                                                                               ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_max_model_len_beyond_max_position_embeddings(ckpts: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="max_model_len=513") as info:
        LLM(str(ckpts["llama"]), device="cpu", max_model_len=513, kv_cache_memory_bytes=1 << 20)
    assert "512" in str(info.value)


def test_sliding_window_caps_max_model_len(ckpts: dict[str, Path], tmp_path: Path) -> None:
    d = copy_of(ckpts["mistral"], tmp_path)
    edit_config(d, sliding_window=128)
    llm = LLM(str(d), device="cpu", kv_cache_memory_bytes=1 << 20)
    assert llm.engine.max_model_len == 128
    with pytest.raises(ValueError, match="max_model_len=256"):
        LLM(str(d), device="cpu", max_model_len=256, kv_cache_memory_bytes=1 << 20)


def test_kv_cache_memory_bytes_too_small_for_max_model_len(ckpts: dict[str, Path]) -> None:
    cfg = read_config(ckpts["llama"])
    bs, max_len = 16, 64
    # K and V, every layer, block_size slots of kv_heads * head_dim float32 values.
    per_block = 2 * cfg["num_hidden_layers"] * bs * cfg["num_key_value_heads"] * cfg["head_dim"] * 4
    enough = per_block * (max_len // bs)
    llm = LLM(str(ckpts["llama"]), device="cpu", dtype="float32", max_model_len=max_len, block_size=bs,
              kv_cache_memory_bytes=enough)
    assert llm.engine.kv.pool.num_blocks == max_len // bs
    for too_small in (enough - 1, 1000):
        with pytest.raises(ValueError, match="kv_cache_memory_bytes") as info:
            LLM(str(ckpts["llama"]), device="cpu", dtype="float32", max_model_len=max_len, block_size=bs,
                kv_cache_memory_bytes=too_small)
        assert "max_model_len=64" in str(info.value)


def test_unknown_engine_option(ckpts: dict[str, Path]) -> None:
    with pytest.raises(TypeError, match="max_batch_size") as info:
        LLM(str(ckpts["llama"]), device="cpu", max_batch_size=4)
    msg = str(info.value)
    for known in ("max_num_seqs", "block_size", "kv_cache_memory_bytes", "dtype", "enable_prefix_caching"):
        assert known in msg


@pytest.mark.parametrize(("option", "value"), [
    ("block_size", 3), ("block_size", 0), ("block_size", 512), ("dtype", "int8"), ("max_num_seqs", 0),
    ("max_num_seqs", True), ("max_num_batched_tokens", -1), ("device", "tpu"), ("max_model_len", 1),
    ("kv_cache_memory_bytes", 0), ("gpu_memory_utilization", 0.0), ("gpu_memory_utilization", 1.5),
])
def test_engine_config_validation_names_the_field(option: str, value: Any) -> None:
    with pytest.raises(ValueError, match=f"{option}=") as info:
        EngineConfig(model="unused", **{option: value})
    assert repr(value) in str(info.value)


def test_engine_config_without_chunked_prefill_needs_room_for_a_whole_prompt() -> None:
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineConfig(model="unused", enable_chunked_prefill=False, max_model_len=4096, max_num_batched_tokens=2048)
    EngineConfig(model="unused", enable_chunked_prefill=False, max_model_len=2048, max_num_batched_tokens=2048)


def test_llm_validates_options_before_loading(tmp_path: Path) -> None:
    # No checkpoint at all: the option error comes first.
    with pytest.raises(ValueError, match="block_size=3"):
        LLM(str(tmp_path), block_size=3)
