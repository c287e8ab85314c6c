"""Decode rows per attention call on CPU: one call for every row where cpu_attention reads the cache in place."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvfleet_agent import LLM, SamplingParams
from kvfleet_agent.worker.step_batch import DECODE_GROUP, ONE_GROUP
from kvfleet_kernels import cpu_attention


def test_the_in_place_kernel_takes_every_decode_row_in_one_call(tiny_checkpoint: Callable[..., str]) -> None:
    runner = LLM(model=tiny_checkpoint("llama"), dtype="float32").engine.runner
    assert runner.decode_group == (ONE_GROUP if cpu_attention.available() else DECODE_GROUP)
    # float16 queries are not the kernel's: the reference gathers, in groups sized for its copy to stay in cache.
    assert LLM(model=tiny_checkpoint("llama"), dtype="float16").engine.runner.decode_group == DECODE_GROUP


@pytest.mark.skipif(not cpu_attention.available(), reason="no C++ compiler: the reference gathers in groups")
def test_one_call_or_groups_of_16_give_the_same_tokens(tiny_checkpoint: Callable[..., str]) -> None:
    """The kernel's arithmetic per sequence never depends on the rows beside it: 40 requests decode the same
    greedy tokens in one attention call per layer as in three."""
    llm = LLM(model=tiny_checkpoint("llama"), dtype="float32")
    prompts = [{"prompt_token_ids": [5 + i % 50, 9, 30 + i] * (1 + i % 7)} for i in range(40)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    one = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    llm.engine.runner.decode_group = DECODE_GROUP
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == one
