"""What tests read off an engine for a list of token prompts: every prompt token's logprob, greedy continuations."""

from __future__ import annotations

import torch

from kvfleet_agent import LLM, SamplingParams


def prompt_logprobs(llm: LLM, prompts: list[list[int]]) -> torch.Tensor:
    """Every prompt token's logprob after the first (each one read the K/V of those before it)."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=1, prompt_logprobs=0),
                        use_tqdm=False)
    return torch.tensor([lp.logprob for o in outs for lp in (o.prompt_logprobs or [])[1:] if lp is not None])


def greedy(llm: LLM, prompts: list[list[int]], n: int) -> list[list[int]]:
    """n greedy tokens after each prompt (EOS ignored)."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]
