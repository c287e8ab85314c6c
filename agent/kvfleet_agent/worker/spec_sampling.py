"""Speculative decoding's verification: modified rejection sampling that keeps the target model's distribution."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvfleet_agent.sampling_params import SamplingParams
from kvfleet_agent.worker.sampler import sampling_probs
from kvfleet_kernels.dispatch import argmax

# Leviathan et al. 2023 / Chen et al. 2023. At each draft position i the target distribution p_i (what the plain
# Sampler would draw from) and the draft distribution q_i are compared: draft token d is kept with probability
# min(1, p_i(d) / q_i(d)); the first rejected position instead draws from normalize(max(0, p_i - q_i)), which makes
# every emitted token distributed exactly as p. A deterministic proposer (n-gram prompt lookup) has q_i = one-hot(d).
#
# Not covered here: logits processing that depends on the tokens so far (penalties, min_tokens) and grammar masks
# change with every draft token, so the caller must apply them per row before verifying, or not speculate for those
# requests. The logits passed in are taken as already processed.


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution the plain Sampler draws from for one request's rows [R, V] (one-hot on the argmax if greedy)."""
    if params.greedy:
        best = logits.argmax(dim=-1)
        return torch.zeros(logits.shape, dtype=torch.float32, device=logits.device).scatter_(-1, best[:, None], 1.0)
    return sampling_probs(logits.float(), [params] * logits.shape[0])


def verify(logits: torch.Tensor, draft: Sequence[int], params: SamplingParams, generator: torch.Generator,
           draft_probs: torch.Tensor | None = None) -> list[int]:
    """The tokens to emit for one request: the accepted prefix of draft plus one correction or bonus token.

    logits [k+1, V]: the target's logits at the last token and at each of the k draft tokens. draft_probs [k, V]:
    the draft model's distribution at each draft position, or None for a deterministic proposer (q one-hot).
    Greedy params accept exactly the draft tokens plain greedy decoding would have produced.
    """
    return verify_batch(logits, [draft], [params], [generator], [draft_probs])[0]


def verify_batch(logits: torch.Tensor, drafts: Sequence[Sequence[int]], params: Sequence[SamplingParams],
                 generators: Sequence[torch.Generator],
                 draft_probs: Sequence[torch.Tensor | None] | None = None) -> list[list[int]]:
    """verify() for several requests whose k_i+1 logits rows lie consecutively in logits [sum(k_i+1), V].

    Each request draws from its own generator, in request order, the same numbers verify() alone would draw, so a
    seeded request's output does not depend on what else shares the batch.
    """
    n = len(drafts)
    dps: Sequence[torch.Tensor | None] = [None] * n if draft_probs is None else draft_probs
    if not len(params) == len(generators) == len(dps) == n:
        raise ValueError(f"verify_batch: {n} drafts, {len(params)} params, {len(generators)} generators and "
                         f"{len(dps)} draft_probs: give one of each per request")
    starts = _check(logits, drafts, dps)
    out: list[list[int]] = [[] for _ in range(n)]
    greedy = [i for i, p in enumerate(params) if p.greedy]
    if greedy:
        # One argmax over every row (random requests' rows too: cheaper than gathering) and one host transfer.
        best: list[int] = argmax(logits).tolist()
        for i in greedy:
            k = len(drafts[i])
            out[i] = _greedy_chain(best[starts[i]:starts[i] + k + 1], drafts[i])
    rand = [i for i, p in enumerate(params) if not p.greedy]
    if rand:
        picked = _verify_random(logits, starts, rand, drafts, params, generators, dps)
        for i, emitted in zip(rand, picked, strict=True):
            out[i] = emitted
    return out


def _check(logits: torch.Tensor, drafts: Sequence[Sequence[int]],
           draft_probs: Sequence[torch.Tensor | None]) -> list[int]:
    """Each request's first row in logits, after checking the shapes agree (a bad token id would fail on device)."""
    if logits.dim() != 2:
        raise ValueError(f"verify: logits must be [rows, vocab], got shape {tuple(logits.shape)}")
    vocab = logits.shape[1]
    starts: list[int] = []
    row = 0
    for draft, dp in zip(drafts, draft_probs, strict=True):
        starts.append(row)
        row += len(draft) + 1
        if any(not 0 <= t < vocab for t in draft):
            raise ValueError(f"verify: draft {list(draft)} has a token outside the vocabulary of {vocab}")
        if dp is not None and tuple(dp.shape) != (len(draft), vocab):
            raise ValueError(f"verify: draft_probs of shape {tuple(dp.shape)} for {len(draft)} draft tokens; "
                             f"expected ({len(draft)}, {vocab})")
    if row != logits.shape[0]:
        raise ValueError(f"verify: the drafts need {row} logits rows (k+1 per request), got {logits.shape[0]}")
    return starts


def _greedy_chain(best: list[int], draft: Sequence[int]) -> list[int]:
    """Plain greedy decoding's tokens: the draft while it matches each row's argmax, then the next row's argmax."""
    n = 0
    while n < len(draft) and draft[n] == best[n]:
        n += 1
    return best[:n + 1]


def _verify_random(logits: torch.Tensor, starts: list[int], rand: list[int], drafts: Sequence[Sequence[int]],
                   params: Sequence[SamplingParams], generators: Sequence[torch.Generator],
                   draft_probs: Sequence[torch.Tensor | None]) -> list[list[int]]:
    """Rejection sampling for the non-greedy requests, vectorised over all their rows, with one host transfer."""
    device, vocab = logits.device, logits.shape[1]
    row_ids: list[int] = []  # the requests' rows in logits
    row_params: list[SamplingParams] = []
    tok: list[int] = []  # each row's draft token (0 on a request's last row, which has none)
    one_hot: list[float] = []  # 1 on the draft rows of a deterministic proposer: q_i(d) = 1 there
    q_index: list[int] = []  # each row's row in q_rows (the zero row where q is not a draft model's)
    q_parts: list[torch.Tensor] = []
    n_q = 0
    local_starts: list[int] = []
    for i in rand:
        draft, dp, k = drafts[i], draft_probs[i], len(drafts[i])
        local_starts.append(len(row_ids))
        row_ids.extend(range(starts[i], starts[i] + k + 1))
        row_params.extend([params[i]] * (k + 1))
        tok.extend([*draft, 0])
        one_hot.extend([0.0 if dp is not None else 1.0] * k + [0.0])
        if dp is None:
            q_index.extend([-1] * (k + 1))
        else:
            q_index.extend([*range(n_q, n_q + k), -1])
            q_parts.append(dp.to(device=device, dtype=torch.float32))
            n_q += k
    rows = logits if len(row_ids) == logits.shape[0] else logits[torch.tensor(row_ids, device=device)]
    p = sampling_probs(rows.float(), row_params)
    n_rows, n_req = len(row_ids), len(rand)
    # Draw every number up front, request by request (uniforms, then the final token's noise), so the draws do not
    # depend on the outcome and a generator shared by several requests is consumed as by verify() in turn.
    u = torch.zeros(n_rows, device=device)
    noise = torch.empty(n_req, vocab, device=device)
    for b, i in enumerate(rand):
        k = len(drafts[i])
        u[local_starts[b]:local_starts[b] + k].uniform_(generator=generators[i])
        noise[b].exponential_(generator=generators[i])
    tok_t = torch.tensor(tok, device=device)
    p_d = p.gather(1, tok_t[:, None])[:, 0]
    one_hot_t = torch.tensor(one_hot, device=device)
    # The last q row is zeros: the final (bonus) rows and the one-hot rows index it; -1 selects it.
    q_rows = torch.cat([*q_parts, torch.zeros(1, vocab, device=device)])
    q_index_t = torch.tensor(q_index, device=device)
    q_d = torch.where(one_hot_t > 0, 1.0, q_rows[q_index_t, tok_t])
    accept = u * q_d < p_d  # u < p/q without dividing by q; q_d >= p_d always accepts as u < 1
    # Per request: accepted draft rows, padded with False past k; the count is the length of the all-True prefix.
    k_max = max(len(drafts[i]) for i in rand)
    ks = torch.tensor([len(drafts[i]) for i in rand], device=device)
    st = torch.tensor(local_starts, device=device)
    offsets = torch.arange(k_max, device=device)
    grid = (st[:, None] + offsets[None, :]).clamp_(max=n_rows - 1)
    valid = offsets[None, :] < ks[:, None]
    n_acc = (accept[grid] & valid).to(torch.int32).cumprod(dim=1).sum(dim=1)
    stop = st + n_acc  # the first rejected row, or the request's last row when every draft token was accepted
    p_sel = p[stop]
    q_sel = q_rows[q_index_t[stop]].scatter_add_(1, tok_t[stop][:, None], one_hot_t[stop][:, None])
    residual = (p_sel - q_sel).clamp_(min=0.0)
    # An all-zero residual means p <= q everywhere, i.e. p == q, where rejection has probability 0 in exact
    # arithmetic; rounding can still get here, and p is then the distribution to draw from.
    residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p_sel)
    # Exponential race as in the Sampler: argmax of w / E draws proportionally to w, no normalisation needed.
    token = (residual / noise).argmax(dim=-1)
    result: list[list[int]] = torch.stack([n_acc.to(token.dtype), token], dim=1).tolist()
    return [[*drafts[i][:a], t] for i, (a, t) in zip(rand, result, strict=True)]
