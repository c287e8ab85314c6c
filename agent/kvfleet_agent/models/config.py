"""ModelConfig: the architecture facts read from a checkpoint's config.json, checked once."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any

from kvfleet_agent.layers.quant.spec import spec_from_config
from kvfleet_agent.models.config_schema import refuse_unsupported, rope_settings, sliding_window

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
_BY_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "qwen3": "Qwen3ForCausalLM"}


def read_json(path: str) -> dict[str, Any]:
    """A JSON object from disk, with the file named in every error."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} is missing: a Hugging Face model directory needs it") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and options of a Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # rope_type and its parameters, whichever schema config.json used
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool  # Qwen3: RMSNorm over each query and key head before rotary
    tie_word_embeddings: bool
    sliding_window: int | None  # the smallest window of any sliding-attention layer
    torch_dtype: str
    eos_token_ids: tuple[int, ...]
    quantization_config: dict[str, Any] | None = None  # config.json's, checked when read (layers/quant/spec.py)

    def check_tensor_parallel(self, size: int, model: str) -> None:
        """Fail unless every split dimension divides evenly into `size` ranks, naming the field and the sizes that work.

        Heads are split whole (the KV cache is sharded by KV head), and so is the MLP's inner size.
        The vocabulary need not divide: its last shard is simply shorter.
        """
        split = (("num_attention_heads", self.num_heads), ("num_key_value_heads", self.num_kv_heads),
                 ("intermediate_size", self.intermediate_size))
        for field, value in split:
            if value % size:
                common = math.gcd(*(v for _, v in split))
                ok = [str(d) for d in range(1, common + 1) if common % d == 0][:8]
                choices = ok[0] if len(ok) == 1 else f"{', '.join(ok[:-1])} or {ok[-1]}"
                raise ValueError(f"tensor_parallel_size={size} does not divide {field}={value} of {model}; "
                                 f"use {choices}")

    @classmethod
    def from_dir(cls, model_dir: str) -> ModelConfig:
        """Parse model_dir/config.json, naming the field at fault in every error."""
        path = os.path.join(model_dir, "config.json")
        c = read_json(path)
        archs = c.get("architectures") or []
        arch = archs[0] if archs else _BY_MODEL_TYPE.get(c.get("model_type", ""), "")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"{path}: architectures={archs or c.get('model_type')!r} is not supported; "
                             f"kvfleet runs {', '.join(SUPPORTED_ARCHITECTURES)}")
        refuse_unsupported(c, path)
        try:  # an unreadable quantization_config fails here, before any weight is read
            if c.get("quantization_config"):
                spec_from_config(c, None)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None

        def need(key: str) -> Any:
            if key not in c:
                raise ValueError(f"{path} lacks the field {key!r}, which {arch} needs")
            return c[key]

        heads = int(need("num_attention_heads"))
        hidden = int(need("hidden_size"))
        kv_heads = int(c.get("num_key_value_heads") or heads)
        layers = int(need("num_hidden_layers"))
        for key, value in (("num_attention_heads", heads), ("hidden_size", hidden), ("num_key_value_heads", kv_heads)):
            if value < 1:
                raise ValueError(f"{path}: {key}={value} must be a positive integer")
        if heads % kv_heads:
            raise ValueError(f"{path}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
        max_pos = int(c.get("max_position_embeddings", 2048))
        theta, scaling = rope_settings(c, path, max_pos)
        # Biases as each architecture's transformers code builds them, whatever else config.json says.
        attention_bias = bool(c.get("attention_bias", False))
        qkv_bias, o_bias = {"Qwen2ForCausalLM": (True, False), "MistralForCausalLM": (False, False)}.get(
            arch, (attention_bias, attention_bias))
        eos = c.get("eos_token_id")
        return cls(
            architecture=arch,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=int(c.get("head_dim") or hidden // heads),
            max_position_embeddings=max_pos,
            rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=arch == "LlamaForCausalLM" and bool(c.get("mlp_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            sliding_window=sliding_window(c, arch, layers, path),
            torch_dtype=str(c.get("torch_dtype") or c.get("dtype") or "float32"),
            eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
            quantization_config=c.get("quantization_config") or None,
        )
