"""Sampler: logits of a step's sampling rows → next tokens (greedy, temperature, top-k, top-p, seeds)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from kvfleet_agent.outputs import Logprob
from kvfleet_agent.sampling_params import SamplingParams


class Sampler:
    """Picks one token per row; seeded requests keep their own generator across steps."""

    def __init__(self, seed: int, device: torch.device) -> None:
        self.device = device
        self.default = torch.Generator(device=device)
        self.default.manual_seed(seed)
        self.generators: dict[str, torch.Generator] = {}

    def forget(self, request_ids: Iterable[str]) -> None:
        """Drop the per-request state of finished requests."""
        for rid in request_ids:
            self.generators.pop(rid, None)

    def sample(self, logits: torch.Tensor, request_ids: Sequence[str], params: Sequence[SamplingParams]
               ) -> tuple[list[int], list[Logprob | None]]:
        """One token per row of logits [N, V], and logprobs for the rows that asked for them."""
        logits = logits.float()
        tokens = logits.argmax(dim=-1)
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if random_rows:
            rows = torch.tensor(random_rows, device=logits.device)
            picked = self._sample_random(logits[rows], [request_ids[i] for i in random_rows],
                                         [params[i] for i in random_rows])
            tokens[rows] = picked
        token_list: list[int] = tokens.tolist()
        logprobs: list[Logprob | None] = [None] * len(params)
        wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
        if wanted:
            # Log-probabilities of the model's own distribution, before temperature and cuts (as vLLM).
            lp = torch.log_softmax(logits[wanted], dim=-1)
            for row, i in enumerate(wanted):
                k = params[i].logprobs or 0
                top = torch.topk(lp[row], k) if k else None
                logprobs[i] = Logprob(token_list[i], float(lp[row, token_list[i]]),
                                      dict(zip(top.indices.tolist(), top.values.tolist(), strict=True))
                                      if top is not None else {})
        return token_list, logprobs

    def _sample_random(self, logits: torch.Tensor, request_ids: Sequence[str],
                       params: Sequence[SamplingParams]) -> torch.Tensor:
        temps = torch.tensor([p.temperature for p in params], device=logits.device)
        logits = logits / temps[:, None]
        top_k = [p.top_k for p in params]
        top_p = [p.top_p for p in params]
        if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
            logits = _cut(logits, top_k, top_p)
        probs = torch.softmax(logits, dim=-1)
        # Exponential race (argmax of p / E, E ~ Exp(1)) draws from probs; one noise row per request
        # so a seeded request's draws do not depend on what else shares the batch.
        noise = torch.empty_like(probs)
        for row, (rid, p) in enumerate(zip(request_ids, params, strict=True)):
            noise[row].exponential_(generator=self._generator(rid, p))
        return (probs / noise).argmax(dim=-1)

    def _generator(self, request_id: str, params: SamplingParams) -> torch.Generator:
        if params.seed is None:
            return self.default
        gen = self.generators.get(request_id)
        if gen is None:
            gen = self.generators[request_id] = torch.Generator(device=self.device)
            gen.manual_seed(params.seed)
        return gen


def _cut(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Mask everything outside each row's top-k and nucleus (top-p) set to -inf."""
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device)
    k = torch.tensor([min(k, vocab) if k > 0 else vocab for k in top_k], device=logits.device)
    drop = ranks[None, :] >= k[:, None]
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass strictly above each token: the top token is always kept
    p = torch.tensor(top_p, device=logits.device)[:, None]
    # Rows with top_p == 1 skip the nucleus cut: a float32 cumsum can round past 1.0 in a long tail.
    drop |= (before > p) & (p < 1.0)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
