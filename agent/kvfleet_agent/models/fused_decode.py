"""The decoder stack of a decode-only CPU step in one C++ call (kvfleet_kernels.cpu_decode), bit for bit the modules'.

A step whose tokens are all decode rows (plain decodes and verifications: every row attends to the cache up to its
own position) is the common step of serving and all of a draft model's proposals. For small models its time is the
host's: the trained draft's two layers took about 1 ms a token in Python against tens of microseconds of arithmetic.
The op runs the same kernels in the same order, so outputs do not depend on which path ran. Where it runs, a prompt's
first step_batch.PROMPT_ROWS tokens run as decode rows too (plan_batch), so a step mixing a new prompt with other
requests' decodes takes it as well; steps with a prefill chunk past them, CUDA graphs, quantized weights or KV
cache, tensor parallelism and the Triton interpreter keep the modules.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace

import torch

from kvfleet_agent.layers.attention import AttentionMetadata, PagedAttention
from kvfleet_agent.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from kvfleet_agent.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from kvfleet_kernels import cpu_decode, dispatch

log = logging.getLogger(__name__)


def why_not(model: LlamaForCausalLM) -> str | None:
    """Why this model's decode steps cannot run the one-call stack, or None when they can."""
    weight = model.norm.weight
    if weight.device.type != "cpu":
        return f"the model is on {weight.device.type}"
    if model.cfg.num_layers == 0:
        return "the model has no layers"
    if weight.dtype not in (torch.float32, torch.bfloat16):
        return f"{weight.dtype} weights"
    if _layers(model)[0].self_attn.qkv_proj.tp.size != 1:
        return "tensor parallelism"
    if any(lin.quant or lin.qmm is not None for layer in _layers(model) for lin in _linears(layer)):
        return "quantized linears"
    if os.environ.get(cpu_decode.ENABLE_ENV, "1") == "0" or not cpu_decode.available():
        return f"the op is not built ({cpu_decode.ENABLE_ENV}=0, or no C++ compiler)"
    return None


def _layers(model: LlamaForCausalLM) -> list[LlamaDecoderLayer]:
    return [layer for layer in model.layers if isinstance(layer, LlamaDecoderLayer)]


def _linears(layer: LlamaDecoderLayer) -> tuple[MergedColumnParallelLinear, RowParallelLinear,
                                                MergedColumnParallelLinear, RowParallelLinear]:
    """The layer's linears in the op's order."""
    a, m = layer.self_attn, layer.mlp
    return a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj


class FusedDecode:
    """A model's weights laid out for the op, and the check that a step can take it."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        self.model = model
        tensors: list[torch.Tensor | None] = []
        few_below: list[int] = []
        layers = _layers(model)
        for layer in layers:  # cpu_decode.TENSORS_PER_LAYER each, in the op's order
            a = layer.self_attn
            tensors += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                        a.q_norm.weight if a.q_norm is not None else None,
                        a.k_norm.weight if a.k_norm is not None else None]
            for lin in _linears(layer):
                tensors += [lin.weight, lin.packed, lin.tiles, lin.bias]
                few_below.append(int(lin.few_below))
        attn = layers[0].self_attn
        self.attn_layers: list[PagedAttention] = [layer.self_attn.attn for layer in layers]
        self.stack = cpu_decode.Stack(tensors, few_below, [a.k_cache for a in self.attn_layers],
                                      [a.v_cache for a in self.attn_layers], model.norm.weight,
                                      (attn.num_heads, attn.num_kv_heads, attn.head_dim), model.cfg.rms_norm_eps,
                                      attn.attn.scale)
        self.rope = attn.rope

    @classmethod
    def attach(cls, model: LlamaForCausalLM) -> bool:
        """Give the model its one-call decode stack where it can run (after pack_weights); says which in the log."""
        reason = why_not(model)
        if reason is None:
            model.fused_decode = cls(model)
            log.info("decode steps run the decoder stack in one C++ call (kvfleet_kernels.cpu_decode)")
        else:
            log.info("decode steps run the layers one op at a time: %s", reason)
        return reason is None

    def applies(self, x: torch.Tensor, meta: AttentionMetadata) -> bool:
        """Whether this step can run it: decode rows only, eager, caches of x's dtype, the ops' backend here."""
        return (not meta.prefills and meta.decode_tables is None and bool(meta.decode_groups)
                and self._runs(x))

    def _runs(self, x: torch.Tensor) -> bool:
        attn = self.attn_layers[0]
        return attn.k_scale is None and attn.k_cache.dtype == x.dtype and dispatch.backend(x) == "reference"

    def _bound(self) -> cpu_decode.Stack:
        """The stack with the caches bound now (allocate() replaces them after the profiling pass)."""
        s = self.stack
        if s.k_caches[0] is not self.attn_layers[0].k_cache:
            s = self.stack = replace(s, k_caches=[a.k_cache for a in self.attn_layers],
                                     v_caches=[a.v_cache for a in self.attn_layers])
        return s

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Embedded decode rows x [T, hidden] → the final norm's output, as the model's layers compute it."""
        cos, sin = self.rope.cos.index_select(0, positions), self.rope.sin.index_select(0, positions)
        groups = [(g.start, g.end, g.tables, g.seq_lens) for g in meta.decode_groups]
        return cpu_decode.decode_forward(x, cos, sin, self._bound(), meta.slot_mapping, groups)

    def propose_greedy(self, ids: torch.Tensor, starts: list[int], rows: list[int], counts: list[int],
                       tables: torch.Tensor, block_size: int) -> tuple[torch.Tensor, float] | None:
        """A draft's greedy run in one call (cpu_decode.propose_greedy: the catch-up forward, then the loop of
        forwards, LM head and argmax), or None where the op cannot run it: the caller runs the modules instead."""
        head, embed = self.model.lm_head, self.model.embed_tokens.weight
        if not self._runs(embed) or head.tp.size != 1:
            return None
        return cpu_decode.propose_greedy(ids, starts, rows, counts, tables, block_size, embed,
                                         [head.weight, head.packed, head.tiles, None], head.few_below,
                                         (self.rope.cos, self.rope.sin), self._bound())
