"""Per-step attention planning shared by every layer: which cache blocks each decode row gathers, which slots count."""

from __future__ import annotations

import torch


def decode_plan(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                max_seq_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """What paged_decode_attention gathers: (flat block index [B * nb], valid-slot mask [B, nb * block_size]).

    It depends only on the step, not the layer, so a model computes it once per step.
    """
    max_len = int(seq_lens.max()) if max_seq_len is None else max_seq_len
    nb = -(-max_len // block_size)
    valid = torch.arange(nb * block_size, device=seq_lens.device) < seq_lens[:, None]
    return block_tables[:, :nb].reshape(-1), valid
