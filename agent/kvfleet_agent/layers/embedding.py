"""Token embedding and LM head, split along the vocabulary across tensor-parallel ranks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvfleet_agent.layers.gemm_crossover import HEAD_COPY_MAX, NEVER
from kvfleet_agent.layers.linear import SINGLE, attach_loader, can_pack, few_row_path, few_rows, linear, pack
from kvfleet_agent.layers.tp_group import TPGroup
from kvfleet_agent.layers.weights import CheckpointTensor


class VocabParallelEmbedding(nn.Module):
    """Embedding whose rows (the vocabulary) are split into one contiguous range per rank.

    The vocabulary need not divide by the group size: every rank's range is ceil(V / N) rows, and
    the last rank's is cut short at V.
    """

    def __init__(self, vocab_size: int, hidden: int, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.per_rank = -(-vocab_size // tp.size)
        self.start = tp.rank * self.per_rank
        rows = max(0, min(self.per_rank, vocab_size - self.start))
        self.weight = attach_loader(nn.Parameter(torch.empty(rows, hidden), requires_grad=False), self.load)

    def load(self, param: nn.Parameter, loaded: CheckpointTensor, shard: str | None = None) -> None:
        if loaded.shape != (self.vocab_size, param.shape[1]):
            raise ValueError(f"embedding tensor has shape {loaded.shape}, config.json says "
                             f"vocab_size={self.vocab_size}, hidden_size={param.shape[1]}")
        param.data.copy_(loaded.narrow(0, self.start, param.shape[0]))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        # Rows outside this rank's range come out zero; the all-reduce fills them from their owner
        # (adding exact zeros, so the result is bit-identical to a single rank's lookup).
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill_(outside[:, None], 0.0)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Hidden states → logits over the full vocabulary (each rank computes its slice, then gather)."""

    packed: torch.Tensor | None = None
    tied = False  # the model shares this weight with its embedding table (which still reads it)
    # Rows below which the few-row path runs: a step's head reads one row a decode, where oneDNN's packed call costs
    # more than the read (a 4,096 x 256 head: 180 us in a step against 110). A row's logits then depend on how many
    # rows share its call: the runner passes the sample rows alone, so a completion's logits do not change when a
    # request beside it, or the request itself (echo), also asks for prompt logprobs.
    few_below = NEVER
    tiles: torch.Tensor | None = None

    def pack_weights(self) -> None:
        """Prepack the (possibly tied) weight for the CPU fast path, and the few-row path's copy where it wins and the
        weight is at most HEAD_COPY_MAX; an untied weight then keeps only those copies."""
        self.packed = pack(self.weight) if can_pack(self.weight) else None
        if self.packed is not None:
            self.tiles, self.few_below = few_row_path(self.weight, self.packed, HEAD_COPY_MAX)
        if self.packed is not None and not self.tied and (self.few_below == NEVER or self.tiles is not None):
            self.weight = nn.Parameter(torch.empty_like(self.weight, device="meta"), requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if hidden.shape[0] < self.few_below:
            logits = few_rows(hidden, self.weight, self.tiles, None)
        else:
            logits = linear(hidden, self.weight, packed=self.packed)
        if self.tp.size == 1:
            return logits
        # Each rank's slice is padded to the common width so the gather moves equal shapes.
        parts = self.tp.all_gather(F.pad(logits, (0, self.per_rank - logits.shape[1])))
        return torch.cat(parts, dim=1)[:, :self.vocab_size]
