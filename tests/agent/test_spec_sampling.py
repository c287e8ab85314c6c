"""Speculative verification: greedy is plain greedy, and rejection sampling keeps the target's distribution exactly."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfleet_agent.sampling_params import SamplingParams
from kvfleet_agent.worker.sampler import Sampler
from kvfleet_agent.worker.spec_sampling import target_probs, verify, verify_batch

V, START, LENGTH, SAMPLES, ALPHA = 6, 0, 3, 20_000, 1e-3
# The "model": a seeded random bigram table (row = previous token); the draft model is a perturbed copy of it.
TABLE = torch.randn(V, V, generator=torch.Generator().manual_seed(7)) * 1.5
DRAFT_TABLE = TABLE + torch.randn(V, V, generator=torch.Generator().manual_seed(8))
Q = torch.softmax(DRAFT_TABLE, dim=-1)
CONFIGS = {"temperature": SamplingParams(temperature=0.8),
           "top_k_top_p": SamplingParams(temperature=0.8, top_k=4, top_p=0.8),
           "min_p": SamplingParams(temperature=0.8, min_p=0.15)}
Drafts = tuple[list[list[int]], list[torch.Tensor] | None]
Rule = Callable[..., list[list[int]]]


def _chi2_sf(x: float, df: int) -> float:
    """P(X > x) for X ~ chi-square(df): the regularized upper incomplete gamma Q(df/2, x/2) (scipy is absent)."""
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(x / 2, dtype=torch.float64)))


def _gof_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square goodness of fit of counts to exact probs; cells expecting fewer than 5 are pooled into one."""
    counts, probs = counts.double().flatten(), probs.double().flatten()
    if counts[probs == 0].sum() > 0:
        return 0.0  # an impossible outcome was observed
    expected = probs * counts.sum()
    big, small = expected >= 5, (expected < 5) & (probs > 0)
    obs, exp = counts[big].tolist(), expected[big].tolist()
    if small.any():
        pooled_o, pooled_e = float(counts[small].sum()), float(expected[small].sum())
        if pooled_e >= 5:
            obs, exp = [*obs, pooled_o], [*exp, pooled_e]
        else:  # still too small: fold it into the smallest cell
            j = exp.index(min(exp))
            obs[j], exp[j] = obs[j] + pooled_o, exp[j] + pooled_e
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp, strict=True))
    return _chi2_sf(stat, len(obs) - 1)


def _exact_next(params: SamplingParams) -> torch.Tensor:
    """[prev, next] target probabilities by the definitions, in float64: min_p, then top-k, then the nucleus."""
    out = torch.zeros(V, V, dtype=torch.float64)
    for prev in range(V):
        logits = TABLE[prev].double() / params.temperature
        probs = torch.softmax(logits, dim=-1)
        kept = [t for t in logits.argsort(descending=True).tolist() if probs[t] >= params.min_p * probs.max()]
        kept = kept[:params.top_k or V]
        mass = torch.softmax(logits[kept], dim=-1).tolist()
        # Keep each token whose strictly-higher mass is at most top_p (the top token always).
        kept = [t for j, t in enumerate(kept) if params.top_p >= 1.0 or sum(mass[:j]) <= params.top_p]
        out[prev, kept] = torch.softmax(logits[kept], dim=-1)
    return out


def _exact_sequences(params: SamplingParams) -> torch.Tensor:
    """[V, V, V]: the exact probability of every 3-token continuation of START."""
    p = _exact_next(params)
    return p[START][:, None, None] * p[:, :, None] * p[None, :, :]


def _counts(seqs: torch.Tensor) -> torch.Tensor:
    """[n, 3] sequences → counts of each of the V**3 sequences, as [V, V, V]."""
    codes = seqs[:, 0] * V * V + seqs[:, 1] * V + seqs[:, 2]
    return torch.bincount(codes, minlength=V ** 3).view(V, V, V)


def _reference(params: SamplingParams, gen: torch.Generator) -> torch.Tensor:
    """Plain ancestral sampling through target_probs."""
    p = target_probs(TABLE, params)
    x, seqs = torch.full((SAMPLES,), START), []
    for _ in range(LENGTH):
        x = torch.multinomial(p[x], 1, generator=gen)[:, 0]
        seqs.append(x)
    return torch.stack(seqs, dim=1)


def _lookup(last: list[int], k: int, gen: torch.Generator) -> Drafts:
    """A deterministic proposer (q one-hot): the draft table's greedy chain, often but not always right."""
    best = DRAFT_TABLE.argmax(dim=-1).tolist()
    chains = {}
    for t in range(V):
        chain = [t]
        for _ in range(k):
            chain.append(best[chain[-1]])
        chains[t] = chain[1:]
    return [chains[t] for t in last], None


def _draft_model(last: list[int], k: int, gen: torch.Generator) -> Drafts:
    """A random draft model: k tokens sampled from the draft bigram, with its distributions at each position."""
    x, tokens, probs = torch.tensor(last), [], []
    for _ in range(k):
        probs.append(Q[x])
        x = torch.multinomial(Q[x], 1, generator=gen)[:, 0]
        tokens.append(x)
    return torch.stack(tokens, dim=1).tolist(), list(torch.stack(probs, dim=1).unbind(0))


def _speculate(params: SamplingParams, proposer: Callable[[list[int], int, torch.Generator], Drafts], rule: Rule,
               k: int, gen: torch.Generator) -> torch.Tensor:
    """SAMPLES continuations of START by propose-then-verify rounds, each cut to its first 3 tokens."""
    seqs: list[list[int]] = [[] for _ in range(SAMPLES)]
    pending = list(range(SAMPLES))
    while pending:
        last = [seqs[i][-1] if seqs[i] else START for i in pending]
        drafts, dps = proposer(last, k, gen)
        logits = TABLE[torch.tensor([[t, *d] for t, d in zip(last, drafts, strict=True)]).flatten()]
        emitted = rule(logits, drafts, [params] * len(pending), [gen] * len(pending), dps)
        for i, e in zip(pending, emitted, strict=True):
            assert 1 <= len(e) <= k + 1
            seqs[i].extend(e)
        pending = [i for i in pending if len(seqs[i]) < LENGTH]
    return torch.tensor([s[:LENGTH] for s in seqs])


def _wrong(mistake: str) -> Rule:
    """A verification with one deliberate mistake (the controls): the test must catch each."""
    def rule(logits: torch.Tensor, drafts: list[list[int]], params: list[SamplingParams],
             gens: list[torch.Generator], dps: list[torch.Tensor] | None) -> list[list[int]]:
        m, k, gen = len(drafts), len(drafts[0]), gens[0]
        p = target_probs(logits, params[0]).view(m, k + 1, V)
        d = torch.tensor(drafts)
        q = torch.stack(dps) if dps is not None else torch.nn.functional.one_hot(d, V).float()
        p_d, q_d = p[:, :k].gather(2, d[..., None])[..., 0], q.gather(2, d[..., None])[..., 0]
        u = torch.rand(m, k, generator=gen)
        accept = {"accept_all": torch.ones(m, k, dtype=torch.bool), "accept_p": u < p_d}.get(mistake, u * q_d < p_d)
        n_acc = accept.int().cumprod(dim=1).sum(dim=1)
        p_sel = p[torch.arange(m), n_acc]
        q_sel = torch.cat([q, torch.zeros(m, 1, V)], dim=1)[torch.arange(m), n_acc]
        residual = p_sel if mistake == "resample_p" else (p_sel - q_sel).clamp(min=0.0)
        residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p_sel)
        token = torch.multinomial(residual, 1, generator=gen)[:, 0].tolist()
        return [[*dr[:a], t] for dr, a, t in zip(drafts, n_acc.tolist(), token, strict=True)]
    return rule


def test_chi2_survival_matches_known_values() -> None:
    for x, df, p in [(3.841458820694124, 1, 0.05), (10.827566170662733, 1, 1e-3), (18.307038053275146, 10, 0.05),
                     (124.34211340400407, 100, 0.05), (0.0, 5, 1.0)]:
        assert math.isclose(_chi2_sf(x, df), p, rel_tol=1e-6)
    for x in (0.5, 7.0, 60.0):  # with 2 degrees of freedom the survival function is exp(-x/2)
        assert math.isclose(_chi2_sf(x, 2), math.exp(-x / 2), rel_tol=1e-9)


@pytest.mark.parametrize("name", CONFIGS)
def test_target_probs_is_what_the_sampler_draws_from(name: str) -> None:
    params = CONFIGS[name]
    torch.testing.assert_close(target_probs(TABLE, params).double(), _exact_next(params), atol=1e-6, rtol=0)
    # Same exponential noise, same token as the plain Sampler for a seeded request, over many seeds.
    sampler, row = Sampler(0, torch.device("cpu")), TABLE[START:START + 1]
    probs = target_probs(row, params)[0]
    for seed in range(200):
        seeded = SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                                min_p=params.min_p, seed=seed)
        sampler.forget(["r"])
        noise = torch.empty(V).exponential_(generator=torch.Generator().manual_seed(seed))
        assert sampler.sample(row, ["r"], [seeded])[0] == [int((probs / noise).argmax())]
    greedy = target_probs(TABLE, SamplingParams(temperature=0.0))
    assert torch.equal(greedy, torch.nn.functional.one_hot(TABLE.argmax(dim=-1), V).float())


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_greedy_verify_is_plain_greedy(data: st.DataObject) -> None:
    vocab, n = data.draw(st.integers(2, 8)), data.draw(st.integers(1, 4))
    ks = data.draw(st.lists(st.integers(0, 5), min_size=n, max_size=n))
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**32 - 1)))
    logits = torch.randint(-2, 3, (sum(ks) + n, vocab), generator=gen).float()  # small integers: many ties
    greedy, sampler = SamplingParams(temperature=0.0), Sampler(0, torch.device("cpu"))
    plain = [sampler.sample(logits[r:r + 1], ["r"], [greedy])[0][0] for r in range(logits.shape[0])]
    drafts, expected, start = [], [], 0
    for k in ks:  # each draft token follows the argmax or is arbitrary, as hypothesis decides
        draft = [plain[start + j] if data.draw(st.booleans()) else data.draw(st.integers(0, vocab - 1))
                 for j in range(k)]
        chain = next((j for j in range(k) if draft[j] != plain[start + j]), k)
        drafts.append(draft)
        expected.append(plain[start:start + chain + 1])
        state = gen.get_state()
        out = verify(logits[start:start + k + 1], draft, greedy, gen)
        assert out == expected[-1] and 1 <= len(out) <= k + 1
        assert torch.equal(gen.get_state(), state)  # greedy draws nothing, like plain greedy
        start += k + 1
    assert verify_batch(logits, drafts, [greedy] * n, [gen] * n) == expected


@pytest.mark.parametrize(("name", "proposer", "k"), [("temperature", _lookup, 3), ("temperature", _draft_model, 2),
                                                     ("top_k_top_p", _lookup, 2), ("top_k_top_p", _draft_model, 3),
                                                     ("min_p", _draft_model, 2)])
def test_speculation_preserves_the_target_distribution(name: str, proposer: Callable[..., Drafts], k: int) -> None:
    params, gen = CONFIGS[name], torch.Generator().manual_seed(11)
    exact = _exact_sequences(params)
    reference = _counts(_reference(params, gen))
    spec = _counts(_speculate(params, proposer, verify_batch, k, gen))
    for counts in (reference, spec):  # the reference checks the harness; spec is what is under test
        assert _gof_p(counts, exact) > ALPHA
        assert _gof_p(counts.sum(dim=(1, 2)), exact.sum(dim=(1, 2))) > ALPHA  # the next-token marginal


@pytest.mark.parametrize(("mistake", "proposer"), [("none", _lookup), ("none", _draft_model), ("accept_all", _lookup),
                                                   ("accept_p", _draft_model), ("resample_p", _draft_model)])
def test_a_wrong_acceptance_rule_fails_the_same_test(mistake: str, proposer: Callable[..., Drafts]) -> None:
    params, gen = CONFIGS["temperature"], torch.Generator().manual_seed(11)
    p = _gof_p(_counts(_speculate(params, proposer, _wrong(mistake), 2, gen)), _exact_sequences(params))
    if mistake == "none":  # the controls' own rule, unbroken, passes: a failure below is the mistake's doing
        assert p > ALPHA
    else:
        assert p < 1e-6


def _random_cases(seed: int) -> tuple[torch.Tensor, list[list[int]], list[torch.Tensor | None]]:
    gen = torch.Generator().manual_seed(seed)
    drafts = [[1, 2, 3], [], [4, 4], [0, 5, 1, 2]]
    logits = torch.randn(sum(len(d) + 1 for d in drafts), 8, generator=gen)
    dps: list[torch.Tensor | None] = [torch.softmax(torch.randn(len(d), 8, generator=gen), dim=-1) if i % 2 else None
                                      for i, d in enumerate(drafts)]
    return logits, drafts, dps


def test_seeded_requests_are_reproducible() -> None:
    logits, drafts, dps = _random_cases(0)
    params = SamplingParams(temperature=1.0, top_p=0.95)

    def run(seed: int) -> list[list[int]]:
        gen = torch.Generator().manual_seed(seed)
        return [verify_batch(logits, drafts, [params] * len(drafts), [gen] * len(drafts), dps)[i % len(drafts)]
                for i in range(24)]

    assert run(5) == run(5)
    assert run(5) != run(6)


def test_verify_batch_equals_per_request_verify() -> None:
    logits, drafts, dps = _random_cases(1)
    params = [SamplingParams(temperature=0.7), SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.3, top_k=3, min_p=0.05), SamplingParams(temperature=0.9, top_p=0.7)]
    for _ in range(10):
        # Requests 0 and 2 share a generator (as unseeded requests share the Sampler's default one).
        solo = [torch.Generator().manual_seed(s) for s in (1, 2)]
        batch = [torch.Generator().manual_seed(s) for s in (1, 2)]
        starts = [0, 4, 5, 8]
        expected = [verify(logits[s:s + len(d) + 1], d, p, solo[i % 2], dp)
                    for i, (s, d, p, dp) in enumerate(zip(starts, drafts, params, dps, strict=True))]
        assert verify_batch(logits, drafts, params, [batch[i % 2] for i in range(4)], dps) == expected
        assert all(torch.equal(a.get_state(), b.get_state()) for a, b in zip(solo, batch, strict=True))
        logits = logits.roll(1, dims=1)


def test_a_draft_from_the_target_itself_is_always_accepted() -> None:
    params, gen = CONFIGS["top_k_top_p"], torch.Generator().manual_seed(3)
    p = target_probs(TABLE, params)
    for last in range(V):
        for _ in range(20):
            d = [last]
            for _ in range(3):
                d.append(int(torch.multinomial(p[d[-1]], 1, generator=gen)))
            rows = TABLE[torch.tensor(d)]
            # q == p: min(1, p/q) == 1 wherever the draft can land, so all three are kept, then a bonus token.
            out = verify(rows, d[1:], params, gen, target_probs(rows[:3], params))
            assert out[:3] == d[1:] and len(out) == 4


def test_shape_mismatches_are_refused() -> None:
    gen, params = torch.Generator(), SamplingParams()
    with pytest.raises(ValueError, match="logits rows"):
        verify(torch.zeros(2, 4), [1, 2], params, gen)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        verify(torch.zeros(2, 4), [4], params, gen)
    with pytest.raises(ValueError, match="draft_probs of shape"):
        verify(torch.zeros(2, 4), [1], params, gen, torch.zeros(2, 4))
