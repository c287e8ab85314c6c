"""SpeculativeConfig: vLLM's --speculative-config JSON (method, num_speculative_tokens, model, prompt lookup bounds,
suffix decoding's cache), validated once, with every refusal naming the key and the fix."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "suffix", "draft_model")
MODEL_FREE = ("ngram", "suffix")  # proposers that look tokens up rather than run a model
# vLLM's other methods: refused by name (they need trained heads this engine does not load yet).
NOT_YET = ("eagle", "eagle3", "medusa", "mlp_speculator", "mtp", "deepseek_mtp")
MAX_SPECULATIVE_TOKENS = 16
SUFFIX_KEYS = ("suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests",
               "suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob",
               "suffix_decoding_max_cached_tokens")
KEYS = ("method", "num_speculative_tokens", "model", "prompt_lookup_min", "prompt_lookup_max",
        "disable_by_batch_size", "adaptive", "draft_tensor_parallel_size", "disable_log_stats", *SUFFIX_KEYS)


@dataclass(frozen=True)
class SpeculativeConfig:
    """How the engine speculates: a proposer (n-gram prompt lookup, suffix decoding, or a draft model sharing the
    target's vocabulary) guesses up to num_speculative_tokens tokens, which the target verifies in one pass."""

    method: str
    num_speculative_tokens: int
    model: str | None = None  # the draft model's directory (draft_model)
    prompt_lookup_min: int = 5  # n-gram bounds (vLLM's defaults: both 5; one given sets the other)
    prompt_lookup_max: int = 5
    disable_by_batch_size: int | None = None  # vLLM's switch: no speculation with this many running decodes
    adaptive: bool = True  # ours: per-step drafts from measured acceptance and step cost (spec_policy.py)
    # Suffix decoding (vLLM's keys). The depth is the longest context matched; vLLM's 24 counts match and
    # speculation together in a C++ tree. Here each token indexed walks `depth` Python trie nodes in two tries, and
    # on the trained pair depth 4, 8, 16 and 24 yield 2.88, 2.93, 2.96, 2.96 tokens a verification (k 4): 8 keeps
    # the acceptance at a third of 24's cost. Past max_cached_requests finished outputs, or max_cached_tokens of
    # their tokens (ours: a cached token costs ~220 B in the shared trie on the trained pair's outputs, up to ~3.5 KB
    # where no context repeats, so 10,000 long outputs alone could take gigabytes), the oldest is evicted.
    suffix_max_tree_depth: int = 8
    suffix_max_cached_requests: int = 10_000
    suffix_max_cached_tokens: int = 200_000
    suffix_max_spec_factor: float = 1.0  # a match of n tokens may propose at most factor x n
    suffix_min_token_prob: float = 0.1  # stop where the chain's estimated probability falls below this

    @staticmethod
    def parse(raw: str | Mapping[str, Any]) -> SpeculativeConfig:
        """The JSON text (or an already-parsed mapping) of --speculative-config / LLM(speculative_config=...)."""
        where = "speculative_config"
        if isinstance(raw, str):
            try:
                raw = json.loads(raw)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where} is not JSON ({e}): give e.g. "
                                 "'{\"method\": \"ngram\", \"num_speculative_tokens\": 3}'") from e
        if not isinstance(raw, Mapping):
            raise ValueError(f"{where} must be a JSON object with method and num_speculative_tokens")
        unknown = sorted(set(raw) - set(KEYS))
        if unknown:
            raise ValueError(f"{where}.{unknown[0]} is not supported here; supported keys: {', '.join(KEYS)}")
        model = raw.get("model")
        method = raw.get("method") or ("draft_model" if model else None)
        if method in NOT_YET:
            raise ValueError(f"{where}.method={method!r} is not implemented yet: use 'ngram' (prompt lookup, no "
                             "extra model), 'suffix' (lookup over the request and earlier outputs) or 'draft_model' (a "
                             "small model sharing the target's vocabulary)")
        if method not in METHODS:
            raise ValueError(f"{where}.method={method!r} is not one of {', '.join(METHODS)}")
        # Required for every method, suffix too (vLLM defaults it to the tree depth there): the CRD requires it, and
        # on CPU each draft row is a row of the verification's arithmetic, so k is a cost to choose, not a default.
        k = raw.get("num_speculative_tokens")
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"{where}.num_speculative_tokens={k!r} must be an integer from 1 to "
                             f"{MAX_SPECULATIVE_TOKENS}: 3 to 5 is typical")
        if method == "draft_model" and not (isinstance(model, str) and model):
            raise ValueError(f"{where}.model: method 'draft_model' needs the draft checkpoint's directory")
        if method in MODEL_FREE and model is not None:
            raise ValueError(f"{where}.model is set but method is {method!r}, which uses no model: drop one of them")
        lo, hi = raw.get("prompt_lookup_min"), raw.get("prompt_lookup_max")
        for key, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{where}.{key}={v!r} must be an integer >= 1")
        lo, hi = (lo or hi or 5), (hi or lo or 5)
        if lo > hi:
            raise ValueError(f"{where}.prompt_lookup_min={lo} is above prompt_lookup_max={hi}: swap them")
        if method != "ngram" and (raw.get("prompt_lookup_min") is not None or raw.get("prompt_lookup_max") is not None):
            raise ValueError(f"{where}.prompt_lookup_min/max apply to method 'ngram' only: drop them")
        tp = raw.get("draft_tensor_parallel_size")
        if tp not in (None, 1):
            raise ValueError(f"{where}.draft_tensor_parallel_size={tp!r}: the draft model runs unsharded on rank 0; "
                             "use 1 or leave it out")
        off = raw.get("disable_by_batch_size")
        if off is not None and (isinstance(off, bool) or not isinstance(off, int) or off < 1):
            raise ValueError(f"{where}.disable_by_batch_size={off!r} must be an integer >= 1")
        adaptive = raw.get("adaptive", True)
        if not isinstance(adaptive, bool):
            raise ValueError(f"{where}.adaptive={adaptive!r} must be true or false")
        suffix = _suffix_options(raw, method, where)
        return SpeculativeConfig(method, k, model if method == "draft_model" else None, lo, hi, off, adaptive, **suffix)

    def describe(self) -> str:
        """One line for the start-up log."""
        what = {"ngram": f"n-gram prompt lookup (n {self.prompt_lookup_min}-{self.prompt_lookup_max})",
                "suffix": f"suffix decoding (depth {self.suffix_max_tree_depth}, "
                          f"{self.suffix_max_cached_requests} outputs shared)"}.get(self.method,
                                                                                 f"draft model {self.model}")
        return (f"speculative decoding: {what}, up to {self.num_speculative_tokens} token(s) a step, "
                f"{'adaptive' if self.adaptive else 'fixed'}"
                + (f", off at {self.disable_by_batch_size}+ running" if self.disable_by_batch_size else ""))


def _suffix_options(raw: Mapping[str, Any], method: str, where: str) -> dict[str, Any]:
    """The suffix_decoding_* keys as SpeculativeConfig fields (only with method 'suffix')."""
    given = [key for key in SUFFIX_KEYS if raw.get(key) is not None]
    if method != "suffix":
        if given:
            raise ValueError(f"{where}.{given[0]} applies to method 'suffix' only: drop it")
        return {}
    out: dict[str, Any] = {}
    for key, field, low, high, kind in (
            ("suffix_decoding_max_tree_depth", "suffix_max_tree_depth", 1, 64, int),
            ("suffix_decoding_max_cached_requests", "suffix_max_cached_requests", 0, 1_000_000, int),
            ("suffix_decoding_max_spec_factor", "suffix_max_spec_factor", 0.0, 64.0, float),
            ("suffix_decoding_min_token_prob", "suffix_min_token_prob", 0.0, 1.0, float),
            ("suffix_decoding_max_cached_tokens", "suffix_max_cached_tokens", 0, 100_000_000, int)):
        v = raw.get(key)
        if v is None:
            continue
        ok = not isinstance(v, bool) and isinstance(v, int if kind is int else (int, float)) and low <= v <= high
        if not ok:
            raise ValueError(f"{where}.{key}={v!r} must be {'an integer' if kind is int else 'a number'} from {low} "
                             f"to {high}")
        out[field] = kind(v)
    return out
