"""Logits processing in batched tensor form: logit_bias, min_tokens, repetition, frequency and presence penalties."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvfleet_agent.core.scheduler_output import TokenHistory
from kvfleet_agent.sampling_params import SamplingParams


def process_logits(logits: torch.Tensor, rows: list[int], params: Sequence[SamplingParams],
                   histories: Sequence[TokenHistory | None]) -> torch.Tensor:
    """Apply each listed row's processing to logits [N, V] in place (vLLM's order) and return it.

    Every kind is one batched operation over the rows that use it: a scatter for the biases and masks,
    a scatter-add for the token counts. Building the counts reads each penalised request's tokens once
    per step (as vLLM does), which is why only rows with a penalty set pay for it.
    """
    vocab = logits.shape[-1]
    dev = logits.device
    bias_rows, bias_ids, bias_vals = [], [], []
    mask_rows, mask_ids = [], []
    penalised = []
    for r in rows:
        p, h = params[r], histories[r]
        for token, bias in p.logit_bias.items():
            if token < vocab:  # ids are checked against the model's vocabulary on the way in; padding rows exceed it
                bias_rows.append(r)
                bias_ids.append(token)
                bias_vals.append(bias)
        if h is not None and p.min_tokens and len(h.token_ids) - h.num_prompt_tokens < p.min_tokens:
            # EOS and the stop tokens may not end the output before min_tokens (vLLM's MinTokensLogitsProcessor)
            banned = [t for t in (*h.eos_token_ids, *p.stop_token_ids) if t < vocab]
            mask_rows += [r] * len(banned)
            mask_ids += banned
        if h is not None and (p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0):
            penalised.append(r)
    if bias_rows:
        logits.index_put_((_ints(bias_rows, dev), _ints(bias_ids, dev)),
                          torch.tensor(bias_vals, dtype=logits.dtype, device=dev), accumulate=True)
    if mask_rows:
        logits[_ints(mask_rows, dev), _ints(mask_ids, dev)] = float("-inf")
    if penalised:
        idx = _ints(penalised, dev)
        logits[idx] = _penalise(logits[idx], [params[r] for r in penalised],
                                [h for h in (histories[r] for r in penalised) if h is not None])
    return logits


def _penalise(logits: torch.Tensor, params: list[SamplingParams], histories: list[TokenHistory]) -> torch.Tensor:
    """vLLM's penalties: repetition over prompt and output tokens; frequency and presence over the output only."""
    n, vocab = logits.shape
    dev = logits.device
    out_rows, out_ids, seen_rows, seen_ids = [], [], [], []
    for row, h in enumerate(histories):
        output = h.token_ids[h.num_prompt_tokens:]
        out_rows += [row] * len(output)
        out_ids += output
        seen_rows += [row] * len(h.token_ids)
        seen_ids += h.token_ids
    counts = torch.zeros((n, vocab), dtype=logits.dtype, device=dev)
    counts.index_put_((_ints(out_rows, dev), _ints(out_ids, dev)), torch.ones(len(out_ids), dtype=logits.dtype,
                                                                              device=dev), accumulate=True)
    seen = torch.zeros((n, vocab), dtype=torch.bool, device=dev)
    seen[_ints(seen_rows, dev), _ints(seen_ids, dev)] = True
    rep = torch.tensor([p.repetition_penalty for p in params], dtype=logits.dtype, device=dev)[:, None]
    # Repetition (HF/vLLM): a seen token's positive logit is divided by the penalty, a negative one multiplied.
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    freq = torch.tensor([p.frequency_penalty for p in params], dtype=logits.dtype, device=dev)[:, None]
    pres = torch.tensor([p.presence_penalty for p in params], dtype=logits.dtype, device=dev)[:, None]
    return logits - freq * counts - pres * (counts > 0).to(logits.dtype)


def _ints(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)
