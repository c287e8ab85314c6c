"""Prompt logprobs from the engine: computed over prefill chunks, never skipped by a prefix-cache hit, and equal to
the logprob of each prompt token given the tokens before it (one-token generations as the reference)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfleet_agent import LLM, SamplingParams

PROMPT = [(i * 37 + 11) % 700 + 3 for i in range(45)]


@pytest.fixture(scope="module")
def chunked(ckpt: Path) -> LLM:
    # 16-token prefill chunks, 16-token blocks: the 45-token prompt spans three chunks and two full blocks.
    return LLM(model=str(ckpt), max_num_batched_tokens=16, block_size=16)


def _reference(llm: LLM) -> list[float]:
    """logprob of PROMPT[q] after PROMPT[:q], from a one-token generation's full logprobs."""
    out = []
    for q in range(1, len(PROMPT)):
        r = llm.generate([{"prompt_token_ids": PROMPT[:q]}], SamplingParams(max_tokens=1, logprobs=1000),
                         use_tqdm=False)[0]
        lp = r.outputs[0].logprobs
        assert lp is not None
        out.append(lp[0].top[PROMPT[q]])
    return out


def test_prompt_logprobs_over_chunks_match_the_one_step_reference(chunked: LLM) -> None:
    out = chunked.generate([{"prompt_token_ids": PROMPT}], SamplingParams(max_tokens=2, prompt_logprobs=3),
                           use_tqdm=False)[0]
    got = out.prompt_logprobs
    assert got is not None and len(got) == len(PROMPT) and got[0] is None
    assert all(lp is not None and lp.token_id == t and len(lp.top) == 3 for lp, t in zip(got[1:], PROMPT[1:],
                                                                                          strict=True))
    want = _reference(chunked)
    assert [lp.logprob for lp in got[1:]] == pytest.approx(want, abs=1e-4)  # type: ignore[union-attr]


def test_a_cached_prefix_does_not_skip_prompt_logprobs(chunked: LLM) -> None:
    plain = SamplingParams(max_tokens=1)
    chunked.generate([{"prompt_token_ids": PROMPT}], plain, use_tqdm=False)  # the prompt's blocks now cached
    cached = chunked.generate([{"prompt_token_ids": PROMPT}], plain, use_tqdm=False)[0]
    assert cached.num_cached_tokens == 32  # a plain request does hit them
    scored = chunked.generate([{"prompt_token_ids": PROMPT}], SamplingParams(max_tokens=1, prompt_logprobs=0),
                              use_tqdm=False)[0]
    assert scored.num_cached_tokens == 0 and scored.prompt_logprobs is not None
    assert all(lp is not None for lp in scored.prompt_logprobs[1:])



def test_prompt_token_ranks_count_the_vocabulary_entries_above_them(chunked: LLM) -> None:
    out = chunked.generate([{"prompt_token_ids": PROMPT}], SamplingParams(max_tokens=1, prompt_logprobs=1000),
                           use_tqdm=False)[0]
    assert out.prompt_logprobs is not None
    ranks = []
    for lp in out.prompt_logprobs[1:]:
        assert lp is not None and lp.rank is not None
        assert len(lp.top) < 1000  # k was capped at the vocabulary: top is the whole distribution
        assert lp.rank == 1 + sum(v > lp.logprob for v in lp.top.values())
        ranks.append(lp.rank)
    assert max(ranks) > 1  # a random model's prompt is not its own argmax everywhere: the count is exercised
