"""Checkpoints written by transformers' own save_pretrained, in its 5.x schema and rewritten to 4.x keys, are served
exactly (greedy tokens equal, logprobs close) across the config space, or refused at load naming the file and key.

Hypothesis draws architecture, shapes, GQA ratio, tying, biases, rope type and scaling, sliding windows and the
schema; KVFLEET_EXACTNESS_EXAMPLES raises the example count for a local run (CI runs a fixed, derandomized set).
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoConfig, AutoModelForCausalLM

from kvfleet_agent import LLM, SamplingParams
from kvfleet_agent.models.config import ModelConfig

EXAMPLES = int(os.environ.get("KVFLEET_EXACTNESS_EXAMPLES", "40"))
LOGPROB_ATOL = 1e-3  # nats; float32 on both sides, differing only in the order of float operations
TOP = 3  # top logprobs compared at every generated position
VOCAB = 160
MAX_POSITIONS = 256
BLOCK = 16

ROPES: list[dict[str, Any]] = [
    {"rope_type": "default"},
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 128, "beta_fast": 16.0,
     "beta_slow": 2.0, "attention_factor": 1.1},
]


@st.composite
def configs(draw: st.DrawFn) -> dict[str, Any]:
    """A transformers config (as keyword arguments) drawn across what kvfleet claims to serve."""
    arch = draw(st.sampled_from(["llama", "mistral", "qwen2", "qwen3"]))
    kv_heads = draw(st.sampled_from([1, 2, 4]))
    heads = kv_heads * draw(st.sampled_from([1, 2, 4]))
    head_dim = draw(st.sampled_from([8, 16, 24]))
    # An explicit head_dim that differs from hidden_size / heads, where the architecture allows one.
    hidden = heads * head_dim if arch in ("qwen2", "mistral") else draw(st.sampled_from([32, 64, heads * head_dim]))
    kw: dict[str, Any] = {
        "model_type": arch, "vocab_size": VOCAB, "hidden_size": hidden, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "intermediate_size": draw(st.sampled_from([48, 96])),
        "num_hidden_layers": draw(st.integers(1, 2)), "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": draw(st.sampled_from([1e-6, 1e-5])), "tie_word_embeddings": draw(st.booleans()),
        "rope_parameters": {**draw(st.sampled_from(ROPES)),
                            "rope_theta": draw(st.sampled_from([10000.0, 500000.0, 1e6]))},
    }
    if arch in ("llama", "qwen3"):
        kw["attention_bias"] = draw(st.booleans())
    if arch == "llama":
        kw["mlp_bias"] = draw(st.booleans())
    window = draw(st.sampled_from([None, 48, 4096]))
    if arch == "mistral":
        kw["sliding_window"] = window
    elif arch in ("qwen2", "qwen3"):
        kw.update(use_sliding_window=window is not None, sliding_window=window,
                  max_window_layers=draw(st.integers(0, 2)))
    kw["schema"] = draw(st.sampled_from(["5.x", "4.x"]))
    return kw


def init_weights(model: torch.nn.Module, seed: int) -> None:
    """Weights that give greedy decoding clear winners (as models/tiny.py does): transformers' own init keeps
    logits so flat that float rounding alone could flip a token."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("norm.weight"):
                p.copy_((4.0 if name == "model.norm.weight" else 1.0) * (1 + 0.05 * noise))
            elif name.endswith(".bias"):
                p.copy_(0.02 * noise)
            elif "embed_tokens" in name or name.startswith("lm_head"):
                p.copy_(0.08 * noise)
            else:
                p.copy_(0.2 * noise)


def to_4x_schema(model_dir: Path) -> None:
    """Rewrite config.json as transformers 4.x wrote it: rope_theta and rope_scaling on top, no layer_types."""
    path = model_dir / "config.json"
    c = json.loads(path.read_text())
    params = dict(c.pop("rope_parameters"))
    c["rope_theta"] = params.pop("rope_theta")
    c["rope_scaling"] = None if params["rope_type"] == "default" else params
    c.pop("layer_types", None)
    if "dtype" in c:
        c["torch_dtype"] = c.pop("dtype")
    path.write_text(json.dumps(c, indent=2))


def save_checkpoint(kw: dict[str, Any], model_dir: Path, seed: int) -> None:
    """Build the model in transformers, give it decisive weights and save it with save_pretrained."""
    kw = dict(kw)
    schema, arch = kw.pop("schema"), kw.pop("model_type")
    config = AutoConfig.for_model(arch, **kw)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    init_weights(model, seed)
    model.save_pretrained(model_dir)
    if schema == "4.x":
        to_4x_schema(model_dir)


@torch.inference_mode()
def hf_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> tuple[list[int], list[dict[int, float]]]:
    """transformers' greedy continuation and the top logprobs at each generated position."""
    ids, past, out, tops = torch.tensor([prompt]), None, [], []
    for _ in range(n):
        r = model(input_ids=ids, past_key_values=past, use_cache=True)
        past = r.past_key_values
        logprobs = torch.log_softmax(r.logits[0, -1].float(), dim=-1)
        values, indices = logprobs.topk(TOP)
        tops.append(dict(zip(indices.tolist(), values.tolist(), strict=True)))
        out.append(int(indices[0]))
        ids = torch.tensor([[out[-1]]])
    return out, tops


def requests(seed: int, limit: int) -> list[tuple[list[int], int]]:
    """Mixed lengths behind a two-block shared prefix (prefix-cache hits), each fitting within `limit` tokens."""
    rng = random.Random(seed)
    prefix = [rng.randrange(VOCAB) for _ in range(2 * BLOCK)]
    out = []
    for i in range(6):
        n = rng.randint(1, 8)
        head = prefix if i % 2 == 0 else []
        tail = [rng.randrange(VOCAB) for _ in range(rng.randint(1, limit - n - len(head)))]
        out.append((head + tail, n))
    return out


@settings(max_examples=EXAMPLES, deadline=None, derandomize="KVFLEET_EXACTNESS_EXAMPLES" not in os.environ,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow], database=None)
@given(kw=configs(), seed=st.integers(0, 2**16))
def test_transformers_checkpoints_are_served_exactly(kw: dict[str, Any], seed: int, tmp_path: Path) -> None:
    model_dir = tmp_path / f"ckpt-{seed}-{abs(hash(json.dumps(kw, sort_keys=True)))}"
    save_checkpoint(kw, model_dir, seed)
    window = ModelConfig.from_dir(str(model_dir)).sliding_window
    max_model_len = min(96, window or 96)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    reqs = requests(seed, max_model_len)
    # A small token budget splits the longer prompts into chunks; the shared prefix hits the cache.
    llm = LLM(model=str(model_dir), dtype="float32", max_model_len=max_model_len, max_num_batched_tokens=24,
              kv_cache_memory_bytes=1 << 20, block_size=BLOCK, enable_prefix_caching=True)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=TOP) for _, n in reqs]
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in reqs], params, use_tqdm=False)
    assert llm.engine.scheduler.num_partial_prefills > 0 and llm.engine.kv.prefix_hits > 0
    for i, ((prompt, n), out) in enumerate(zip(reqs, outs, strict=True)):
        want, want_top = hf_greedy(hf, prompt, n)
        got = out.outputs[0]
        assert got.token_ids == want, f"request {i} ({len(prompt)} prompt tokens) diverged under {kw}"
        assert got.logprobs is not None
        for step, (lp, top) in enumerate(zip(got.logprobs, want_top, strict=True)):
            assert set(lp.top) == set(top), f"request {i} step {step}: top-{TOP} tokens differ under {kw}"
            for token, value in top.items():
                assert abs(lp.top[token] - value) <= LOGPROB_ATOL, (i, step, token, lp.top[token], value, kw)
    llm.shutdown()


# -- refusals: every key that changes the math and that kvfleet does not compute --------------------------------

BASE = {"model_type": "llama", "vocab_size": VOCAB, "hidden_size": 32, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 48, "num_hidden_layers": 1,
        "max_position_embeddings": MAX_POSITIONS, "schema": "5.x"}


def edited(tmp_path: Path, base: dict[str, Any], **changes: Any) -> Path:
    """A transformers-saved checkpoint whose config.json then gets `changes` (None deletes a key)."""
    model_dir = tmp_path / "ckpt"
    save_checkpoint(base, model_dir, 0)
    path = model_dir / "config.json"
    c = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            c.pop(key, None)
        else:
            c[key] = value
    path.write_text(json.dumps(c))
    return model_dir


@pytest.mark.parametrize(("changes", "named"), [
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}}, "rope_parameters.rope_type"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 4,
                          "long_factor": [1.0] * 4}}, "rope_parameters.rope_type"),
    ({"rope_parameters": None, "rope_theta": 10000.0, "rope_scaling": {"type": "dynamic", "factor": 2.0}},
     "rope_scaling.rope_type"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0}}, "lacks factor"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True}}, "quantization_config"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 3}}, "quantization_config.bits"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e4},
                          "sliding_attention": {"rope_type": "default", "rope_theta": 1e6}}}, "differs by layer type"),
    ({"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3"}, "architectures"),
])
def test_refused_configs_name_file_and_key(tmp_path: Path, changes: dict[str, Any], named: str) -> None:
    model_dir = edited(tmp_path, BASE, **changes)
    for load in (lambda: ModelConfig.from_dir(str(model_dir)), lambda: LLM(model=str(model_dir), dtype="float32")):
        with pytest.raises(ValueError) as info:
            load()
        assert str(model_dir / "config.json") in str(info.value) and named in str(info.value), info.value


def test_layer_types_of_the_wrong_length_are_refused(tmp_path: Path) -> None:
    base = {**BASE, "model_type": "qwen3", "head_dim": 8, "use_sliding_window": True, "sliding_window": 48}
    model_dir = edited(tmp_path, base, layer_types=["full_attention", "sliding_attention"])
    with pytest.raises(ValueError, match="layer_types"):
        ModelConfig.from_dir(str(model_dir))


def test_qwen3_weights_under_a_qwen2_config_are_refused_naming_the_tensor(tmp_path: Path) -> None:
    base = {**BASE, "model_type": "qwen3", "head_dim": 8}
    model_dir = edited(tmp_path, base, architectures=["Qwen2ForCausalLM"], model_type="qwen2")
    with pytest.raises(ValueError, match=r"[qk]_norm"):
        LLM(model=str(model_dir), dtype="float32", kv_cache_memory_bytes=1 << 20)
