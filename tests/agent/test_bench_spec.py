"""bench spec: configurations interleaved step by step, each on its own clock; each configuration against `off` as the
median of per-round paired ratios; no prompt served twice in a run."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvfleet_agent.bench.spec import Prompts, Run, measure, repeats, spec_config, summarize, table
from kvfleet_agent.llm import LLM
from kvfleet_agent.outputs import RequestOutput


def run(tps: float, drafts: int = 0, accepted: int = 0) -> Run:
    return Run(decoded=int(tps), seconds=1.0, itl=[1 / tps], tokens=64, drafts=drafts, accepted=accepted)


def test_no_source_line_serves_two_prompts_in_a_round_and_each_has_its_shape() -> None:
    # Two rounds of a full run's draw (batches 1, 4, 16 and 64): suffix decoding would find a repeated prompt's own
    # greedy answer among the outputs it keeps, or most of it where two prompts share lines.
    pool = Prompts(seed=0)
    for _ in range(2):
        pool.new_round()
        lines: list[str] = []
        for b in (64, 16, 4, 1):
            for w in ("edit", "code", "long"):
                for p in pool.take(w, b * repeats(b)):
                    got = p.splitlines()
                    if w == "edit":
                        assert len(got) == 8 and got[6] == "" and got[7] == got[0] and all(got[:6])
                        got = got[:6]
                    else:
                        assert len(got) == 3 and p.endswith("\n") and all(got)
                    lines += got
        # Every prompt's source lines are its own: their union is as large as their sum.
        assert len(lines) == len(pool._used_lines) == 6 * 344 + 3 * 2 * 344
    a, b = Prompts(seed=0), Prompts(seed=1)
    assert a.take("code", 5) == Prompts(seed=0).take("code", 5) != b.take("code", 5)
    with pytest.raises(RuntimeError, match="no more distinct 'edit' prompts"):
        Prompts(seed=0).take("edit", 10**6)


def test_the_ratio_to_off_pairs_rounds_so_drift_between_rounds_cancels() -> None:
    # The machine ran round 2 at 1.5x round 1's speed and round 3 twice as fast: a ratio of medians reads 0.75x,
    # while the configuration was 0.95x of `off` in two rounds of three.
    samples = {("edit", 4, "off"): [run(100), run(300), run(200)],
               ("edit", 4, "ngram"): [run(95, 10, 20), run(150, 10, 0), run(190, 10, 10)]}
    cells = {c.config: c for c in summarize(samples)}
    assert cells["ngram"].decode_tps == 150.0 and cells["ngram"].vs_off == pytest.approx(0.95)
    assert cells["off"].vs_off == 1.0 and cells["off"].mean_accepted_length is None
    assert cells["ngram"].mean_accepted_length == pytest.approx(1 + 30 / 30)
    assert "0.95x" in table(list(cells.values()))


def test_without_off_there_is_no_ratio() -> None:
    cells = summarize({("code", 1, "draft"): [run(50, 4, 2)]})
    assert cells[0].vs_off is None and "nan" in table(cells)


def test_batches_of_a_round_pool_their_tokens_and_seconds() -> None:
    pooled = Run()
    pooled.add(Run(decoded=60, seconds=0.5, itl=[0.01], tokens=64, drafts=3, accepted=6))
    pooled.add(Run(decoded=20, seconds=0.5, itl=[0.02], tokens=64))
    assert pooled.tps == 80.0 and pooled.itl == [0.01, 0.02] and (pooled.tokens, pooled.drafts) == (128, 3)
    assert [repeats(b) for b in (1, 2, 4, 16, 64)] == [8, 4, 4, 4, 4]


def test_configurations_run_each_batch_step_by_step_on_their_own_clocks(tiny_checkpoint: Callable[..., str]) -> None:
    """measure interleaves the engines' steps: each run counts every token once, times its decode tokens on its own
    engine's clock (the other engines' steps are not in it) and gives each token after a request's first an ITL."""
    model = tiny_checkpoint("llama")
    engines = {c: LLM(model=model, max_model_len=128, speculative_config=spec_config(c, model, 2))
               for c in ("off", "ngram", "draft")}
    batch = ["def f(x):\n    return x\n\ndef f(x):", "import os\nimport sys\n"]
    steps = {c: 0 for c in engines}
    for c, llm in engines.items():
        step = llm.engine.step

        def counted(c: str = c, step: Callable[[], list[RequestOutput]] = step) -> list[RequestOutput]:
            steps[c] += 1
            return step()

        llm.engine.step = counted  # type: ignore[method-assign]
    runs = measure(engines, batch, 9, turn=1)
    for c, got in runs.items():
        assert got.tokens == 2 * 9 and len(got.itl) == got.tokens - 2, c
        assert 0 < got.decoded <= got.tokens - 2 and got.seconds > 0 and all(x > 0 for x in got.itl), c
    assert runs["off"].drafts == 0 and runs["draft"].drafts > 0  # the target as its own draft: drafts verified
    assert steps["off"] >= 9 and steps["draft"] < steps["off"]  # it accepts: fewer steps for the same tokens
