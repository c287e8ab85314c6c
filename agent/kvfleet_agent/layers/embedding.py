"""Token embedding and LM head, split along the vocabulary across tensor-parallel ranks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvfleet_agent.layers.linear import attach_loader, can_pack, linear, pack


class VocabParallelEmbedding(nn.Module):
    """Embedding whose rows (the vocabulary) are split into one contiguous range per rank."""

    def __init__(self, vocab_size: int, hidden: int, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.vocab_size = vocab_size
        self.per_rank = -(-vocab_size // tp_size)
        self.start = tp_rank * self.per_rank
        rows = max(0, min(self.per_rank, vocab_size - self.start))
        self.weight = attach_loader(nn.Parameter(torch.empty(rows, hidden), requires_grad=False), self.load)

    def load(self, param: nn.Parameter, loaded: torch.Tensor, shard: int | str | None = None) -> None:
        if loaded.shape[0] != self.vocab_size or loaded.shape[1] != param.shape[1]:
            raise ValueError(f"embedding tensor has shape {tuple(loaded.shape)}, config.json says "
                             f"vocab_size={self.vocab_size}, hidden_size={param.shape[1]}")
        param.data.copy_(loaded.narrow(0, self.start, param.shape[0]))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill_(outside[:, None], 0.0)
        torch.distributed.all_reduce(out)
        return out


class ParallelLMHead(VocabParallelEmbedding):
    """Hidden states → logits over the full vocabulary (each rank computes its slice, then gather)."""

    packed: torch.Tensor | None = None

    def pack_weights(self) -> None:
        """Prepack the (possibly tied) weight for the CPU fast path."""
        self.packed = pack(self.weight) if can_pack(self.weight) else None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = linear(hidden, self.weight, packed=self.packed)
        if self.tp_size == 1:
            return logits
        parts = [torch.empty(hidden.shape[0], self.per_rank, dtype=logits.dtype, device=logits.device)
                 for _ in range(self.tp_size)]
        torch.distributed.all_gather(parts, F.pad(logits, (0, self.per_rank - logits.shape[1])))
        return torch.cat(parts, dim=1)[:, :self.vocab_size]
