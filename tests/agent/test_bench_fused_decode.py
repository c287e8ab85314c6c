"""bench.fused_decode: both paths timed step by step, and the requests' tokens untouched by the alternation."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvfleet_agent import LLM
from kvfleet_agent.bench import fused_decode
from kvfleet_kernels import cpu_decode


@pytest.mark.skipif(not cpu_decode.available(), reason="no C++ compiler: no one-call stack to compare")
def test_the_paths_alternate_and_both_are_timed(tiny_checkpoint: Callable[..., str],
                                                capsys: pytest.CaptureFixture[str]) -> None:
    llm = LLM(model=tiny_checkpoint("llama"), dtype="float32", max_model_len=128)
    times = fused_decode.ab_steps(llm, 3, 10, 9)
    assert len(times["one call"]) + len(times["modules"]) == 8  # 8 decode steps after the prefill's first token
    assert len(times["one call"]) == len(times["modules"]) == 4
    assert llm.engine.runner.model.fused_decode is not None  # restored
    assert fused_decode.main(["--model", tiny_checkpoint("llama"), "--batch", "1", "2", "--new-tokens", "6"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    assert [r[0] for r in rows] == ["1", "2"] and all(r[3].endswith("x") for r in rows)


def test_a_model_without_the_stack_is_refused_with_the_reason_to_look_for(tiny_checkpoint: Callable[..., str]) -> None:
    llm = LLM(model=tiny_checkpoint("llama"), dtype="float16", max_model_len=128)
    with pytest.raises(SystemExit, match="cannot run the one-call stack"):
        fused_decode.ab_steps(llm, 1, 4, 4)
