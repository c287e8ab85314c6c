"""config.json's two schemas (transformers 4.x keys, 5.x rope_parameters/layer_types) and the keys kvfleet refuses.

Every key that changes the math is honoured or refused here, with the file, the key and what kvfleet
supports in the message: a checkpoint served with a setting silently dropped gives wrong answers.
Defaults are transformers' own for the architecture, so a key left out means what it means there.
"""

from __future__ import annotations

from typing import Any

from kvfleet_agent.layers.rotary import SUPPORTED_ROPE_TYPES

DEFAULT_ROPE_THETA = 10000.0
# What each scaled rope type needs besides rope_type (transformers' own required keys).
_ROPE_NEEDS = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
               "yarn": ("factor",)}
_ROPE_REFUSED = {
    "dynamic": "dynamic NTK scaling changes the frequencies with each sequence's length at run time",
    "longrope": "LongRoPE keeps separate short and long frequency factors",
}
_LAYER_TYPES = ("full_attention", "sliding_attention")
_DEFAULT_WINDOW = 4096  # Mistral's and Qwen's sliding_window when config.json leaves the key out
_DEFAULT_MAX_WINDOW_LAYERS = 28


def refuse_unsupported(c: dict[str, Any], path: str) -> None:
    """Raise on keys that change the output in ways kvfleet does not compute."""
    act = c.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{path}: hidden_act={act!r} is not supported: kvfleet's MLP is SwiGLU with silu")
    if c.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"{path}: partial_rotary_factor={c['partial_rotary_factor']!r} is not supported: kvfleet "
                         "rotates whole heads (partial_rotary_factor 1.0)")


def rope_settings(c: dict[str, Any], path: str, max_position_embeddings: int) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, the scaling parameters or None) from either schema, validated; raises naming the key."""
    # transformers lets a 4.x rope_scaling win over rope_parameters, and reads theta from either place.
    key = "rope_scaling" if c.get("rope_scaling") else "rope_parameters"
    params = c.get(key) or {}
    if not isinstance(params, dict):
        raise ValueError(f"{path}: {key} must be an object, got {type(params).__name__}")
    if params and all(k in _LAYER_TYPES for k in params):  # nested by layer type (5.x)
        distinct = {repr(sorted(p.items())) for p in params.values() if isinstance(p, dict)}
        if len(distinct) != 1:
            raise ValueError(f"{path}: {key} differs by layer type ({', '.join(params)}): kvfleet runs one rope "
                             "for every layer")
        params = next(p for p in params.values() if isinstance(p, dict))
    params = dict(params)
    theta = float(params.pop("rope_theta", c.get("rope_theta", DEFAULT_ROPE_THETA)))
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"{path}: {key}.partial_rotary_factor={params['partial_rotary_factor']!r} is not supported: "
                         "kvfleet rotates whole heads (partial_rotary_factor 1.0)")
    params.pop("partial_rotary_factor", None)
    kind = str(params.get("rope_type", params.get("type", "default")))
    if kind not in SUPPORTED_ROPE_TYPES:
        why = _ROPE_REFUSED.get(kind, "transformers' Llama, Mistral and Qwen code has no such rope type")
        raise ValueError(f"{path}: {key}.rope_type={kind!r} is not supported ({why}); kvfleet computes "
                         f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    if kind == "default":
        return theta, None
    if kind in ("llama3", "yarn"):
        # As transformers does: a top-level original_max_position_embeddings wins, else the model's length.
        original = c.get("original_max_position_embeddings", params.get("original_max_position_embeddings"))
        params["original_max_position_embeddings"] = original or max_position_embeddings
    missing = [k for k in _ROPE_NEEDS[kind] if params.get(k) is None]
    if missing:
        raise ValueError(f"{path}: {key} with rope_type={kind!r} lacks {', '.join(missing)}")
    params["rope_type"] = kind
    params.pop("type", None)
    return theta, params


def sliding_window(c: dict[str, Any], arch: str, num_layers: int, path: str) -> int | None:
    """The smallest attention window of any layer that slides (None when every layer attends to everything).

    transformers' Llama never slides; Mistral slides on every layer; Qwen2/3 only with
    use_sliding_window, on the layers layer_types names (5.x) or from max_window_layers on (4.x).
    """
    if arch == "LlamaForCausalLM":
        return None
    window = c.get("sliding_window", _DEFAULT_WINDOW)
    if arch != "MistralForCausalLM":
        if not c.get("use_sliding_window", False):
            return None
        types = c.get("layer_types")
        if types is not None:
            if not isinstance(types, list) or len(types) != num_layers or any(t not in _LAYER_TYPES for t in types):
                raise ValueError(f"{path}: layer_types must list one of {', '.join(_LAYER_TYPES)} for each of the "
                                 f"{num_layers} layers (num_hidden_layers)")
            slides = "sliding_attention" in types
        else:
            slides = num_layers > int(c.get("max_window_layers", _DEFAULT_MAX_WINDOW_LAYERS))
        if not slides:
            return None
    if window is None:
        return None
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ValueError(f"{path}: sliding_window={window!r} must be a positive integer or null")
    return window
