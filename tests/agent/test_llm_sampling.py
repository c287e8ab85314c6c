"""Tests of what LLM.generate samples: greedy, seeded and cut sampling, and logprobs against transformers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from llm_helpers import PROMPTS, greedy, one, tokens

from kvfleet_agent.llm import LLM
from kvfleet_agent.sampling_params import SamplingParams

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_model(ckpt: Path) -> Any:
    return transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()


# --- greedy and seeded sampling through the engine ------------------------------------------------


def test_greedy_is_deterministic_and_batch_independent(llm: LLM) -> None:
    first = tokens(llm, PROMPTS, greedy())
    second = tokens(llm, PROMPTS, greedy())
    assert first == second
    assert all(len(t) == 16 for t in first)
    # Alone, or batched in another order beside random requests: the same tokens.
    for i, prompt in enumerate(PROMPTS):
        assert tokens(llm, [prompt], greedy()) == [first[i]]
    mixed = tokens(llm, [PROMPTS[2], PROMPTS[0], PROMPTS[1]],
                    [SamplingParams(temperature=1.0, max_tokens=30), greedy(), SamplingParams(top_k=5)])
    assert mixed[1] == first[0]


def test_seeded_sampling_is_reproducible_and_batch_independent(llm: LLM) -> None:
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=24, ignore_eos=True)
    alone = tokens(llm, [PROMPTS[1]], seeded)[0]
    assert tokens(llm, [PROMPTS[1]], seeded)[0] == alone
    assert alone != tokens(llm, [PROMPTS[1]], greedy(24))[0]  # it really sampled

    others = [
        SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True),  # unseeded: uses the shared generator
        seeded,
        SamplingParams(temperature=0.7, top_k=20, max_tokens=5),
        SamplingParams(temperature=1.0, seed=1, max_tokens=30, ignore_eos=True),
        seeded,  # a second request with the same seed draws exactly the same tokens
    ]
    batch = tokens(llm, [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[3], PROMPTS[1]], others)
    assert batch[1] == alone
    assert batch[4] == alone


def test_different_seeds_give_different_samples(llm: LLM) -> None:
    outs = {
        seed: tuple(tokens(llm, [PROMPTS[0]], SamplingParams(seed=seed, max_tokens=16, ignore_eos=True))[0])
        for seed in (1, 2, 3)
    }
    assert len(set(outs.values())) == 3


def test_unseeded_sampling_varies(llm: LLM) -> None:
    params = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    batch = [tuple(t) for t in tokens(llm, [PROMPTS[0]] * 6, params)]
    assert len(set(batch)) == 6
    again = [tuple(t) for t in tokens(llm, [PROMPTS[0]] * 6, params)]
    assert not set(batch) & set(again)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, top_k=1, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=5.0, top_k=1, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=1.0, top_p=1e-6, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=3.0, top_k=50, top_p=1e-6, max_tokens=16, ignore_eos=True, seed=3),
    ],
    ids=["top_k=1", "top_k=1,T=5", "top_p=1e-6", "top_k=50,top_p=1e-6,T=3"],
)
def test_degenerate_cuts_equal_greedy(llm: LLM, params: SamplingParams) -> None:
    assert tokens(llm, PROMPTS, params) == tokens(llm, PROMPTS, greedy())


# --- logprobs against transformers ---------------------------------------------------------------


@pytest.mark.parametrize(
    "params",
    [
        greedy(12, logprobs=5),
        SamplingParams(temperature=1.0, seed=11, max_tokens=12, ignore_eos=True, logprobs=3),
        SamplingParams(temperature=1.5, top_k=40, seed=12, max_tokens=12, ignore_eos=True, logprobs=1),
    ],
    ids=["greedy,k=5", "T=1,k=3", "T=1.5,top_k=40,k=1"],
)
def test_logprobs_match_transformers(llm: LLM, hf_model: Any, params: SamplingParams) -> None:
    outs = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    k = params.logprobs
    assert k is not None
    for out in outs:
        comp = out.outputs[0]
        assert comp.logprobs is not None and len(comp.logprobs) == len(comp.token_ids) == params.max_tokens
        ids = out.prompt_token_ids + comp.token_ids
        with torch.no_grad():
            logits = hf_model(torch.tensor([ids])).logits[0].double()
        n_prompt = len(out.prompt_token_ids)
        ref = torch.log_softmax(logits[n_prompt - 1:-1], dim=-1)  # row i predicts generated token i
        for i, (tok, lp) in enumerate(zip(comp.token_ids, comp.logprobs, strict=True)):
            assert lp.token_id == tok
            assert abs(lp.logprob - float(ref[i, tok])) <= 1e-4, (i, lp.logprob, float(ref[i, tok]))
            assert len(lp.top) == k
            argmax = int(ref[i].argmax())
            assert argmax in lp.top
            ref_top = torch.topk(ref[i], k)
            assert sorted(lp.top.values(), reverse=True) == pytest.approx(ref_top.values.tolist(), abs=1e-4)
            for alt, value in lp.top.items():
                assert abs(value - float(ref[i, alt])) <= 1e-4
            if params.greedy:
                assert float(ref[i, tok]) >= float(ref[i].max()) - 1e-4


def test_logprobs_zero_returns_only_the_sampled_token(llm: LLM) -> None:
    comp = one(llm, PROMPTS[0], greedy(4, logprobs=0))
    assert comp.logprobs is not None and len(comp.logprobs) == 4
    assert all(lp.top == {} and lp.logprob <= 0.0 for lp in comp.logprobs)
    assert one(llm, PROMPTS[0], greedy(4)).logprobs is None
