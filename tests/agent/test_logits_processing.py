"""Logits processing: penalties, min_p, logit_bias and min_tokens, against their definitions and statistically."""

from __future__ import annotations

import torch

from kvfleet_agent import LLM, SamplingParams
from kvfleet_agent.core.scheduler_output import TokenHistory
from kvfleet_agent.worker.logits_processing import process_logits
from kvfleet_agent.worker.sampler import Sampler

V = 8
EOS = 7


def _history(prompt: list[int], output: list[int]) -> TokenHistory:
    return TokenHistory(prompt + output, len(prompt), frozenset({EOS}))


def _sample(logits: torch.Tensor, params: list[SamplingParams], histories: list[TokenHistory | None]) -> list[int]:
    tokens, _ = Sampler(0, torch.device("cpu")).sample(logits, [f"r{i}" for i in range(len(params))], params,
                                                       histories)
    return tokens


def test_penalties_match_their_definitions() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 0.0, 1.0, 0.2]])
    h = _history(prompt=[1], output=[3, 3, 2])
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    out = process_logits(logits.clone(), [0], [params], [h])[0]
    expected = logits[0].clone()
    expected[1] *= 2.0  # seen in the prompt, negative: multiplied
    expected[3] = 3.0 / 2.0 - 0.5 * 2 - 0.25  # generated twice, positive: divided, then frequency and presence
    expected[2] = 0.5 / 2.0 - 0.5 * 1 - 0.25
    torch.testing.assert_close(out, expected)


def test_logit_bias_forces_and_bans_tokens_even_when_greedy() -> None:
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0.0, logit_bias={5: 100.0}), SamplingParams(logit_bias={2: 100.0}, seed=1),
              SamplingParams(temperature=0.0, logit_bias={int(logits[2].argmax()): -100.0}),
              SamplingParams(temperature=0.0)]
    tokens = _sample(logits, params, [None] * 4)
    assert tokens[:2] == [5, 2]
    assert tokens[2] != int(logits[2].argmax())
    assert tokens[3] == int(logits[3].argmax())  # a row without processing, batched with processed ones


def test_min_tokens_masks_eos_and_stop_tokens_until_reached() -> None:
    logits = torch.zeros(3, V)
    logits[:, EOS] = 50.0  # EOS is all but certain
    logits[:, 4] = 49.0  # then the stop token
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[4])
    early, last, done = _history([1], []), _history([1], [0, 0]), _history([1], [0, 0, 0])
    assert _sample(logits, [params] * 3, [early, last, done]) == [0, 0, EOS]


def test_min_p_drops_unlikely_tokens_and_keeps_the_proportions_of_the_rest() -> None:
    logits = torch.log(torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05]))
    n = 20000
    params = [SamplingParams(min_p=0.3, seed=i) for i in range(n)]  # threshold 0.12: tokens 3 and 4 never
    tokens = torch.tensor(_sample(logits.repeat(n, 1), params, [None] * n))
    freq = torch.bincount(tokens, minlength=5).double() / n
    assert freq[3] == 0 and freq[4] == 0
    expected = torch.tensor([0.4, 0.3, 0.15], dtype=torch.float64) / 0.85
    assert bool(((freq[:3] - expected).abs() < 5 * (expected * (1 - expected) / n).sqrt()).all()), freq


def test_frequency_penalty_makes_sampled_tokens_measurably_less_repetitive() -> None:
    # Rows of one request's output so far, some tokens drawn many times: sampled with a frequency penalty,
    # those tokens come up far less often than without.
    n = 4000
    logits = torch.zeros(n, V)
    histories: list[TokenHistory | None] = [_history([6], [0, 0, 0, 0, 1, 1, 1, 1])] * n
    plain = _sample(logits, [SamplingParams(seed=i) for i in range(n)], histories)
    penalised = _sample(logits, [SamplingParams(seed=i, frequency_penalty=1.0) for i in range(n)], histories)
    repeats = [sum(t in (0, 1) for t in tokens) / n for tokens in (plain, penalised)]
    assert abs(repeats[0] - 2 / V) < 0.05  # uniform: 2 of 8 tokens
    # exp(-4) of their weight each: about 0.6% of the draws
    assert repeats[1] < 0.02, repeats


def test_penalties_lower_repeats_of_a_random_model(llm: LLM) -> None:
    # A random model's greedy output falls into loops; penalties must break them, measurably.
    prompts = [[1, 2, 3, 4 + i] for i in range(8)]

    def repeated(params: SamplingParams) -> float:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        ids = [o.outputs[0].token_ids for o in outs]
        return sum(len(t) - len(set(t)) for t in ids) / sum(len(t) for t in ids)

    base = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    plain = repeated(base)
    for name, value in (("frequency_penalty", 2.0), ("presence_penalty", 2.0), ("repetition_penalty", 3.0)):
        penalised = repeated(SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, **{name: value}))
        assert penalised < plain / 2, (name, plain, penalised)
