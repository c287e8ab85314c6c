"""Tests of config.json reading (ModelConfig.from_dir) and the engine's start-up checks, each error naming its cause."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from loader_helpers import DELETE, copy_of, edit_config, read_config

from kvfleet_agent import LLM, EngineConfig
from kvfleet_agent.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from kvfleet_agent.models.tiny import ARCHS
from kvfleet_agent.worker.device import cpu_bf16_matmul, resolve_dtype

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


@pytest.mark.parametrize(("asked", "checkpoint", "device", "expected"), [
    ("auto", "float32", "cpu", torch.float32),  # without native bf16 matmuls, half precision is slow on CPU
    ("auto", "bfloat16", "cpu", torch.float32),
    ("auto", "float32", "cpu+AMX", torch.float32),  # a float32 checkpoint stays exact
    ("auto", "bfloat16", "cpu+AMX", torch.bfloat16),
    ("auto", "float16", "cpu+AVX512-BF16", torch.bfloat16),
    ("float32", "bfloat16", "cpu+AMX", torch.float32),  # asked for: as asked
    ("auto", "float16", "cuda", torch.float16),  # the checkpoint's, on a GPU
    ("auto", "bfloat16", "cuda", torch.bfloat16),
    ("auto", "float32", "cuda", torch.bfloat16),  # as vLLM: decode is memory-bound, half the bytes
    ("float32", "bfloat16", "cuda", torch.float32),  # asked for: as asked
])
def test_compute_dtype(ckpts: dict[str, Path], asked: str, checkpoint: str, device: str,
                       expected: torch.dtype) -> None:
    cfg = replace(ModelConfig.from_dir(str(ckpts["llama"])), torch_dtype=checkpoint)
    config = EngineConfig(model=str(ckpts["llama"]), dtype=asked)
    kind, _, native = device.partition("+")
    assert resolve_dtype(config, cfg, torch.device(kind), native or False) == expected


def test_auto_on_this_cpu_follows_its_instructions_and_says_why(ckpts: dict[str, Path],
                                                                caplog: pytest.LogCaptureFixture) -> None:
    cfg = replace(ModelConfig.from_dir(str(ckpts["llama"])), torch_dtype="bfloat16")
    with caplog.at_level(logging.INFO):
        got = resolve_dtype(EngineConfig(model=str(ckpts["llama"])), cfg, torch.device("cpu"))
    native = cpu_bf16_matmul()
    assert got == (torch.bfloat16 if native else torch.float32)
    assert (f"{native} multiplies bfloat16 natively" if native else "no AMX or AVX512-BF16") in caplog.text
