"""transformers' own greedy decoding: the reference our engine's greedy tokens must equal, from a checkpoint that
transformers loads itself."""

from __future__ import annotations

from functools import cache

import torch
from transformers import AutoModelForCausalLM


@cache
def _hf_model(path: str) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.inference_mode()
def hf_greedy(path: str, prompt: list[int], n: int) -> list[int]:
    """transformers' own greedy continuation, one request at a time (no padding to blur it)."""
    model = _hf_model(path)
    ids, past, out = torch.tensor([prompt]), None, []
    for _ in range(n):
        r = model(input_ids=ids, past_key_values=past, use_cache=True)
        past = r.past_key_values
        out.append(int(r.logits[0, -1].argmax()))
        ids = torch.tensor([[out[-1]]])
    return out
