"""Model runner: one rank's model and KV tensors; runs a step's batch, and on rank 0 samples its tokens."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from kvfleet_agent.config import EngineConfig
from kvfleet_agent.engine.sampler import Sampler
from kvfleet_agent.engine.scheduler import ScheduledChunk, SchedulerOutput
from kvfleet_agent.layers.attention import AttentionMetadata, DecodeGroup, PagedAttention, PrefillSpan
from kvfleet_agent.models.config import ModelConfig
from kvfleet_agent.models.llama import LlamaForCausalLM
from kvfleet_agent.models.loader import load_weights
from kvfleet_agent.outputs import Logprob
from kvfleet_agent.parallel.group import TPGroup
from kvfleet_agent.sampling_params import SamplingParams
from kvfleet_kernels import reference

log = logging.getLogger(__name__)

DEFAULT_CPU_KV_BYTES = 2 << 30
DECODE_GROUP = 16  # decode rows per attention call; measured best on CPU (gathered K/V stays in cache)


@dataclass(slots=True)
class StepBatch:
    """A step's chunks flattened into one token batch (decodes first, sorted by length), as numpy arrays.

    Plain data on purpose: rank 0 builds it once from the scheduler's output and sends it to the
    other ranks, which only copy it to their device. Sampling parameters stay on rank 0.
    """

    input_ids: np.ndarray  # [T]
    positions: np.ndarray  # [T]
    slot_mapping: np.ndarray  # [T] where each token's K/V goes in the paged pool
    decode_tables: np.ndarray  # [num_decodes, width] block tables of the decode rows
    prefills: list[tuple[int, int, int, np.ndarray]]  # (query_start, query_len, context_start, block table)
    sample_rows: np.ndarray  # [S] rows whose hidden state yields a next token


def plan_batch(chunks: list[ScheduledChunk], block_size: int) -> tuple[StepBatch, list[ScheduledChunk]]:
    """The step's batch, and the chunks that sample (in the order of the batch's sample rows)."""
    bs = block_size
    decodes = sorted((c for c in chunks if len(c.token_ids) == 1), key=lambda c: c.start_pos)
    prefills = [c for c in chunks if len(c.token_ids) > 1]
    nd = len(decodes)
    # Decodes: one token each, vectorised over the batch.
    d_pos = np.fromiter((c.start_pos for c in decodes), dtype=np.int64, count=nd)
    width = max((len(c.block_table) for c in decodes), default=1)
    tables = np.zeros((nd, width), dtype=np.int64)
    for i, c in enumerate(decodes):
        tables[i, :len(c.block_table)] = c.block_table
    d_slots = tables[np.arange(nd), d_pos // bs] * bs + d_pos % bs
    ids: list[int] = [c.token_ids[0] for c in decodes]
    pos_parts, slot_parts = [d_pos], [d_slots]
    spans: list[tuple[int, int, int, np.ndarray]] = []
    sample_rows = [i for i, c in enumerate(decodes) if c.sample]
    start = nd
    for c in prefills:
        n = len(c.token_ids)
        table = np.asarray(c.block_table, dtype=np.int64)
        pos = np.arange(c.start_pos, c.start_pos + n, dtype=np.int64)
        ids += c.token_ids
        pos_parts.append(pos)
        slot_parts.append(table[pos // bs] * bs + pos % bs)
        spans.append((start, n, c.start_pos, table))
        if c.sample:
            sample_rows.append(start + n - 1)
        start += n
    batch = StepBatch(np.asarray(ids, dtype=np.int64), np.concatenate(pos_parts), np.concatenate(slot_parts),
                      tables, spans, np.asarray(sample_rows, dtype=np.int64))
    return batch, [c for c in decodes if c.sample] + [c for c in prefills if c.sample]


def warmup_steps(block_size: int) -> list[SchedulerOutput]:
    """One throwaway prefill and decode, so the first real request does not pay for lazy init.

    They write K/V into block 0, which is harmless: no block is read before its owner writes it.
    """
    params = SamplingParams(max_tokens=1, temperature=0.0)
    n = min(block_size, 8)
    prefill = ScheduledChunk("warmup", [0] * n, 0, [0], True, params)
    decode = ScheduledChunk("warmup-decode", [0], n - 1, [0], True, params)
    return [SchedulerOutput([prefill], n), SchedulerOutput([decode], 1, finished=["warmup", "warmup-decode"])]


def resolve_dtype(config: EngineConfig, model_cfg: ModelConfig, device: torch.device) -> torch.dtype:
    """The compute dtype: as asked, else the checkpoint's on GPU and float32 on CPU (half is slow there)."""
    name = config.dtype
    if name == "auto":
        name = model_cfg.torch_dtype if device.type == "cuda" else "float32"
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"config.json torch_dtype={name!r} is not a torch dtype; pass dtype explicitly")
    return dtype


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    """The device of a tensor-parallel rank: one GPU each (counting from the configured one), or the CPU."""
    want = torch.device(config.device if config.device != "auto" else
                        ("cuda" if torch.cuda.is_available() else "cpu"))
    if want.type != "cuda":
        return want
    index = (want.index or 0) + rank
    if index >= torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size={config.tensor_parallel_size} needs GPU {index} for rank {rank}, "
                         f"but only {torch.cuda.device_count()} are visible: lower tensor_parallel_size")
    return torch.device("cuda", index)


class ModelRunner:
    """One rank: loads its shard of the checkpoint, sizes and binds its KV pool, runs steps."""

    def __init__(self, config: EngineConfig, model_cfg: ModelConfig, max_model_len: int,
                 tp: TPGroup | None = None) -> None:
        self.config = config
        self.model_cfg = model_cfg
        self.tp = tp or TPGroup()
        self.device = rank_device(config, self.tp.rank)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # NCCL and the default stream follow the current device
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.dtype = resolve_dtype(config, model_cfg, self.device)
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        with torch.device(self.device):
            self.model = LlamaForCausalLM(model_cfg, max_model_len, self.dtype, self.tp).to(self.dtype)
        self.loaded_bytes = load_weights(self.model, config.model)
        self.model.eval()
        for module in self.model.modules():  # CPU: oneDNN-prepacked GEMM weights (a no-op elsewhere)
            pack_weights = getattr(module, "pack_weights", None)
            if callable(pack_weights):
                pack_weights()
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, PagedAttention)]
        self.sampler = Sampler(config.seed, self.device)
        self.num_blocks = 0

    def param_bytes(self) -> int:
        """Bytes of this rank's parameters (a tied embedding and LM head count once)."""
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def kv_shapes(self) -> list[tuple[int, ...]]:
        """The shape of each layer's K (and V) tensor on this rank."""
        return [tuple(layer.k_cache.shape) for layer in self.attn_layers]

    def bytes_per_block(self) -> int:
        """KV bytes of one block across all layers (keys and values) for this rank's heads."""
        a = self.attn_layers[0]
        elem = torch.empty(0, dtype=self.dtype).element_size()
        return 2 * len(self.attn_layers) * self.block_size * a.num_kv_heads * a.head_dim * elem

    def kv_budget_bytes(self) -> int:
        """Bytes for the KV pool: the configured budget on CPU; a share of free memory on GPU."""
        if self.config.kv_cache_memory_bytes is not None:
            return self.config.kv_cache_memory_bytes
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            # Leave room for a full step's activations beside the weights already resident.
            activations = (self.config.max_num_batched_tokens or 8192) * self.model_cfg.intermediate_size * 4 * 8
            return max(0, int(free - total * (1 - self.config.gpu_memory_utilization)) - activations)
        total_ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        # Never more than every sequence at full length could use: the pool is zero-filled up front
        # (a masked slot holding NaN garbage would still poison softmax·V), and that costs page faults.
        blocks_usable = self.config.max_num_seqs * -(-self.max_model_len // self.block_size) + 1
        return min(DEFAULT_CPU_KV_BYTES, total_ram // 4 // self.tp.size, blocks_usable * self.bytes_per_block())

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Create each layer's [num_blocks, block_size, kv_heads, head_dim] K and V tensors and bind them."""
        self.num_blocks = num_blocks
        for layer in self.attn_layers:
            shape = (num_blocks, self.block_size, layer.num_kv_heads, layer.head_dim)
            layer.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            layer.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)

    def warmup(self) -> None:
        """Run the warm-up steps on this rank alone (a group of one)."""
        for step in warmup_steps(self.block_size):
            self.execute(step)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, publish: Callable[[StepBatch], None] | None = None
                ) -> tuple[dict[str, int], dict[str, Logprob]]:
        """Run one step; returns the sampled token (and logprobs if asked) of each sampling chunk.

        `publish` hands the batch to the other ranks before this one runs it (they run the same
        forward pass on their shards; the collectives inside keep the ranks in step).
        """
        self.sampler.forget(out.finished)
        if not out.chunks:
            return {}, {}
        batch, samplers = plan_batch(out.chunks, self.block_size)
        if publish is not None:
            publish(batch)
        logits = self.forward(batch)
        if logits is None:
            return {}, {}
        ids = [c.request_id for c in samplers]
        tokens, logprobs = self.sampler.sample(logits, ids, [c.sampling_params for c in samplers])
        return (dict(zip(ids, tokens, strict=True)),
                {rid: lp for rid, lp in zip(ids, logprobs, strict=True) if lp is not None})

    @torch.inference_mode()
    def forward(self, batch: StepBatch) -> torch.Tensor | None:
        """The model over the batch; logits of the sample rows over the whole vocabulary (None if none)."""
        dev = self.device
        nd = batch.decode_tables.shape[0]
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(batch.slot_mapping).to(dev),
            decode_groups=self._decode_groups(batch.decode_tables, batch.positions[:nd]),
            prefills=[PrefillSpan(s, n, ctx, torch.from_numpy(t).to(dev)) for s, n, ctx, t in batch.prefills],
        )
        hidden = self.model(torch.from_numpy(batch.input_ids).to(dev), torch.from_numpy(batch.positions).to(dev),
                            meta)
        if not len(batch.sample_rows):
            return None
        return self.model.compute_logits(hidden[torch.from_numpy(batch.sample_rows).to(dev)])

    def _decode_groups(self, tables: np.ndarray, positions: np.ndarray) -> list[DecodeGroup]:
        """Split the (length-sorted) decode rows into groups and plan each group's gather once."""
        groups = []
        for start in range(0, len(positions), DECODE_GROUP):
            end = min(start + DECODE_GROUP, len(positions))
            seq_lens = torch.from_numpy(positions[start:end] + 1)
            flat, valid = reference.decode_plan(torch.from_numpy(tables[start:end]), seq_lens, self.block_size,
                                                int(positions[end - 1]) + 1)
            groups.append(DecodeGroup(start, end, flat.to(self.device), valid.to(self.device)))
        return groups
