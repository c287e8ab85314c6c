"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3): plain model code over parallel layers."""

from __future__ import annotations

from typing import ClassVar, Protocol

import torch
from torch import nn

from kvfleet_agent.layers.attention import AttentionMetadata, PagedAttention
from kvfleet_agent.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from kvfleet_agent.layers.linear import SINGLE, MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from kvfleet_agent.layers.norm import RMSNorm
from kvfleet_agent.layers.rotary import RotaryEmbedding
from kvfleet_agent.layers.tp_group import TPGroup
from kvfleet_agent.models.config import ModelConfig
from kvfleet_kernels import dispatch


class DecodeStack(Protocol):
    """The decoder stack of decode-only steps as one call (models/fused_decode.py), attached after loading."""

    def applies(self, x: torch.Tensor, meta: AttentionMetadata) -> bool: ...

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor: ...


class LlamaAttention(nn.Module):
    """Self-attention: packed QKV, rotary, paged attention, output projection."""

    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding, tp: TPGroup, quant: str | None = None) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads // tp.size
        self.num_kv_heads = cfg.num_kv_heads // tp.size
        self.head_dim = cfg.head_dim
        self.q_size, self.kv_size = self.num_heads * cfg.head_dim, self.num_kv_heads * cfg.head_dim
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads,
                                          cfg.qkv_bias, tp, quant)
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, cfg.o_bias, tp, quant)
        self.rope = rope
        # Qwen3: each query and key head is RMS-normalised (one weight over head_dim) before rotary.
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, cfg.head_dim)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        t, h, kvh = x.shape[0], self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x)
        # q and k sit side by side in the packed output: rotate them in one pass.
        qk = qkv[:, :self.q_size + self.kv_size].view(t, h + kvh, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(qk[:, :h].reshape(t * h, self.head_dim))[0]
            k = self.k_norm(qk[:, h:].reshape(t * kvh, self.head_dim))[0]
            qk = torch.cat((q.view(t, h, self.head_dim), k.view(t, kvh, self.head_dim)), dim=1)
        qk = self.rope(positions, qk)
        v = qkv[:, self.q_size + self.kv_size:].view(t, kvh, self.head_dim)
        out = self.attn(qk[:, :h], qk[:, h:], v, meta)
        return self.o_proj(out.view(t, self.q_size))  # type: ignore[no-any-return]


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward with gate and up projections packed into one matmul."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup, quant: str | None = None) -> None:
        super().__init__()
        n = cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [n, n], cfg.mlp_bias, tp,
                                                       shard_names=("gate", "up"), quant=quant)
        self.down_proj = RowParallelLinear(n, cfg.hidden_size, cfg.mlp_bias, tp, quant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(dispatch.silu_and_mul(self.gate_up_proj(x)))  # type: ignore[no-any-return]


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks with the residual carried alongside."""

    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding, tp: TPGroup, quant: str | None = None) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, rope, tp, quant)
        self.mlp = LlamaMLP(cfg, tp, quant)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    """Token ids and positions of a step → hidden states; selected hidden states → logits."""

    # checkpoint name fragment → (our parameter name fragment, shard id)
    packed_modules: ClassVar[dict[str, tuple[str, str]]] = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up"),
    }

    def __init__(self, cfg: ModelConfig, max_positions: int, dtype: torch.dtype,
                 tp: TPGroup = SINGLE, quant: str | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        rope = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, dtype)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        # `quant`: the decoder layers' linears are quantized (embeddings and the LM head stay dense, as in
        # GPTQ, AWQ and compressed-tensors checkpoints, whose quality depends most on them).
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, rope, tp, quant) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp)
        if cfg.tie_word_embeddings:  # one matrix serves as both embedding and head
            self.lm_head.weight = self.embed_tokens.weight
            self.lm_head.tied = True
        self.fused_decode: DecodeStack | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.fused_decode is not None and self.fused_decode.applies(x, meta):
            return self.fused_decode(x, positions, meta)
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, meta)
        x, _ = self.norm(x, residual)
        return x  # type: ignore[no-any-return]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the whole vocabulary for the given hidden states."""
        return self.lm_head(hidden)  # type: ignore[no-any-return]

    def checkpoint_name(self, name: str) -> tuple[str, str | None]:
        """Map a Hugging Face tensor name to our parameter name and shard id."""
        name = name.removeprefix("model.")
        for src, (dst, shard) in self.packed_modules.items():
            if f".{src}." in name:
                return name.replace(src, dst), shard
        return name, None
