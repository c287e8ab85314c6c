"""Shared by the LLM.generate tests: engine options for the tiny checkpoint, prompts, and request helpers."""

from __future__ import annotations

from typing import Any

from kvfleet_agent.llm import LLM, Prompt
from kvfleet_agent.outputs import CompletionOutput
from kvfleet_agent.sampling_params import SamplingParams

MAX_MODEL_LEN = 128
ENGINE_OPTIONS: dict[str, Any] = {
    "kv_cache_memory_bytes": 4 << 20,
    "max_num_seqs": 16,
    "max_num_batched_tokens": 256,
    "max_model_len": MAX_MODEL_LEN,
    "enable_prefix_caching": True,
    "block_size": 16,
}
PROMPTS = ["The quick brown fox", "hello world", "one two three four five", "café naïve Straße"]


def greedy(max_tokens: int = 16, **kw: Any) -> SamplingParams:
    """Greedy decoding of exactly max_tokens tokens (EOS ignored)."""
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def one(llm: LLM, prompt: Prompt, params: SamplingParams) -> CompletionOutput:
    """The completion of a single prompt."""
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    return out.outputs[0]


def tokens(llm: LLM, prompts: list[str], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
    """The generated token ids of each prompt."""
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
