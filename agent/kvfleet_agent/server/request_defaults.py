"""--generation-config: request defaults from a checkpoint's generation_config.json, applied as vLLM applies them."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, replace
from typing import Any

from kvfleet_agent.sampling_params import SamplingParams

# The fields vLLM takes from generation_config.json (get_diff_sampling_param), as SamplingParams names them.
_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# transformers' GenerationConfig defaults: vLLM reads the file through to_diff_dict(), so a value equal to one of
# these is no default at all (a file that spells out top_k 50 leaves top_k off, in vLLM and here).
_TRANSFORMERS_DEFAULTS: dict[str, Any] = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0}


@dataclass(frozen=True)
class RequestDefaults:
    """Sampling values a request gets for the fields it omits, and the max_new_tokens cap."""

    sampling: dict[str, float | int] = field(default_factory=dict)
    max_new_tokens: int | None = None  # as vLLM: an upper bound on every request's max_tokens, asked or defaulted
    source: str | None = None  # the file they came from, for the start-up log

    def omitted(self, asked: dict[str, Any]) -> dict[str, Any]:
        """`asked` (SamplingParams field → value, None when the request omitted it) with the defaults filled in."""
        return {**self.sampling, **{k: v for k, v in asked.items() if v is not None}}

    def cap(self, params: SamplingParams) -> SamplingParams:
        """params with max_tokens no larger than max_new_tokens."""
        if self.max_new_tokens is None or params.max_tokens <= self.max_new_tokens:
            return params
        return replace(params, max_tokens=self.max_new_tokens)

    def describe(self) -> str:
        """The defaults in one line (vLLM logs them at start-up too)."""
        parts = [f"{k}={v}" for k, v in self.sampling.items()]
        if self.max_new_tokens is not None:
            parts.append(f"max_tokens<={self.max_new_tokens}")
        return ", ".join(parts)


def load_request_defaults(value: str, model: str) -> RequestDefaults:
    """--generation-config: 'vllm' (none), 'auto' (the model directory's file, if any) or a directory's file."""
    if value == "vllm":
        return RequestDefaults()
    folder = model if value == "auto" else value
    path = os.path.join(folder, "generation_config.json")
    if not os.path.isfile(path):
        if value == "auto":  # as vLLM: a checkpoint without the file keeps the built-in defaults
            return RequestDefaults()
        raise ValueError(f"--generation-config {value}: there is no generation_config.json in that directory; "
                         "give a directory that has one, 'auto' (the model's) or 'vllm' (none)")
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"--generation-config: {path} cannot be read as JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"--generation-config: {path} must hold a JSON object")
    return _defaults_of(raw, path)


def _defaults_of(raw: dict[str, Any], path: str) -> RequestDefaults:
    sampling: dict[str, float | int] = {}
    for name in _SAMPLING:
        v = raw.get(name)
        if v is None or (name in _TRANSFORMERS_DEFAULTS and v == _TRANSFORMERS_DEFAULTS[name]):
            continue
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            raise ValueError(f"--generation-config: {path}: {name}={v!r} is not a number")
        sampling[name] = int(v) if name == "top_k" else float(v)
    try:  # checked once here, so that a bad file fails the start, not every request that omits the field
        SamplingParams(**dict[str, Any](sampling))
    except ValueError as e:
        raise ValueError(f"--generation-config: {path}: {str(e).removeprefix('SamplingParams.')}") from None
    cap = raw.get("max_new_tokens")
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
        raise ValueError(f"--generation-config: {path}: max_new_tokens={cap!r} must be a positive integer")
    return RequestDefaults(sampling, cap, path)
