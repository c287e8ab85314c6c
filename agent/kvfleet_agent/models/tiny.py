"""Writes small random Hugging Face checkpoints (config, safetensors weights, a locally trained tokenizer)."""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer as HFTokenizer

from kvfleet_agent.models.tiny_tokenizer import (
    TINY_BOS_ID,
    TINY_EOS_ID,
    TINY_PAD_ID,
    TINY_UNK_ID,
    tiny_tokenizer_json,
)

__all__ = [
    "ARCHS",
    "TINY_BOS_ID",
    "TINY_CHAT_TEMPLATE",
    "TINY_EOS_ID",
    "TINY_PAD_ID",
    "TINY_UNK_ID",
    "init_tiny",
    "tiny_tokenizer_json",
]


# HF-style template: BOS, one "<|role|>" block per message closed by EOS, then the assistant cue.
TINY_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Unsupported role: ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

ARCHS = ("llama", "llama3", "qwen2", "mistral")

_SHARED_DEFAULTS: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 176,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "attention_dropout": 0.0,
    "use_cache": True,
    "bos_token_id": TINY_BOS_ID,
    "eos_token_id": TINY_EOS_ID,
}

_ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "tie_word_embeddings": False,
    },
    "llama3": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            # Tiny so that the frequency bands the llama3 formula rescales are actually hit by tests.
            "original_max_position_embeddings": 64,
        },
        "attention_bias": False,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "tie_word_embeddings": False,
    },
    "qwen2": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": 2,
        "tie_word_embeddings": True,
    },
    "mistral": {
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "rope_theta": 10000.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
    },
}

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

# Init scales, tuned by measuring the transformers reference model (random 64-token batches):
# - small embeddings + larger projections keep the residual stream dominated by attention/MLP
#   output, so greedy continuations depend on context instead of repeating the last token
#   (with tied embeddings a large embedding makes every token predict itself);
# - the final norm weight ~4 scales logits to std ~2.5 without changing which token wins, so the
#   top-1 vs top-2 gap is above 1e-3 at >99% of positions and greedy decoding is reproducible
#   across implementations that differ only by float rounding.
_STD_EMBED = 0.08
_STD_LINEAR = 0.2
_FINAL_NORM_SCALE = 4.0
_STD_NORM_NOISE = 0.05
_STD_BIAS = 0.02

def _build_config(arch: str, vocab_size: int, overrides: dict[str, Any], dtype_name: str) -> dict[str, Any]:
    config: dict[str, Any] = {**_SHARED_DEFAULTS, **_ARCH_DEFAULTS[arch]}
    config["vocab_size"] = vocab_size
    # A changed hidden size or head count implies a new head_dim unless one was given explicitly.
    if "head_dim" not in overrides and ("hidden_size" in overrides or "num_attention_heads" in overrides):
        hidden = int(overrides.get("hidden_size", config["hidden_size"]))
        heads = int(overrides.get("num_attention_heads", config["num_attention_heads"]))
        if hidden % heads:
            raise ValueError(
                f"init_tiny: hidden_size={hidden} is not divisible by num_attention_heads={heads}; "
                "pass head_dim explicitly or pick divisible sizes"
            )
        config["head_dim"] = hidden // heads
    config.update(overrides)
    if arch == "qwen2" and "num_hidden_layers" in overrides and "max_window_layers" not in overrides:
        config["max_window_layers"] = config["num_hidden_layers"]
    config["torch_dtype"] = dtype_name

    if config["vocab_size"] < vocab_size:
        raise ValueError(
            f"init_tiny: vocab_size={config['vocab_size']} is smaller than the tokenizer's {vocab_size} "
            "tokens; drop the override or make it at least that large (padding rows are allowed)"
        )
    for field in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
    ):
        if not isinstance(config[field], int) or config[field] <= 0:
            raise ValueError(f"init_tiny: config field {field}={config[field]!r} must be a positive integer")
    if config["num_attention_heads"] % config["num_key_value_heads"]:
        raise ValueError(
            f"init_tiny: num_attention_heads={config['num_attention_heads']} must be a multiple of "
            f"num_key_value_heads={config['num_key_value_heads']}"
        )
    return config


def _param_shapes(arch: str, config: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """HF parameter names and shapes, in the order HF's modules define them."""
    hidden = config["hidden_size"]
    inter = config["intermediate_size"]
    q_dim = config["num_attention_heads"] * config["head_dim"]
    kv_dim = config["num_key_value_heads"] * config["head_dim"]
    # Qwen2 always has q/k/v biases; Llama has them only when attention_bias / mlp_bias say so.
    is_llama = arch in ("llama", "llama3")
    qkv_bias = arch == "qwen2" or (is_llama and bool(config.get("attention_bias", False)))
    o_bias = is_llama and bool(config.get("attention_bias", False))
    mlp_bias = is_llama and bool(config.get("mlp_bias", False))

    shapes: list[tuple[str, tuple[int, ...]]] = [
        ("model.embed_tokens.weight", (config["vocab_size"], hidden))
    ]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        for name, out_dim, in_dim, bias in (
            ("self_attn.q_proj", q_dim, hidden, qkv_bias),
            ("self_attn.k_proj", kv_dim, hidden, qkv_bias),
            ("self_attn.v_proj", kv_dim, hidden, qkv_bias),
            ("self_attn.o_proj", hidden, q_dim, o_bias),
            ("mlp.gate_proj", inter, hidden, mlp_bias),
            ("mlp.up_proj", inter, hidden, mlp_bias),
            ("mlp.down_proj", hidden, inter, mlp_bias),
        ):
            shapes.append((f"{p}.{name}.weight", (out_dim, in_dim)))
            if bias:
                shapes.append((f"{p}.{name}.bias", (out_dim,)))
        shapes.append((f"{p}.input_layernorm.weight", (hidden,)))
        shapes.append((f"{p}.post_attention_layernorm.weight", (hidden,)))
    shapes.append(("model.norm.weight", (hidden,)))
    if not config.get("tie_word_embeddings", False):
        shapes.append(("lm_head.weight", (config["vocab_size"], hidden)))
    return shapes


def _random_weights(
    arch: str, config: dict[str, Any], seed: int, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in _param_shapes(arch, config):
        noise = torch.randn(shape, generator=gen, dtype=torch.float32)
        if name.endswith("layernorm.weight"):
            t = 1.0 + _STD_NORM_NOISE * noise
        elif name == "model.norm.weight":
            t = _FINAL_NORM_SCALE * (1.0 + _STD_NORM_NOISE * noise)
        elif name.endswith(".bias"):
            t = _STD_BIAS * noise
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            t = _STD_EMBED * noise
        else:
            t = _STD_LINEAR * noise
        out[name] = t.to(dtype).contiguous()
    return out


def _shard_assignment(sizes: list[int], num_shards: int) -> list[int]:
    """Contiguous, byte-balanced split of tensors into shards where no shard is left empty."""
    n = len(sizes)
    total = max(sum(sizes), 1)
    out: list[int] = []
    prev = -1
    cum = 0
    for i, size in enumerate(sizes):
        want = min(num_shards - 1, cum * num_shards // total)
        lo = max(prev, num_shards - (n - i), 0)  # enough tensors must remain for later shards
        hi = min(prev + 1, num_shards - 1)  # never skip a shard
        prev = min(max(want, lo), hi)
        out.append(prev)
        cum += size
    return out


def _remove_stale_weights(out_dir: str) -> None:
    # A previous call with a different num_shards would otherwise leave both layouts behind and
    # loaders would pick whichever they look for first.
    for entry in os.listdir(out_dir):
        if entry in ("model.safetensors", "model.safetensors.index.json") or (
            entry.startswith("model-") and "-of-" in entry and entry.endswith(".safetensors")
        ):
            os.remove(os.path.join(out_dir, entry))


def _save_weights(out_dir: str, tensors: dict[str, torch.Tensor], num_shards: int) -> None:
    metadata = {"format": "pt"}
    if num_shards == 1:
        save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata=metadata)
        return
    names = list(tensors)
    sizes = [tensors[n].numel() * tensors[n].element_size() for n in names]
    assignment = _shard_assignment(sizes, num_shards)
    weight_map: dict[str, str] = {}
    for shard in range(num_shards):
        fname = f"model-{shard + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {n: tensors[n] for n, s in zip(names, assignment, strict=True) if s == shard}
        save_file(part, os.path.join(out_dir, fname), metadata=metadata)
        weight_map.update(dict.fromkeys(part, fname))
    index = {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}
    _write_json(os.path.join(out_dir, "model.safetensors.index.json"), index)


def _write_json(path: str, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")


def init_tiny(
    out_dir: str, arch: str = "llama", seed: int = 0, *, num_shards: int = 1, **overrides: Any
) -> str:
    """Write a small random checkpoint for `arch` into `out_dir` (created if needed) and return `out_dir`.

    `overrides` replace config.json fields (e.g. num_hidden_layers=3); the special key `dtype`
    ("float32", "bfloat16" or "float16") picks the saved weight dtype. Only torch, safetensors and
    tokenizers are used, so this works without transformers installed.
    """
    if arch not in _ARCH_DEFAULTS:
        raise ValueError(f"init_tiny: unknown arch {arch!r}; choose one of {', '.join(ARCHS)}")
    if not isinstance(num_shards, int) or num_shards < 1:
        raise ValueError(f"init_tiny: num_shards={num_shards!r} must be a positive integer")
    overrides = dict(overrides)
    dtype_name = str(overrides.pop("dtype", overrides.pop("torch_dtype", "float32")))
    if dtype_name not in _DTYPES:
        raise ValueError(f"init_tiny: dtype={dtype_name!r} is not supported; use one of {', '.join(_DTYPES)}")

    tokenizer_json = tiny_tokenizer_json()
    tok_vocab = HFTokenizer.from_str(tokenizer_json).get_vocab_size(with_added_tokens=True)
    config = _build_config(arch, tok_vocab, overrides, dtype_name)
    tensors = _random_weights(arch, config, seed, _DTYPES[dtype_name])
    if num_shards > len(tensors):
        raise ValueError(
            f"init_tiny: num_shards={num_shards} exceeds the {len(tensors)} tensors of this model; "
            "use fewer shards"
        )

    os.makedirs(out_dir, exist_ok=True)
    _remove_stale_weights(out_dir)
    _save_weights(out_dir, tensors, num_shards)
    _write_json(os.path.join(out_dir, "config.json"), config)
    with open(os.path.join(out_dir, "tokenizer.json"), "w", encoding="utf-8") as f:
        f.write(tokenizer_json)
    _write_json(
        os.path.join(out_dir, "tokenizer_config.json"),
        {
            # The generic fast class makes transformers use tokenizer.json exactly as written.
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<s>",
            "eos_token": "</s>",
            "unk_token": "<unk>",
            "pad_token": "<pad>",
            "add_bos_token": True,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": config["max_position_embeddings"],
            "chat_template": TINY_CHAT_TEMPLATE,
        },
    )
    # Llama 3 checkpoints list their stop ids; writing a list for llama3 exercises that form too.
    gen_eos: int | list[int] = [config["eos_token_id"]] if arch == "llama3" else config["eos_token_id"]
    _write_json(
        os.path.join(out_dir, "generation_config.json"),
        {"bos_token_id": config["bos_token_id"], "eos_token_id": gen_eos},
    )
    return out_dir
