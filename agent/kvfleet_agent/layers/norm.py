"""RMSNorm, with the residual add fused in when one is passed."""

from __future__ import annotations

import torch
from torch import nn

from kvfleet_agent.layers.linear import attach_loader, check_shape
from kvfleet_agent.layers.weights import CheckpointTensor
from kvfleet_kernels import dispatch  # Triton on CUDA, the PyTorch reference elsewhere


def _load(param: nn.Parameter, loaded: CheckpointTensor, shard: str | None = None) -> None:
    check_shape(loaded, tuple(param.shape), "a norm weight")  # norms are replicated: every rank reads all
    param.data.copy_(loaded.read())


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (Llama); forward(x, residual) also returns the new residual."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = attach_loader(nn.Parameter(torch.ones(size), requires_grad=False), _load)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return dispatch.rms_norm(x, self.weight, self.eps), x
        return dispatch.add_rms_norm(x, residual, self.weight, self.eps)
