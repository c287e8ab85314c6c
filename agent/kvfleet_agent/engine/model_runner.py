"""Model runner: owns the model and the KV tensors; turns a SchedulerOutput into sampled tokens."""

from __future__ import annotations

import logging
import os

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
from kvfleet_agent.sampling_params import SamplingParams
from kvfleet_kernels import reference

log = logging.getLogger(__name__)

DEFAULT_CPU_KV_BYTES = 2 << 30
DECODE_GROUP = 16  # decode rows per attention call; measured best on CPU (gathered K/V stays in cache)


def resolve_dtype(config: EngineConfig, model_cfg: ModelConfig, device: torch.device) -> torch.dtype:
    """The compute dtype: as asked, else the checkpoint's on GPU and float32 on CPU (half is slow there)."""
    name = config.dtype
    if name == "auto":
        name = model_cfg.torch_dtype if device.type == "cuda" else "float32"
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"config.json torch_dtype={name!r} is not a torch dtype; pass dtype explicitly")
    return dtype


class ModelRunner:
    """Loads the checkpoint, sizes and binds the KV pool, and executes steps."""

    def __init__(self, config: EngineConfig, model_cfg: ModelConfig, max_model_len: int) -> None:
        self.config = config
        self.model_cfg = model_cfg
        want = config.device if config.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        self.device = torch.device(want)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.dtype = resolve_dtype(config, model_cfg, self.device)
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        with torch.device(self.device):
            self.model = LlamaForCausalLM(model_cfg, max_model_len, self.dtype).to(self.dtype)
        load_weights(self.model, config.model)
        self.model.eval()
        for module in self.model.modules():  # CPU: oneDNN-prepacked GEMM weights (a no-op elsewhere)
            pack_weights = getattr(module, "pack_weights", None)
            if callable(pack_weights):
                pack_weights()
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, PagedAttention)]
        self.sampler = Sampler(config.seed, self.device)
        self.num_blocks = 0

    def bytes_per_block(self) -> int:
        """KV bytes of one block across all layers (keys and values)."""
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
        return min(DEFAULT_CPU_KV_BYTES, total_ram // 4, blocks_usable * self.bytes_per_block())

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Create each layer's [num_blocks, block_size, kv_heads, head_dim] K and V tensors and bind them."""
        self.num_blocks = num_blocks
        for layer in self.attn_layers:
            shape = (num_blocks, self.block_size, layer.num_kv_heads, layer.head_dim)
            layer.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            layer.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)

    @torch.inference_mode()
    def warmup(self) -> None:
        """One throwaway prefill and decode, so the first real request does not pay for lazy init.

        It writes K/V into block 0, which is harmless: no block is read before its owner writes it.
        """
        params = SamplingParams(max_tokens=1, temperature=0.0)
        n = min(self.block_size, 8)
        prefill = ScheduledChunk("warmup", [0] * n, 0, [0], True, params)
        decode = ScheduledChunk("warmup-decode", [0], n - 1, [0], True, params)
        self.execute(SchedulerOutput([prefill], n))
        self.execute(SchedulerOutput([decode], 1, finished=["warmup", "warmup-decode"]))

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> tuple[dict[str, int], dict[str, Logprob]]:
        """Run one step; returns the sampled token (and logprobs if asked) of each sampling chunk."""
        self.sampler.forget(out.finished)
        if not out.chunks:
            return {}, {}
        input_ids, positions, meta, sample_rows, samplers = self._prepare(out.chunks)
        hidden = self.model(input_ids, positions, meta)
        if not samplers:
            return {}, {}
        logits = self.model.compute_logits(hidden[sample_rows])
        ids = [c.request_id for c in samplers]
        tokens, logprobs = self.sampler.sample(logits, ids, [c.sampling_params for c in samplers])
        return (dict(zip(ids, tokens, strict=True)),
                {rid: lp for rid, lp in zip(ids, logprobs, strict=True) if lp is not None})

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

    def _prepare(self, chunks: list[ScheduledChunk]
                 ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor, list[ScheduledChunk]]:
        """Flatten the chunks into one token batch (decodes first) and its attention metadata."""
        bs = self.block_size
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
        spans: list[PrefillSpan] = []
        sample_rows = [i for i, c in enumerate(decodes) if c.sample]
        start = nd
        for c in prefills:
            n = len(c.token_ids)
            table = np.asarray(c.block_table, dtype=np.int64)
            pos = np.arange(c.start_pos, c.start_pos + n, dtype=np.int64)
            ids += c.token_ids
            pos_parts.append(pos)
            slot_parts.append(table[pos // bs] * bs + pos % bs)
            spans.append(PrefillSpan(start, n, c.start_pos, torch.from_numpy(table).to(self.device)))
            if c.sample:
                sample_rows.append(start + n - 1)
            start += n
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(np.concatenate(slot_parts)).to(dev),
            decode_groups=self._decode_groups(tables, d_pos),
            prefills=spans,
        )
        samplers = [c for c in decodes if c.sample] + [c for c in prefills if c.sample]
        return (torch.tensor(ids, dtype=torch.long, device=dev), torch.from_numpy(np.concatenate(pos_parts)).to(dev),
                meta, torch.tensor(sample_rows, dtype=torch.long, device=dev), samplers)
