"""The one-call decode stack (models/fused_decode.py): bit for bit the layers' own path, taken where it can run."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from kvfleet_agent import LLM, SamplingParams
from kvfleet_agent.layers.attention import AttentionMetadata, PrefillSpan
from kvfleet_agent.models.fused_decode import FusedDecode, why_not
from kvfleet_agent.models.llama import LlamaForCausalLM
from kvfleet_kernels import cpu_decode
from tests.agent.hf_llama import copy_tokenizer

pytestmark = pytest.mark.skipif(not cpu_decode.available(), reason="no C++ compiler: decode steps run the modules")

PROMPTS = [{"prompt_token_ids": [5 + i, 9, 30 + 7 * i, 11] * (1 + i % 4)} for i in range(6)]


class Twin:
    """Stands in for a model's stack: every step it takes also runs through the layers' modules first (the caches
    restored after), and the two final hidden states must be equal bit for bit."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        assert model.fused_decode is not None
        self.model, self.fused = model, model.fused_decode
        self.steps = self.rows = self.mismatches = 0
        model.fused_decode = self

    def applies(self, x: torch.Tensor, meta: AttentionMetadata) -> bool:
        return self.fused.applies(x, meta)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        layers = [layer.self_attn.attn for layer in self.model.layers]
        saved = [(a.k_cache.clone(), a.v_cache.clone()) for a in layers]
        h, residual = x, None
        for layer in self.model.layers:
            h, residual = layer(positions, h, residual, meta)
        expected = self.model.norm(h, residual)[0]
        written = [(a.k_cache.clone(), a.v_cache.clone()) for a in layers]
        for a, (k, v) in zip(layers, saved, strict=True):
            a.k_cache.copy_(k)
            a.v_cache.copy_(v)
        out = self.fused(x, positions, meta)
        same_kv = all(torch.equal(a.k_cache, k) and torch.equal(a.v_cache, v)
                      for a, (k, v) in zip(layers, written, strict=True))
        self.steps += 1
        self.rows += x.shape[0]
        self.mismatches += int(not (torch.equal(out, expected) and same_kv))
        return out


def tokens(llm: LLM, params: SamplingParams, prompts: list[Any] = PROMPTS) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def qwen3_checkpoint(out: Path, tokenizer_from: str, seed: int = 3) -> str:
    """A 2-layer Qwen3 (per-head q/k norms) made and saved by transformers itself."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512,
                                      max_position_embeddings=128, tie_word_embeddings=False)
    model = transformers.Qwen3ForCausalLM(config)
    with torch.no_grad():  # sharper logits: greedy choices with clear winners
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    model.save_pretrained(out)
    return copy_tokenizer(tokenizer_from, out)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "qwen3"])
def test_every_decode_step_is_the_layers_bit_for_bit(arch: str, dtype: str, tiny_checkpoint: Callable[..., str],
                                                      tmp_path: Path) -> None:
    model = (qwen3_checkpoint(tmp_path / "qwen3", tiny_checkpoint("llama")) if arch == "qwen3"
             else tiny_checkpoint(arch))
    llm = LLM(model=model, dtype=dtype, max_model_len=128)
    twin = Twin(llm.engine.runner.model)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    fused = tokens(llm, params)
    # The prompts (52 tokens, as decode rows: each ends within PROMPT_ROWS), then 11 decode steps of 6 rows each.
    assert (twin.steps, twin.rows, twin.mismatches) == (12, 52 + 66, 0)
    llm.engine.runner.model.fused_decode = None
    assert tokens(llm, params) == fused


def test_verifications_and_the_draft_model_take_it_too(tiny_checkpoint: Callable[..., str]) -> None:
    """Speculation's steps are decode rows too (k + 1 per verification), and so are a draft model's proposals:
    both run the op, and greedy outputs stay those of plain decoding."""
    target, draft = tiny_checkpoint("llama"), tiny_checkpoint("llama", seed=5)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    plain = tokens(LLM(model=target, dtype="float32", max_model_len=128), params)
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 3, "adaptive": False}
    llm = LLM(model=target, dtype="float32", max_model_len=128, speculative_config=spec)
    runner = llm.engine.runner
    assert runner.draft is not None
    twin, draft_twin = Twin(runner.model), Twin(runner.draft.model)
    assert tokens(llm, params) == plain
    assert twin.mismatches == draft_twin.mismatches == 0
    assert twin.rows > twin.steps * len(PROMPTS)  # verifications: several rows a request
    assert draft_twin.steps > 0


def test_a_step_with_a_prefill_keeps_the_modules(tiny_checkpoint: Callable[..., str]) -> None:
    model = LLM(model=tiny_checkpoint("llama"), dtype="float32").engine.runner.model
    fused = model.fused_decode
    assert fused is not None
    x = torch.zeros(3, model.cfg.hidden_size)
    slots = torch.zeros(3, dtype=torch.long)
    prefill = AttentionMetadata(slots, [], [PrefillSpan(0, 3, 0, torch.zeros(1, dtype=torch.long))])
    assert not fused.applies(x, prefill)
    assert not fused.applies(x.half(), AttentionMetadata(slots, [], []))


def test_where_it_cannot_run_the_log_says_why(tiny_checkpoint: Callable[..., str], monkeypatch: pytest.MonkeyPatch,
                                              caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger="kvfleet_agent.models.fused_decode")
    quantized = LLM(model=tiny_checkpoint("llama"), dtype="float32", quantization="int8").engine.runner.model
    assert quantized.fused_decode is None
    assert why_not(quantized) == "quantized linears"
    assert "decode steps run the layers one op at a time: quantized linears" in caplog.text
    half = LLM(model=tiny_checkpoint("llama"), dtype="float16").engine.runner.model
    assert half.fused_decode is None and why_not(half) == "torch.float16 weights"
    monkeypatch.setenv(cpu_decode.ENABLE_ENV, "0")
    model = LLM(model=tiny_checkpoint("llama"), dtype="float32").engine.runner.model
    assert model.fused_decode is None and cpu_decode.ENABLE_ENV in str(why_not(model))
    monkeypatch.delenv(cpu_decode.ENABLE_ENV)
    assert FusedDecode.attach(model) and model.fused_decode is not None


def proposals(target: str, dtype: str, spec: dict[str, Any], prompts: list[Any], params: list[SamplingParams],
              one_call: bool) -> tuple[list[dict[str, list[int]]], int]:
    """Every draft step's proposals over one generate, and how many steps ran the loop in one call."""
    llm = LLM(model=target, dtype=dtype, max_model_len=128, speculative_config=spec)
    dm = llm.engine.runner.draft
    assert dm is not None and isinstance(dm.model.fused_decode, FusedDecode)
    fused = dm.model.fused_decode
    if not one_call:
        dm.model.fused_decode = None
    steps: list[dict[str, list[int]]] = []
    calls = [0]
    inner, propose = dm.step, fused.propose_greedy

    def step(*args: Any, **kwargs: Any) -> dict[str, list[int]]:
        out = inner(*args, **kwargs)
        steps.append({rid: list(t) for rid, t in out.items()})
        return out

    def counted(*args: Any, **kwargs: Any) -> torch.Tensor | None:
        calls[0] += 1
        return propose(*args, **kwargs)

    dm.step = step  # type: ignore[method-assign]
    fused.propose_greedy = counted  # type: ignore[method-assign]
    llm.generate(prompts, params)
    return steps, calls[0]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_drafts_greedy_proposals_in_one_call_are_the_loops(dtype: str, tiny_checkpoint: Callable[..., str]) -> None:
    """The draft's proposal loop in C++ (propose_greedy) proposes exactly what the Python loop over the modules
    does, step for step, rows dropping out as their counts run out (max_tokens bounds the last steps')."""
    target, draft = tiny_checkpoint("llama"), tiny_checkpoint("llama", seed=5)
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 4, "adaptive": False}
    prompts = [{"prompt_token_ids": [5 + i, 9, 30 + 7 * i, 11] * (1 + i % 4)} for i in range(5)]
    params = [SamplingParams(max_tokens=9 + 3 * i, temperature=0.0, ignore_eos=True) for i in range(5)]
    fused, calls = proposals(target, dtype, spec, prompts, params, one_call=True)
    looped, none = proposals(target, dtype, spec, prompts, params, one_call=False)
    assert calls > 0 and none == 0
    assert fused == looped
    assert sum(len(t) for s in fused for t in s.values()) > 40


def test_a_transformers_saved_pair_proposes_in_one_call_what_the_loop_does(tiny_checkpoint: Callable[..., str],
                                                                          tmp_path: Path) -> None:
    """The one-call run (catch-up rows, then the proposals) on a Qwen3 target and draft that transformers made and
    saved: every step's proposals are the modules' loop's, including after verifications that rejected drafts."""
    target = qwen3_checkpoint(tmp_path / "target", tiny_checkpoint("llama"))
    draft = qwen3_checkpoint(tmp_path / "draft", tiny_checkpoint("llama"), seed=11)
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 3, "adaptive": False}
    prompts = [{"prompt_token_ids": [7 + i, 40, 3 * i + 90, 12] * (2 + i % 3)} for i in range(4)]
    params = [SamplingParams(max_tokens=10 + 2 * i, temperature=0.0, ignore_eos=True) for i in range(4)]
    fused, calls = proposals(target, "float32", spec, prompts, params, one_call=True)
    looped, none = proposals(target, "float32", spec, prompts, params, one_call=False)
    assert calls > 0 and none == 0 and fused == looped
    assert sum(len(t) for s in fused for t in s.values()) > 30


def answers(llm: LLM, prompts: list[Any], params: list[SamplingParams]) -> list[tuple[list[int], list[float],
                                                                                   list[float]]]:
    """Each request's tokens, its tokens' logprobs and its prompt's logprobs."""
    out = []
    for o in llm.generate(prompts, params, use_tqdm=False):
        c = o.outputs[0]
        out.append((c.token_ids, [lp.logprob for lp in c.logprobs or []],
                    [lp.logprob for lp in o.prompt_logprobs or [] if lp is not None]))
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_prompt_joining_running_decodes_keeps_the_step_in_one_call(dtype: str, tiny_checkpoint: Callable[..., str],
                                                                     tmp_path: Path) -> None:
    """Prompt chunks run as decode rows, so a step where a prompt (or its next chunk) joins other requests' decodes
    takes the stack too; tokens and logprobs, the prompts' included, are those of the same prompts run as prefills
    through the layers' modules (a transformers-saved Qwen3; a small token budget chunks the prompts)."""
    model = qwen3_checkpoint(tmp_path / "qwen3", tiny_checkpoint("llama"))
    prompts = [{"prompt_token_ids": [(13 * i + 7 * j) % 500 + 4 for j in range(9 + 11 * i)]} for i in range(6)]
    params = [SamplingParams(max_tokens=6 + 3 * i, temperature=0.0, ignore_eos=True, logprobs=1, prompt_logprobs=1)
              for i in range(6)]
    llm = LLM(model=model, dtype=dtype, max_model_len=128, max_num_batched_tokens=24)
    runner = llm.engine.runner
    assert runner.rows_within >= 64  # every prompt here ends within it
    twin = Twin(runner.model)
    forwards = [0]
    inner = runner.model.forward

    def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
        forwards[0] += 1
        return inner(*args, **kwargs)

    runner.model.forward = counted  # type: ignore[method-assign]
    as_rows = answers(llm, prompts, params)
    assert twin.mismatches == 0 and twin.steps == forwards[0] > 20  # every step, mixed ones too, took the stack
    runner.model.fused_decode, runner.rows_within = twin.fused, 0
    as_prefills = answers(llm, prompts, params)
    tol = 1e-4 if dtype == "float32" else 5e-2
    for (tok_r, lp_r, plp_r), (tok_p, lp_p, plp_p) in zip(as_rows, as_prefills, strict=True):
        assert tok_r == tok_p
        assert len(plp_r) == len(plp_p) > 0
        assert torch.allclose(torch.tensor(lp_r + plp_r), torch.tensor(lp_p + plp_p), atol=tol, rtol=0)


def test_without_the_stack_prompts_stay_prefills(tiny_checkpoint: Callable[..., str]) -> None:
    """Decode rows without the stack (a quantized KV cache, here) would attend row by row through the layers: no
    prompt runs so."""
    llm = LLM(model=tiny_checkpoint("llama"), dtype="float32", kv_cache_dtype="int8")
    assert llm.engine.runner.rows_within == 0
    llm = LLM(model=tiny_checkpoint("llama"), dtype="float32", quantization="int8")
    assert llm.engine.runner.model.fused_decode is None and llm.engine.runner.rows_within == 0
