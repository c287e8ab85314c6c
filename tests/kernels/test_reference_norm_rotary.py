"""Tests of RMSNorm and rotary embedding (reference kernels and layers) against transformers' Llama implementation."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from kernel_helpers import HEADS, assert_close_at, gen

from kvfleet_agent.layers.norm import RMSNorm
from kvfleet_agent.layers.rotary import SUPPORTED_ROPE_TYPES, RotaryEmbedding, attention_scaling, inverse_frequencies
from kvfleet_kernels import reference

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402
from transformers.models.llama.modeling_llama import (  # noqa: E402
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

# ---------------------------------------------------------------------------------------------
# RMSNorm


def hf_rms_norm(weight: torch.Tensor, eps: float) -> torch.nn.Module:
    norm = LlamaRMSNorm(weight.shape[0], eps=eps).to(weight.dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
    return norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("hidden", "eps"), [(64, 1e-5), (200, 1e-6)])
def test_rms_norm_matches_transformers(dtype: torch.dtype, hidden: int, eps: float) -> None:
    g = gen(hidden)
    x = (torch.randn(9, hidden, generator=g) * 3 + 0.5).to(dtype)
    w = (1 + 0.3 * torch.randn(hidden, generator=g)).to(dtype)
    hf = hf_rms_norm(w, eps)
    with torch.no_grad():
        want = hf(x)
    got = reference.rms_norm(x, w, eps)
    assert got.dtype == want.dtype == dtype
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    # Not just a rescale: each row has unit RMS before the weight.
    unit = reference.rms_norm(x.float(), torch.ones(hidden), eps)
    torch.testing.assert_close(unit.pow(2).mean(-1), torch.ones(9), atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_returns_normed_sum_and_the_sum(dtype: torch.dtype) -> None:
    g = gen(3)
    hidden, eps = 96, 1e-5
    x = torch.randn(5, hidden, generator=g).to(dtype)
    res = (torch.randn(5, hidden, generator=g) * 2).to(dtype)
    w = (1 + 0.3 * torch.randn(hidden, generator=g)).to(dtype)
    normed, new_res = reference.add_rms_norm(x, res, w, eps)
    assert torch.equal(new_res, x + res)
    with torch.no_grad():
        want = hf_rms_norm(w, eps)(x + res)
    torch.testing.assert_close(normed, want, atol=1e-6, rtol=1e-6)


def test_rms_norm_layer_with_and_without_residual() -> None:
    g = gen(5)
    hidden, eps = 64, 1e-5
    layer = RMSNorm(hidden, eps)
    with torch.no_grad():
        layer.weight.copy_(1 + 0.3 * torch.randn(hidden, generator=g))
    hf = hf_rms_norm(layer.weight.detach().clone(), eps)
    x, res = torch.randn(4, hidden, generator=g), torch.randn(4, hidden, generator=g)
    with torch.no_grad():
        out, carried = layer(x)
        torch.testing.assert_close(out, hf(x), atol=1e-6, rtol=1e-6)
        assert torch.equal(carried, x)  # the first layer's residual is its input
        out, carried = layer(x, res)
        torch.testing.assert_close(out, hf(x + res), atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(carried, x + res, atol=0, rtol=0)


# ---------------------------------------------------------------------------------------------
# rotary embedding

LLAMA3_SMALL = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64}
LLAMA3_REAL = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
LLAMA3_OTHER = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0,
                "original_max_position_embeddings": 256}

ROPE_CASES: list[tuple[int, float, dict[str, Any] | None]] = [
    (16, 10000.0, None),
    (64, 1e6, None),
    (32, 10000.0, {"rope_type": "default"}),
    (16, 10000.0, {"rope_type": "linear", "factor": 4.0}),
    (64, 500000.0, {"type": "linear", "factor": 2.0}),  # the older spelling of the key
    (16, 500000.0, LLAMA3_SMALL),
    (128, 500000.0, LLAMA3_REAL),
    (64, 10000.0, LLAMA3_OTHER),
    (64, 1e6, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}),
    (32, 10000.0, {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, "beta_fast": 16,
                   "beta_slow": 2, "truncate": False}),
    (64, 10000.0, {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 256,
                   "attention_factor": 1.25}),
    (64, 10000.0, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "mscale": 1.0,
                   "mscale_all_dim": 0.707}),
]


def hf_config(head_dim: int, theta: float, scaling: dict[str, Any] | None, max_pos: int = 512) -> Any:
    heads = 4
    params = {"rope_theta": theta, "rope_type": "default"} if scaling is None else {**scaling, "rope_theta": theta}
    params.setdefault("rope_type", params.get("type", "default"))
    return LlamaConfig(hidden_size=heads * head_dim, num_attention_heads=heads, num_key_value_heads=2,
                       head_dim=head_dim, max_position_embeddings=max_pos, rope_parameters=params)


def hf_inverse_frequencies(config: Any) -> tuple[torch.Tensor, float]:
    """transformers' inverse frequencies and attention scaling (not 1 for YaRN only)."""
    kind = config.rope_parameters["rope_type"]
    if kind == "default":
        inv, factor = LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    else:
        inv, factor = ROPE_INIT_FUNCTIONS[kind](config, "cpu")
    return inv, float(factor)


@pytest.mark.parametrize(("head_dim", "theta", "scaling"), ROPE_CASES)
def test_inverse_frequencies_match_transformers(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> None:
    got = inverse_frequencies(head_dim, theta, scaling)
    want, factor = hf_inverse_frequencies(hf_config(head_dim, theta, scaling))
    assert got.shape == (head_dim // 2,)
    torch.testing.assert_close(got, want.float(), atol=0, rtol=1e-6)
    assert attention_scaling(scaling) == pytest.approx(factor, rel=1e-12)
    assert (factor != 1.0) == (scaling is not None and scaling.get("rope_type") == "yarn")


LLAMA3_CASES = [c for c in ROPE_CASES if c[2] and c[2].get("rope_type") == "llama3"]


@pytest.mark.parametrize(("head_dim", "theta", "scaling"), LLAMA3_CASES)
def test_llama3_cases_cover_all_three_frequency_bands(head_dim: int, theta: float, scaling: dict[str, Any]) -> None:
    plain = inverse_frequencies(head_dim, theta, None)
    got = inverse_frequencies(head_dim, theta, scaling)
    wavelen = 2 * math.pi / plain
    old = scaling["original_max_position_embeddings"]
    high = wavelen < old / scaling["high_freq_factor"]
    low = wavelen > old / scaling["low_freq_factor"]
    medium = ~high & ~low
    assert high.any() and medium.any() and low.any()
    torch.testing.assert_close(got[high], plain[high], atol=0, rtol=0)  # short wavelengths kept
    torch.testing.assert_close(got[low], plain[low] / scaling["factor"], atol=0, rtol=1e-6)  # long ones slowed
    assert ((got[medium] < plain[medium]) & (got[medium] > plain[medium] / scaling["factor"])).all()


@pytest.mark.parametrize(("head_dim", "theta", "scaling"), ROPE_CASES)
def test_rotary_tables_match_transformers(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> None:
    max_pos = 512
    rope = RotaryEmbedding(head_dim, max_pos, theta, scaling, torch.float32)
    hf = LlamaRotaryEmbedding(hf_config(head_dim, theta, scaling, max_pos))
    positions = torch.randint(0, max_pos, (40,), generator=gen(head_dim))
    with torch.no_grad():
        cos, sin = hf(torch.randn(1, 40, head_dim), positions[None])
    torch.testing.assert_close(rope.cos[positions], cos[0], atol=2e-5, rtol=0)
    torch.testing.assert_close(rope.sin[positions], sin[0], atol=2e-5, rtol=0)


@pytest.mark.parametrize(("h", "kvh"), HEADS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scaling", [None, LLAMA3_SMALL])
def test_rotary_matches_transformers_apply_rotary_pos_emb(h: int, kvh: int, dtype: torch.dtype,
                                                         scaling: dict[str, Any] | None) -> None:
    g = gen(h * 10 + kvh)
    d, t, max_pos = 32, 23, 300
    rope = RotaryEmbedding(d, max_pos, 500000.0, scaling, dtype)
    positions = torch.randint(0, max_pos, (t,), generator=g)  # unsorted, with repeats allowed
    q = torch.randn(t, h, d, generator=g).to(dtype)
    k = torch.randn(t, kvh, d, generator=g).to(dtype)
    qk_out = rope(positions, torch.cat([q, k], dim=1))  # the model rotates q and k in one call
    q_out, k_out = qk_out[:, :h], qk_out[:, h:]
    # Our layout [T, heads, D] with cos/sin [T, D] is HF's [batch, heads, seq, D] with unsqueeze_dim=1.
    q_want, k_want = apply_rotary_pos_emb(q, k, rope.cos[positions], rope.sin[positions], unsqueeze_dim=1)
    assert q_out.dtype == k_out.dtype == dtype
    torch.testing.assert_close(q_out, q_want, atol=0, rtol=0)
    torch.testing.assert_close(k_out, k_want, atol=0, rtol=0)
    # The rotation preserves each head's norm and actually rotates (position 0 excepted).
    assert_close_at(q_out.float().norm(dim=-1), q.float().norm(dim=-1), dtype)
    moved = positions > 0
    assert not torch.allclose(q_out[moved].float(), q[moved].float(), atol=1e-2)


@pytest.mark.parametrize("kind", ["dynamic", "longrope", "su", "made-up"])
def test_unsupported_rope_types_raise(kind: str) -> None:
    scaling = {"rope_type": kind, "factor": 4.0, "original_max_position_embeddings": 64}
    for call in (lambda: inverse_frequencies(16, 10000.0, scaling),
                 lambda: RotaryEmbedding(16, 32, 10000.0, scaling, torch.float32)):
        with pytest.raises(ValueError, match="rope_scaling") as info:
            call()
        assert kind in str(info.value)
        assert all(t in str(info.value) for t in SUPPORTED_ROPE_TYPES)
