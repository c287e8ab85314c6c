"""Small Llamas made and saved by transformers itself, for tests that must not read only our own writer's output."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def hf_llama(seed: int, hidden: int, intermediate: int, *, tie: bool, max_positions: int = 128,
             sharpen: bool = True) -> Any:
    """A 2-layer transformers LlamaForCausalLM (4 heads, 2 KV heads, vocabulary 512) from `seed`; `sharpen` scales
    its matrices by 4 so that greedy choices have clear winners rather than float-rounding coin flips."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                                      max_position_embeddings=max_positions, tie_word_embeddings=tie)
    model = transformers.LlamaForCausalLM(config)
    if sharpen:
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 2:
                    p.mul_(4.0)
    return model


def copy_tokenizer(src: str | Path, dst: Path) -> str:
    """Put src's tokenizer files into checkpoint dir dst (the engine loads a tokenizer with every model)."""
    for name in TOKENIZER_FILES:
        shutil.copy(Path(src) / name, dst / name)
    return str(dst)


def save_hf_llama(out: Path, tokenizer_from: str | Path, seed: int, hidden: int, intermediate: int, *, tie: bool,
                  max_positions: int = 128, sharpen: bool = True) -> Path:
    """hf_llama(...) written by save_pretrained into out, with a tokenizer beside it."""
    hf_llama(seed, hidden, intermediate, tie=tie, max_positions=max_positions, sharpen=sharpen).save_pretrained(out)
    copy_tokenizer(tokenizer_from, out)
    return out
