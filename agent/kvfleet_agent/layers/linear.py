"""Linear layers that load their own weights from Hugging Face tensors, packed and shard-aware.

Each parameter carries a `weight_loader`, so the checkpoint loader stays generic and a model file
only declares which checkpoint names are packed together. Tensor parallelism (Megatron style)
shards along the output (column) or input (row) dimension: a column-parallel layer feeding a
row-parallel one needs a single all-reduce, after the row-parallel matmul. Loaders read only this
rank's rows or columns from the checkpoint. With a group of one these are plain linears.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from kvfleet_agent.layers.tp_group import TPGroup
from kvfleet_agent.layers.weights import CheckpointTensor

WeightLoader = Callable[[nn.Parameter, CheckpointTensor, str | None], None]
SINGLE = TPGroup()  # the default group: one rank, collectives are no-ops


# On x86 CPUs oneDNN's fp32 inner product on a prepacked weight runs 2-2.5x faster than the MKL sgemm
# behind F.linear (measured on the 2-core AMD EPYC here, M = 1..2048: MKL takes its AVX2 path on AMD,
# oneDNN uses AVX-512). Results are fp32 to within 1e-6 relative. See BENCHMARKS.md.
PACK_FOR_ROWS = 64  # the batch size the blocked layout is tuned for; any M runs on it


def can_pack(weight: torch.Tensor) -> bool:
    """Whether this weight can use the prepacked oneDNN path (fp32 on a CPU build with oneDNN)."""
    return (weight.device.type == "cpu" and weight.dtype == torch.float32
            and torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def pack(weight: torch.Tensor) -> torch.Tensor:
    """A oneDNN-blocked copy of weight [out, in] for `linear(..., packed=...)`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, PACK_FOR_ROWS)  # type: ignore[no-any-return]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: torch.Tensor | None = None) -> torch.Tensor:
    """y = x·Wᵀ + b, through the prepacked oneDNN weight when there is one."""
    if packed is not None:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")  # type: ignore[no-any-return]
    return F.linear(x, weight, bias)


def attach_loader(param: nn.Parameter, loader: WeightLoader) -> nn.Parameter:
    """Give a parameter its weight loader (read back by models/loader.py)."""
    param.weight_loader = loader  # type: ignore[attr-defined]
    return param


def split(size: int, tp: TPGroup, what: str) -> int:
    """This rank's share of a dimension that must divide evenly across the group."""
    if size % tp.size:
        raise ValueError(f"tensor_parallel_size={tp.size} does not divide {what}={size}")
    return size // tp.size


class _Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.weight = attach_loader(nn.Parameter(torch.empty(out_features, in_features), requires_grad=False),
                                    self.load)
        self.bias = (attach_loader(nn.Parameter(torch.empty(out_features), requires_grad=False), self.load)
                     if bias else None)
        self.packed: torch.Tensor | None = None

    def pack_weights(self) -> None:
        """Prepack the loaded weight for the CPU fast path (call again after reloading weights)."""
        self.packed = pack(self.weight) if can_pack(self.weight) else None

    def load(self, param: nn.Parameter, loaded: CheckpointTensor, shard: str | None = None) -> None:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed)


def check_shape(loaded: torch.Tensor | CheckpointTensor, expected: tuple[int, ...], name: str) -> None:
    """Fail with both shapes named when a checkpoint tensor does not fit its parameter."""
    if tuple(loaded.shape) != expected:
        raise ValueError(f"checkpoint tensor for {name} has shape {tuple(loaded.shape)}, "
                         f"the model expects {expected}: does config.json match the weights?")


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    check_shape(src, tuple(dst.shape), name)
    dst.copy_(src)


def _full(param: nn.Parameter, dim: int, size: int) -> tuple[int, ...]:
    """The unsharded shape of a parameter whose dimension `dim` has `size` entries on each rank."""
    shape = list(param.shape)
    shape[dim] = size
    return tuple(shape)


class ColumnParallelLinear(_Linear):
    """y = xAᵀ with A's rows (outputs) split across ranks; no communication."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, tp: TPGroup = SINGLE) -> None:
        super().__init__(in_features, split(out_features, tp, "out_features"), bias, tp)

    def load(self, param: nn.Parameter, loaded: CheckpointTensor, shard: str | None = None) -> None:
        n = param.shape[0]
        # Check the whole tensor before cutting this rank's share, or a too-large one would fit.
        check_shape(loaded, _full(param, 0, n * self.tp.size), "a column-parallel layer")
        _copy(param.data, loaded.narrow(0, self.tp.rank * n, n), "a column-parallel layer")


class MergedColumnParallelLinear(_Linear):
    """Several column-parallel linears packed into one matmul (gate+up, or q+k+v)."""

    def __init__(self, in_features: int, out_sizes: Sequence[int], bias: bool = False, tp: TPGroup = SINGLE,
                 shard_names: Sequence[str] | None = None) -> None:
        self.shard_names = list(shard_names) if shard_names else [str(i) for i in range(len(out_sizes))]
        # Each rank holds its slice of every packed part: [q_r; k_r; v_r], not a slice of [q; k; v].
        self.out_sizes = [split(s, tp, f"the {name} part's size") for s, name in zip(out_sizes, self.shard_names,
                                                                                  strict=True)]
        super().__init__(in_features, sum(self.out_sizes), bias, tp)

    def load(self, param: nn.Parameter, loaded: CheckpointTensor, shard: str | None = None) -> None:
        idx = self.shard_names.index(str(shard))
        n = self.out_sizes[idx]
        check_shape(loaded, _full(param, 0, n * self.tp.size), f"packed shard {shard}")
        dst = param.data.narrow(0, sum(self.out_sizes[:idx]), n)
        _copy(dst, loaded.narrow(0, self.tp.rank * n, n), f"packed shard {shard}")


class QKVParallelLinear(MergedColumnParallelLinear):
    """Query, key and value projections in one matmul; heads split across ranks."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False,
                 tp: TPGroup = SINGLE) -> None:
        # Whole heads per rank: split the head counts, not the rows, so a head is never cut in two.
        split(num_heads, tp, "num_attention_heads")
        split(num_kv_heads, tp, "num_key_value_heads")
        super().__init__(hidden, [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim],
                         bias, tp, shard_names=("q", "k", "v"))


class RowParallelLinear(_Linear):
    """y = xAᵀ with A's columns (inputs) split across ranks; the partial sums are all-reduced."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, tp: TPGroup = SINGLE) -> None:
        super().__init__(split(in_features, tp, "in_features"), out_features, bias, tp)

    def load(self, param: nn.Parameter, loaded: CheckpointTensor, shard: str | None = None) -> None:
        if param.dim() == 1:  # the bias is added once (by rank 0), not once per rank's partial sum
            check_shape(loaded, tuple(param.shape), "a row-parallel bias")
            param.data.copy_(loaded.read())
            return
        n = param.shape[1]
        check_shape(loaded, _full(param, 1, n * self.tp.size), "a row-parallel weight")
        _copy(param.data, loaded.narrow(1, self.tp.rank * n, n), "a row-parallel weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, self.bias if self.tp.rank == 0 else None, self.packed)
        return self.tp.all_reduce(y)
