"""EngineConfig: every runtime knob of the engine, validated once, with the reason in each error."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvfleet_agent.spec_config import SpeculativeConfig

DTYPES = ("auto", "float32", "bfloat16", "float16")
# vLLM's --quantization names: int8 and int4 quantize an fp checkpoint on load; the others name the format of a
# checkpoint quantized already (config.json's quantization_config says so, the flag may confirm it).
QUANTIZATIONS = ("int8", "int4", "gptq", "awq", "compressed-tensors", "fp8")
# vLLM's --kv-cache-dtype names: auto stores K/V in the model's dtype; int8 and fp8 (E4M3) store them with a
# scale per token and head, about half the bytes of bf16 (a quarter of float32), so the pool holds more tokens.
KV_CACHE_DTYPES = ("auto", "int8", "fp8", "fp8_e4m3")
DEFAULT_TOKEN_BUDGET = {"cpu": 1024, "cuda": 8192}


@dataclass
class EngineConfig:
    """Runtime settings of one engine (one replica).

    Sizes left as None are derived at start-up and written back by `resolve`: max_model_len from
    the checkpoint, max_num_batched_tokens from the device, the KV pool from the memory budget
    (kv_cache_memory_bytes on CPU, gpu_memory_utilization on CUDA). With tensor_parallel_size N the
    model and the KV cache are split over N ranks (devices); memory settings are per rank.
    """

    model: str
    tokenizer: str | None = None  # a directory with tokenizer.json (and its configs); None: the model's (vLLM's)
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 128
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    seed: int = 0
    num_threads: int | None = None  # torch threads per rank; CPU default: usable cores (cpu_budget) per rank
    tensor_parallel_size: int = 1
    enforce_eager: bool = False  # as vLLM: never capture CUDA graphs (decode steps launch every kernel each time)
    # vLLM's --speculative-config (JSON text, a mapping, or parsed); None: no speculation.
    speculative_config: SpeculativeConfig | str | Mapping[str, Any] | None = None
    quantization: str | None = None  # one of QUANTIZATIONS; None: as the checkpoint is (quantized or not)
    kv_cache_dtype: str = "auto"  # one of KV_CACHE_DTYPES

    def __post_init__(self) -> None:
        def bad(name: str, rule: str) -> ValueError:
            return ValueError(f"engine option {name}={getattr(self, name)!r} is invalid: {rule}")

        if self.dtype not in DTYPES:
            raise bad("dtype", f"choose one of {', '.join(DTYPES)}")
        if self.tokenizer is not None and not os.path.isdir(self.tokenizer):
            raise bad("tokenizer", "name a directory holding tokenizer.json, or leave it unset (the model's)")
        if self.device not in ("auto", "cpu") and not self.device.startswith("cuda"):
            raise bad("device", "choose auto, cpu or cuda[:N]")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "tensor_parallel_size"):
            value = getattr(self, name)
            if value is None and name == "max_num_batched_tokens":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise bad(name, "it must be a positive integer")
        if self.block_size & (self.block_size - 1) or self.block_size > 256:
            raise bad("block_size", "use a power of two up to 256 (16 is the usual choice)")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise bad("max_model_len", "it must be at least 2 tokens")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise bad("kv_cache_memory_bytes", "give a positive number of bytes, or leave it unset")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise bad("gpu_memory_utilization", "use a fraction in (0, 1]")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise bad("quantization", f"choose one of {', '.join(QUANTIZATIONS)}, or leave it unset")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise bad("kv_cache_dtype", f"choose one of {', '.join(KV_CACHE_DTYPES)}")
        if not isinstance(self.enforce_eager, bool):
            raise bad("enforce_eager", "use true or false")
        if self.speculative_config is not None and not isinstance(self.speculative_config, SpeculativeConfig):
            self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        self._check_whole_prompts_fit()

    def resolve(self, device_type: str, max_model_len: int) -> None:
        """Fill in the sizes derived from the device and checkpoint, then check the rules that need them."""
        self.max_model_len = max_model_len
        if self.max_num_batched_tokens is None:
            # Measured best for the CPU bench (see BENCHMARKS.md); GPUs want far larger steps.
            self.max_num_batched_tokens = DEFAULT_TOKEN_BUDGET.get(device_type, 8192)
        self._check_whole_prompts_fit()

    def _check_whole_prompts_fit(self) -> None:
        budget, limit = self.max_num_batched_tokens, self.max_model_len
        if not self.enable_chunked_prefill and budget is not None and limit is not None and limit > budget:
            raise ValueError(f"engine option max_num_batched_tokens={budget} is invalid: without chunked prefill "
                             f"it must be >= max_model_len ({limit}), so that a whole prompt fits in one step; "
                             "raise it or enable chunked prefill")

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> EngineConfig:
        """Build from keyword options, naming any unknown option and listing the known ones."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(model=model, **kwargs)
