"""Linear layers that load their own weights from Hugging Face tensors, packed and shard-aware.

Each parameter carries a `weight_loader`, so the checkpoint loader stays generic and a model file
only declares which checkpoint names are packed together. Tensor parallelism (Megatron style)
shards along the output (column) or input (row) dimension: a column-parallel layer feeding a
row-parallel one needs a single all-reduce, after the row-parallel matmul. Loaders read only this
rank's rows or columns from the checkpoint. With a group of one these are plain linears.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from kvfleet_agent.layers.gemm_crossover import KEEP_DENSE_MAX, NEVER, crossover, keeps_copy
from kvfleet_agent.layers.quant.matmul import QuantMatmul
from kvfleet_agent.layers.quant.onload import quantize
from kvfleet_agent.layers.quant.weight import QuantWeight, cat_rows
from kvfleet_agent.layers.tp_group import TPGroup
from kvfleet_agent.layers.weights import CheckpointTensor
from kvfleet_kernels import cpu_f32

Loaded = CheckpointTensor | QuantWeight  # a dense checkpoint tensor, or a pre-quantized checkpoint's weight
# Norms and embeddings take dense tensors only; linears take a quantized weight too.
WeightLoader = (Callable[[nn.Parameter, CheckpointTensor, str | None], None]
                | Callable[[nn.Parameter, Loaded, str | None], None])
ON_LOAD = ("int8", "int4", "fp8")  # quantized here from an fp checkpoint; "checkpoint": they arrive quantized
SINGLE = TPGroup()
log = logging.getLogger(__name__)  # the default group: one rank, collectives are no-ops


# On x86 CPUs oneDNN's fp32 inner product on a prepacked weight runs 2-2.5x faster than the MKL sgemm
# behind F.linear (measured on the 2-core AMD EPYC here, M = 1..2048: MKL takes its AVX2 path on AMD,
# oneDNN uses AVX-512). Results are fp32 to within 1e-6 relative. See BENCHMARKS.md.
PACK_FOR_ROWS = 64  # the batch size the blocked layout is tuned for; any M runs on it


# bfloat16 packs too where the CPU multiplies it natively (AMX or AVX512-BF16): F.linear then reorders the weight into
# oneDNN's layout on every call, which the packed copy does once (Intel Xeon with AMX, 2 threads: 1.3-3x at 4-256 rows
# on the tiny and med models' shapes, bit-identical results; see BENCHMARKS.md). Elsewhere bf16 stays on F.linear.
def can_pack(weight: torch.Tensor) -> bool:
    """Whether this weight can use the prepacked oneDNN path: fp32, or bf16 where the CPU multiplies it natively."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return False
    if not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    return weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and native_bf16())


@functools.cache
def native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AMX or AVX512-BF16, as worker.device decides the dtype)."""
    return bool(torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported())


def pack(weight: torch.Tensor) -> torch.Tensor:
    """A oneDNN-blocked copy of weight [out, in] for `linear(..., packed=...)`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, PACK_FOR_ROWS)  # type: ignore[no-any-return]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: torch.Tensor | None = None) -> torch.Tensor:
    """y = x·Wᵀ + b, through the prepacked oneDNN weight when there is one."""
    if packed is not None:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")  # type: ignore[no-any-return]
    return F.linear(x, weight, bias)


def few_row_path(weight: torch.Tensor, packed: torch.Tensor,
                 limit: int = KEEP_DENSE_MAX) -> tuple[torch.Tensor | None, int]:
    """A packed weight's few-row copy and the rows below which it runs (see gemm_crossover): kvfleet_kernels.cpu_f32's
    tiles where that kernel builds, else F.linear on the dense weight (None); NEVER rows for a weight too large to
    keep a second copy of. The dense weight can go unless the result is (None, rows > 0)."""
    fp32_tiles = weight.dtype == torch.float32 and keeps_copy(weight, limit) and cpu_f32.available()
    tiles = cpu_f32.pack(weight) if fp32_tiles else None
    rows = crossover(weight, lambda x: linear(x, weight, None, packed), lambda x: few_rows(x, weight, tiles, None),
                     "F.linear" if tiles is None else "tiles", limit)
    return (None, NEVER) if rows <= 1 else (tiles, rows)  # packed from one row on: no second copy to keep


def few_rows(x: torch.Tensor, weight: torch.Tensor, tiles: torch.Tensor | None,
             bias: torch.Tensor | None) -> torch.Tensor:
    """x·Wᵀ + b on the few-row path: the tiles through cpu_f32, or F.linear on the dense weight."""
    if tiles is None:
        return F.linear(x, weight, bias)
    n = int(weight.shape[0])  # the output features (a meta weight's shape holds)
    y = cpu_f32.linear(x.reshape(-1, x.shape[-1]), tiles, n).view(*x.shape[:-1], n)
    return y if bias is None else y.add_(bias)


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
    """The shared machinery: a dense weight, or (quantized) the rows of each packed part until they are joined.

    `quant` is the on-load quantizer (ON_LOAD), "checkpoint" (pre-quantized), or None. A quantized layer's
    `weight` stays on the meta device (its shape checks the checkpoint, it holds no memory); the parts loaded
    for this rank are joined, moved and prepared for their kernel by `pack_weights`, after which `qmm`
    computes the matmul.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup,
                 quant: str | None = None) -> None:
        super().__init__()
        self.tp = tp
        self.quant = quant
        self.home = torch.empty(0).device  # the device the model is being built on (a torch.device context)
        weight = torch.empty(out_features, in_features, device="meta" if quant else None)
        self.weight = attach_loader(nn.Parameter(weight, requires_grad=False), self.load)
        self.bias = (attach_loader(nn.Parameter(torch.empty(out_features), requires_grad=False), self.load)
                     if bias else None)
        self.packed: torch.Tensor | None = None
        self.few_below = NEVER  # rows below which the few-row path (tiles, or F.linear) beats the packed weight
        self.tiles: torch.Tensor | None = None  # the few-row path's copy, for kvfleet_kernels.cpu_f32
        self.parts: dict[int, torch.Tensor | QuantWeight] = {}  # first row → this rank's rows of a part
        self.qmm: QuantMatmul | None = None

    def pack_weights(self) -> None:
        """Finish loading, once: join a quantized layer's parts, or prepack a dense weight for the CPU fast path."""
        if self.parts:
            self._join_parts()
        if can_pack(self.weight):
            self.packed = pack(self.weight)
            self.tiles, self.few_below = few_row_path(self.weight, self.packed)
            if self.few_below == NEVER or self.tiles is not None:
                # The blocked copy (and the tiles) are all the matmul reads: the weight keeps its shape on the meta
                # device rather than another dense copy (which doubled the weights' memory on CPU).
                self.weight = nn.Parameter(torch.empty_like(self.weight, device="meta"), requires_grad=False)

    def _join_parts(self) -> None:
        parts = [self.parts[row] for row in sorted(self.parts)]
        self.parts = {}
        dtype = self.weight.dtype
        if all(isinstance(p, QuantWeight) for p in parts):
            qmm = QuantMatmul(cat_rows([p for p in parts if isinstance(p, QuantWeight)]).to(self.home), dtype)
            if qmm.dense is None:
                self.qmm = qmm
                return
            dense = qmm.dense  # no kernel for this weight here: it runs dequantized
        else:  # some part was left unquantized by the checkpoint: the whole packed weight runs dense
            dense = torch.cat([p.dequantize(dtype) if isinstance(p, QuantWeight) else p.to(dtype) for p in parts])
        self.weight = nn.Parameter(dense.to(self.home, dtype), requires_grad=False)

    def _source(self, param: nn.Parameter, loaded: Loaded) -> Loaded:
        """What this layer shards: on-load quantization quantizes the whole tensor first, so every rank
        cuts its share of one grid (per-channel scales span the full row) and TP=N equals TP=1."""
        if self.quant in ON_LOAD and param is self.weight and isinstance(loaded, CheckpointTensor):
            # On the layer's device: a GPU quantizes an 8B model's weights in seconds, where the host takes minutes.
            return quantize(loaded.read().to(self.home), str(self.quant))
        return loaded

    def _put(self, param: nn.Parameter, row: int, src: torch.Tensor | QuantWeight, name: str) -> None:
        """Place this rank's rows of (part of) the weight, starting at output row `row`."""
        rows = int(src.shape[0])
        if param is self.weight and self.quant:
            check_shape(src, (rows, int(param.shape[1])), name)
            self.parts[row] = src
            return
        if isinstance(src, QuantWeight):
            raise ValueError(f"{name}: the checkpoint holds a quantized weight here, but no quantization is "
                             "configured for this layer")
        _copy(param.data.narrow(0, row, rows), src, name)

    def load(self, param: nn.Parameter, loaded: Loaded, shard: str | None = None) -> None:
        raise NotImplementedError

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x·Wᵀ + b through the quantized kernel, the prepacked weight, or below its crossover the few-row path."""
        if self.qmm is None:
            # A small weight runs its few-row path below the crossover (see gemm_crossover); NEVER is 0 rows.
            if x.numel() < self.few_below * x.shape[-1]:
                return few_rows(x, self.weight, self.tiles, bias)
            return linear(x, self.weight, bias, self.packed)
        y = self.qmm(x)
        return y if bias is None else y.add_(bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


def log_quantized(model: nn.Module, method: str, rank: int) -> None:
    """One start-up line: which kernel runs the quantized linears, and their bytes against the dense weights'."""
    paths: dict[str, int] = {}
    held = dense = 0
    for m in model.modules():
        if isinstance(m, _Linear) and m.quant:
            path = m.qmm.path if m.qmm is not None else "dense (no kernel here, or left unquantized)"
            paths[path] = paths.get(path, 0) + 1
            held += m.qmm.nbytes if m.qmm is not None else m.weight.numel() * m.weight.element_size()
            dense += m.weight.numel() * m.weight.element_size()
    kernels = ", ".join(f"{n} on {p}" for p, n in sorted(paths.items()))
    log.info("rank %d: quantization %s: %s linears (%s); their weights hold %.1f MB, %.2fx of %.1f MB dense",
             rank, method, sum(paths.values()), kernels, held / 1e6, held / max(dense, 1), dense / 1e6)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of a model's weights on their device, one copy each (what a step reads): dense parameters, prepared
    quantized weights, and a packed weight's blocked copy (a small one's few-row copy beside it is not counted)."""
    dense = sum(p.numel() * p.element_size() for p in model.parameters() if not p.is_meta)
    linears = [m for m in model.modules() if isinstance(m, _Linear)]
    # A packed weight whose dense parameter went to meta (linears, an untied LM head) counts as its packed copy.
    packed = 0
    for m in model.modules():
        p, w = getattr(m, "packed", None), getattr(m, "weight", None)
        if isinstance(p, torch.Tensor) and isinstance(w, torch.Tensor) and w.is_meta:
            packed += p.numel() * p.element_size()
    return dense + sum(m.qmm.nbytes for m in linears if m.qmm is not None) + packed


def check_shape(loaded: torch.Tensor | Loaded, expected: tuple[int, ...], name: str) -> None:
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

    def __init__(self, in_features: int, out_features: int, bias: bool = False, tp: TPGroup = SINGLE,
                 quant: str | None = None) -> None:
        super().__init__(in_features, split(out_features, tp, "out_features"), bias, tp, quant)

    def load(self, param: nn.Parameter, loaded: Loaded, shard: str | None = None) -> None:
        loaded = self._source(param, loaded)
        n = param.shape[0]
        # Check the whole tensor before cutting this rank's share, or a too-large one would fit.
        check_shape(loaded, _full(param, 0, n * self.tp.size), "a column-parallel layer")
        self._put(param, 0, loaded.narrow(0, self.tp.rank * n, n), "a column-parallel layer")


class MergedColumnParallelLinear(_Linear):
    """Several column-parallel linears packed into one matmul (gate+up, or q+k+v)."""

    def __init__(self, in_features: int, out_sizes: Sequence[int], bias: bool = False, tp: TPGroup = SINGLE,
                 shard_names: Sequence[str] | None = None, quant: str | None = None) -> None:
        self.shard_names = list(shard_names) if shard_names else [str(i) for i in range(len(out_sizes))]
        # Each rank holds its slice of every packed part: [q_r; k_r; v_r], not a slice of [q; k; v].
        self.out_sizes = [split(s, tp, f"the {name} part's size") for s, name in zip(out_sizes, self.shard_names,
                                                                                  strict=True)]
        super().__init__(in_features, sum(self.out_sizes), bias, tp, quant)

    def load(self, param: nn.Parameter, loaded: Loaded, shard: str | None = None) -> None:
        loaded = self._source(param, loaded)
        idx = self.shard_names.index(str(shard))
        n = self.out_sizes[idx]
        check_shape(loaded, _full(param, 0, n * self.tp.size), f"packed shard {shard}")
        self._put(param, sum(self.out_sizes[:idx]), loaded.narrow(0, self.tp.rank * n, n), f"packed shard {shard}")


class QKVParallelLinear(MergedColumnParallelLinear):
    """Query, key and value projections in one matmul; heads split across ranks."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False,
                 tp: TPGroup = SINGLE, quant: str | None = None) -> None:
        # Whole heads per rank: split the head counts, not the rows, so a head is never cut in two.
        split(num_heads, tp, "num_attention_heads")
        split(num_kv_heads, tp, "num_key_value_heads")
        super().__init__(hidden, [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim],
                         bias, tp, shard_names=("q", "k", "v"), quant=quant)


class RowParallelLinear(_Linear):
    """y = xAᵀ with A's columns (inputs) split across ranks; the partial sums are all-reduced."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, tp: TPGroup = SINGLE,
                 quant: str | None = None) -> None:
        super().__init__(split(in_features, tp, "in_features"), out_features, bias, tp, quant)

    def load(self, param: nn.Parameter, loaded: Loaded, shard: str | None = None) -> None:
        loaded = self._source(param, loaded)
        if param.dim() == 1:  # the bias is added once (by rank 0), not once per rank's partial sum
            check_shape(loaded, tuple(param.shape), "a row-parallel bias")
            if isinstance(loaded, QuantWeight):
                raise ValueError("a row-parallel bias arrived quantized: the checkpoint's layout is not understood")
            param.data.copy_(loaded.read())
            return
        n = param.shape[1]
        check_shape(loaded, _full(param, 1, n * self.tp.size), "a row-parallel weight")
        self._put(param, 0, loaded.narrow(1, self.tp.rank * n, n), "a row-parallel weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x, self.bias if self.tp.rank == 0 else None)
        return self.tp.all_reduce(y)
