"""Sampler: logits of a step's sampling rows → next tokens (greedy, temperature, top-k, top-p, min-p, seeds,
penalties, logit bias, min_tokens)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from kvfleet_agent.core.scheduler_output import TokenHistory
from kvfleet_agent.outputs import Logprob
from kvfleet_agent.sampling_params import SamplingParams
from kvfleet_agent.worker.grammar_masks import GrammarMasks
from kvfleet_agent.worker.logits_processing import process_logits
from kvfleet_kernels.dispatch import argmax


class Sampler:
    """Picks one token per row; seeded requests keep their own generator across steps."""

    def __init__(self, seed: int, device: torch.device) -> None:
        self.device = device
        self.default = torch.Generator(device=device)
        self.default.manual_seed(seed)
        self.generators: dict[str, torch.Generator] = {}
        self.grammars = GrammarMasks()

    def forget(self, request_ids: Iterable[str]) -> None:
        """Drop the per-request state of finished requests."""
        for rid in request_ids:
            self.generators.pop(rid, None)
        self.grammars.forget(request_ids)

    def sample(self, logits: torch.Tensor, request_ids: Sequence[str], params: Sequence[SamplingParams],
               histories: Sequence[TokenHistory | None] | None = None) -> tuple[list[int], list[Logprob | None]]:
        """One token per row of logits [N, V], and logprobs for the rows that asked for them.

        histories: each row's tokens so far, needed by the rows whose params process logits (penalties,
        min_tokens) or follow a grammar. Rows without either take the same path as before they existed.
        """
        # Greedy rows read the logits in the model's dtype (float32 holds every bfloat16 exactly, so the argmax is
        # the same); the rest of the work is float32, made only for the rows and cases that need it.
        raw = logits
        processed = [i for i, p in enumerate(params) if p.processes_logits]
        constrained = [i for i, p in enumerate(params) if p.structured_outputs is not None]
        hist = histories or [None] * len(params)
        if processed or constrained:
            logits = logits.float()
        if processed:  # the slow path, on the processed rows only; logprobs stay those of the model
            logits = process_logits(logits.clone() if logits is raw else logits, processed, params, hist)
        if constrained:  # masked after processing (as vLLM), on the constrained rows only
            logits = self.grammars.apply(logits.clone() if logits is raw else logits, constrained, request_ids,
                                         params, hist)
        tokens = argmax(logits)
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if random_rows:
            rows = torch.tensor(random_rows, device=logits.device)
            picked = self._sample_random(logits[rows].float(), [request_ids[i] for i in random_rows],
                                         [params[i] for i in random_rows])
            tokens[rows] = picked
        token_list: list[int] = tokens.tolist()
        logprobs: list[Logprob | None] = [None] * len(params)
        wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
        if wanted:
            # Log-probabilities of the model's own distribution, before temperature and cuts (as vLLM).
            lp = torch.log_softmax(raw[wanted].float(), dim=-1)
            for row, i in enumerate(wanted):
                k = min(params[i].logprobs or 0, lp.shape[-1])
                top = torch.topk(lp[row], k) if k else None
                logprobs[i] = Logprob(token_list[i], float(lp[row, token_list[i]]),
                                      dict(zip(top.indices.tolist(), top.values.tolist(), strict=True))
                                      if top is not None else {})
        return token_list, logprobs

    def _sample_random(self, logits: torch.Tensor, request_ids: Sequence[str],
                       params: Sequence[SamplingParams]) -> torch.Tensor:
        probs = sampling_probs(logits, params)
        # Exponential race (argmax of p / E, E ~ Exp(1)) draws from probs; one noise row per request
        # so a seeded request's draws do not depend on what else shares the batch.
        noise = torch.empty_like(probs)
        for row, (rid, p) in enumerate(zip(request_ids, params, strict=True)):
            noise[row].exponential_(generator=self._generator(rid, p))
        return (probs / noise).argmax(dim=-1)

    def _generator(self, request_id: str, params: SamplingParams) -> torch.Generator:
        return self.generator(request_id, params)

    def generator(self, request_id: str, params: SamplingParams) -> torch.Generator:
        """The generator a request draws from: its own when seeded (kept across steps), else the shared one."""
        if params.seed is None:
            return self.default
        gen = self.generators.get(request_id)
        if gen is None:
            gen = self.generators[request_id] = torch.Generator(device=self.device)
            gen.manual_seed(params.seed)
        return gen


PromptLogprobs = dict[str, tuple[int, list[Logprob]]]  # request → (first prompt position, its tokens' logprobs)
# A step's results on rank 0: each sampling request's tokens (one, or up to 1 + its drafts for a verified
# speculation), the logprobs asked for, the prompt logprobs, and a draft model's proposals for each request's next
# step (empty without a draft model).
StepResult = tuple[dict[str, list[int]], dict[str, Logprob], PromptLogprobs, dict[str, list[int]]]


def prompt_logprobs(logits: torch.Tensor, spans: Sequence[tuple[str, int, list[int], int]]) -> PromptLogprobs:
    """The prompt tokens' logprobs from the logits of the positions before them (rows in span order)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    out: PromptLogprobs = {}
    row = 0
    for rid, first, targets, top_k in spans:
        rows = lp[row:row + len(targets)]
        chosen = rows.gather(1, torch.tensor(targets, device=lp.device)[:, None])
        # One more pass over the vocabulary per prompt position (log_softmax and topk make two). Summed as uint8
        # into int32: a bool tensor's sum converts to int64 first, about twice the time on CPU.
        ranks = ((rows > chosen).view(torch.uint8).sum(dim=-1, dtype=torch.int32) + 1).tolist()
        picked = chosen[:, 0].tolist()
        k = min(top_k, lp.shape[-1])
        top = torch.topk(rows, k) if k else None
        out[rid] = (first, [Logprob(t, v, dict(zip(top.indices[i].tolist(), top.values[i].tolist(), strict=True))
                                        if top is not None else {}, rank=r)
                            for i, (t, v, r) in enumerate(zip(targets, picked, ranks, strict=True))])
        row += len(targets)
    return out


def sampling_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The distribution each (float) row is sampled from: softmax after temperature, min_p, top-k and top-p. The
    sampler draws from it, and speculative verification (spec_sampling.py) checks drafts against it."""
    temps = torch.tensor([p.temperature for p in params], device=logits.device)
    logits = logits / temps[:, None]
    top_k = [p.top_k for p in params]
    top_p = [p.top_p for p in params]
    min_p = [p.min_p for p in params]
    if any(m > 0.0 for m in min_p):
        logits = _min_p(logits, min_p)
    if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
        logits = _cut(logits, top_k, top_p)
    return torch.softmax(logits, dim=-1)


def _min_p(logits: torch.Tensor, min_p: list[float]) -> torch.Tensor:
    """Mask tokens whose probability (after temperature) is below min_p times the row's top probability (vLLM)."""
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * torch.tensor(min_p, device=logits.device)[:, None]
    return logits.masked_fill(probs < threshold, float("-inf"))


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
