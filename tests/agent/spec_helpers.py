"""Shared by the speculative-decoding tests: one offline run, the comparison with plain decoding, the counters."""

from __future__ import annotations

from typing import Any

import pytest
from llm_helpers import ENGINE_OPTIONS

from kvfleet_agent.llm import LLM
from kvfleet_agent.outputs import CompletionOutput
from kvfleet_agent.sampling_params import SamplingParams


def run(ckpt: str, prompts: list[Any], params: SamplingParams | list[SamplingParams], spec: dict[str, Any] | None,
        **options: Any) -> tuple[list[CompletionOutput], LLM]:
    """The prompts' completions through LLM.generate with this speculative config (None: none), and the LLM."""
    llm = LLM(model=ckpt, **{**ENGINE_OPTIONS, **options}, speculative_config=spec)
    outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    return outs, llm


def same(a: list[CompletionOutput], b: list[CompletionOutput]) -> None:
    """Token for token; logprobs to float rounding (another batch around a row changes its last bits)."""
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert (x.token_ids, x.text, x.finish_reason, x.stop_reason) == (y.token_ids, y.text, y.finish_reason,
                                                                         y.stop_reason), f"request {i} diverged"
        assert (x.logprobs is None) == (y.logprobs is None)
        for p, q in zip(x.logprobs or [], y.logprobs or [], strict=True):
            assert p.token_id == q.token_id and list(p.top) == list(q.top)
            assert p.logprob == pytest.approx(q.logprob, abs=1e-4)


def drafted(llm: LLM) -> tuple[int, int]:
    """(draft tokens verified, draft tokens accepted) so far."""
    spec = llm.engine.stats().spec
    assert spec is not None
    return spec.num_draft_tokens, spec.num_accepted_tokens
