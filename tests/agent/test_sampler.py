"""Tests of the Sampler on its own: the top-k / top-p cut and the distribution of sampled tokens."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfleet_agent.core.scheduler_output import TokenHistory
from kvfleet_agent.sampling_params import SamplingParams
from kvfleet_agent.worker.sampler import Sampler, _cut

# --- the top-k / top-p cut -----------------------------------------------------------------------


def _reference_keep(row: list[float], k: int, p: float) -> tuple[set[int], set[int]]:
    """Tokens that must be kept and tokens that must be dropped, in float64 (near-boundary tokens in neither)."""
    order = sorted(range(len(row)), key=lambda i: -row[i])
    if k > 0:
        order = order[:k]
    top = max(row[i] for i in order)
    weights = [math.exp(row[i] - top) for i in order]
    total = sum(weights)
    must: set[int] = set()
    never = set(range(len(row))) - set(order)
    above = 0.0  # probability mass of the tokens ranked above this one
    for i, w in zip(order, weights, strict=True):
        if above <= p - 1e-5 or i == order[0]:
            must.add(i)
        elif above > p + 1e-5:
            never.add(i)
        above += w / total
    return must, never


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_cut_matches_per_row_reference(data: st.DataObject) -> None:
    vocab = data.draw(st.integers(1, 40), label="vocab")
    n_rows = data.draw(st.integers(1, 4), label="rows")
    logit = st.floats(-30, 30, allow_nan=False, allow_infinity=False, width=32)
    # Distinct logits per row: with ties the top-k set is a matter of tie-breaking.
    rows = [data.draw(st.lists(logit, min_size=vocab, max_size=vocab, unique=True), label="row")
            for _ in range(n_rows)]
    top_k = data.draw(st.lists(st.integers(0, vocab + 2), min_size=n_rows, max_size=n_rows), label="top_k")
    top_p = data.draw(st.lists(st.floats(1e-6, 1.0), min_size=n_rows, max_size=n_rows), label="top_p")
    logits = torch.tensor(rows, dtype=torch.float32)

    out = _cut(logits.clone(), top_k, top_p)

    assert out.shape == logits.shape
    for r in range(n_rows):
        kept = torch.isfinite(out[r])
        assert kept.any(), "every row keeps at least one token"
        assert torch.equal(out[r][kept], logits[r][kept]), "kept logits are unchanged"
        assert bool(torch.isneginf(out[r][~kept]).all())
        must, never = _reference_keep(rows[r], top_k[r], top_p[r])
        kept_ids = set(torch.nonzero(kept).flatten().tolist())
        assert must <= kept_ids, (must - kept_ids, top_k[r], top_p[r])
        assert not (never & kept_ids), (never & kept_ids, top_k[r], top_p[r])
        if top_k[r] > 0:
            assert len(kept_ids) <= top_k[r]


def test_cut_with_top_p_one_and_no_top_k_keeps_every_token() -> None:
    # A row that disables both cuts, batched with a row that uses top-k (so _cut runs on the batch).
    row = 8.0 * torch.sin(1.7 * torch.arange(100, dtype=torch.float32))
    logits = torch.stack([row, row])
    out = _cut(logits.clone(), [0, 5], [1.0, 0.5])
    assert torch.equal(out[0], row), f"{int(torch.isinf(out[0]).sum())} tokens dropped from a top_p=1 row"


# --- the sampled distribution ----------------------------------------------------------------------

_DIST_LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, -4.0])
_DRAWS = 20000


def _frequencies(params: list[SamplingParams], logits: torch.Tensor = _DIST_LOGITS) -> torch.Tensor:
    sampler = Sampler(seed=0, device=torch.device("cpu"))
    tokens, logprobs = sampler.sample(logits.repeat(len(params), 1), [f"r{i}" for i in range(len(params))], params)
    assert logprobs == [None] * len(params)
    return torch.bincount(torch.tensor(tokens), minlength=logits.numel()).double() / len(params)


def _assert_matches(freq: torch.Tensor, expected: torch.Tensor, n: int) -> None:
    expected = expected.double()
    sigma = (expected * (1 - expected) / n).sqrt()
    err = (freq - expected).abs()
    assert bool((err <= 5 * sigma + 1e-3).all()), f"freq {freq.tolist()} vs expected {expected.tolist()}"


def test_temperature_one_matches_softmax() -> None:
    freq = _frequencies([SamplingParams(temperature=1.0)] * _DRAWS)
    _assert_matches(freq, torch.softmax(_DIST_LOGITS.double(), -1), _DRAWS)


def test_temperature_half_sharpens() -> None:
    freq = _frequencies([SamplingParams(temperature=0.5)] * _DRAWS)
    expected = torch.softmax(_DIST_LOGITS.double() / 0.5, -1)
    _assert_matches(freq, expected, _DRAWS)
    assert freq[0] > torch.softmax(_DIST_LOGITS.double(), -1)[0] + 0.1  # the top token gained mass


def test_top_k_three_samples_only_the_top_three() -> None:
    freq = _frequencies([SamplingParams(temperature=1.0, top_k=3)] * _DRAWS)
    assert bool((freq[3:] == 0).all())
    expected = torch.zeros(8, dtype=torch.float64)
    expected[:3] = torch.softmax(_DIST_LOGITS[:3].double(), -1)
    _assert_matches(freq, expected, _DRAWS)


def test_top_p_samples_the_nucleus() -> None:
    probs = torch.softmax(_DIST_LOGITS.double(), -1)  # ≈ .50 .19 .11 .07 .04 .02 .01 .00
    top_p = float(probs[:2].sum()) + 0.01  # the mass above token 2 is below top_p, above token 3 it is not
    freq = _frequencies([SamplingParams(temperature=1.0, top_p=top_p)] * _DRAWS)
    assert bool((freq[3:] == 0).all())
    _assert_matches(freq, torch.cat([probs[:3] / probs[:3].sum(), torch.zeros(5, dtype=torch.float64)]), _DRAWS)


def test_seeded_rows_draw_from_their_own_generators() -> None:
    n = 4000
    # The same seed in every row: every request draws the same noise, so the same token.
    same = _frequencies([SamplingParams(seed=5)] * n)
    assert float(same.max()) == 1.0
    # One seed per request: still distributed as softmax across requests.
    freq = _frequencies([SamplingParams(seed=s) for s in range(n)])
    _assert_matches(freq, torch.softmax(_DIST_LOGITS.double(), -1), n)


def test_top_k_beyond_the_vocabulary_cuts_nothing() -> None:
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(_cut(logits, [2**63, 10**6], [1.0, 1.0]), logits)


def test_bfloat16_logits_sample_as_their_float32_values() -> None:
    """Greedy rows take the argmax of the model's own bf16 logits; everything else runs in float32: the tokens and
    logprobs are those of the same logits given in float32, row by row, with processed and random rows beside."""
    logits16 = (torch.randn(5, 300, generator=torch.Generator().manual_seed(11)) * 3).bfloat16()
    logits16[0, [17, 201]] = logits16[0].max() + 1  # a tie: the first index
    params = [SamplingParams(temperature=0.0, logprobs=3), SamplingParams(temperature=0.0),
              SamplingParams(seed=4, top_k=20), SamplingParams(temperature=0.0, repetition_penalty=1.3),
              SamplingParams(seed=9, logprobs=2)]
    histories = [None, None, None, TokenHistory([17, 40, 201, 5], 3, frozenset()), None]
    ids = [f"r{i}" for i in range(5)]
    got = Sampler(0, torch.device("cpu")).sample(logits16, ids, params, histories)
    want = Sampler(0, torch.device("cpu")).sample(logits16.float(), ids, params, histories)
    assert got == want
    assert got[0][0] == 17 and got[0][1] == int(logits16[1].float().argmax())
