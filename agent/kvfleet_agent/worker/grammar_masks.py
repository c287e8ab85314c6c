"""GrammarMasks: each constrained request's matcher, and its allowed tokens applied to a step's logits at once."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

import llguidance
import torch

from kvfleet_agent.core.scheduler_output import TokenHistory
from kvfleet_agent.sampling_params import SamplingParams
from kvfleet_agent.worker.grammar_compiler import CompiledGrammar

log = logging.getLogger(__name__)


class _Tracked:
    __slots__ = ("consumed", "matcher")

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher, self.consumed = matcher, 0  # output tokens the matcher has seen


class GrammarMasks:
    """Per-request matchers on rank 0; they follow each request's own tokens, so they never drift.

    A matcher catches up with the request's output (its TokenHistory) before each mask, rather than
    being told the token it sampled: the scheduler's list is the one truth, whatever happened between
    steps (a preemption recomputes KV but keeps the tokens; the last token of a finished request is
    never needed). EOS is in the mask only where the grammar accepts: llguidance adds it exactly then.
    """

    def __init__(self) -> None:
        self._tracked: dict[str, _Tracked] = {}
        self._shifts: dict[torch.device, torch.Tensor] = {}

    def forget(self, request_ids: Iterable[str]) -> None:
        """Drop the matchers of finished requests."""
        for rid in request_ids:
            self._tracked.pop(rid, None)

    def apply(self, logits: torch.Tensor, rows: list[int], request_ids: Sequence[str],
              params: Sequence[SamplingParams], histories: Sequence[TokenHistory | None]) -> torch.Tensor:
        """Mask logits [N, V] in place on the listed rows to their grammars' allowed tokens; other rows untouched.

        The bitmasks are filled on the host (one llguidance call per row) into one [rows, V/32] tensor,
        copied to the device once and unpacked there: one masked_fill for every constrained row.
        """
        vocab = logits.shape[-1]
        words = (vocab + 31) // 32
        bitmask = torch.zeros((len(rows), words), dtype=torch.int32)
        base, row_bytes = bitmask.data_ptr(), words * 4
        for i, r in enumerate(rows):
            spec = params[r].structured_outputs
            assert spec is not None and isinstance(spec.compiled, CompiledGrammar), "compile before the engine"
            t = self._tracked.get(request_ids[r])
            if t is None:
                t = self._tracked[request_ids[r]] = _Tracked(spec.compiled.new_matcher())
            h = histories[r]
            if h is not None:
                new = h.token_ids[h.num_prompt_tokens + t.consumed:]
                if new:
                    t.matcher.consume_tokens(new)
                    t.consumed += len(new)
            if t.matcher.is_error():  # cannot happen while every token came through the mask: end the output
                log.warning("grammar matcher of %s failed: %s", request_ids[r], t.matcher.get_error())
                eos = h.eos_token_ids if h is not None else frozenset()
                for token in eos:
                    bitmask[i, token // 32] |= _bit(token % 32)
                continue
            t.matcher.unsafe_compute_mask_ptr(base + i * row_bytes, row_bytes)
        dev = logits.device
        shifts = self._shifts.get(dev)
        if shifts is None:
            shifts = self._shifts[dev] = torch.arange(32, dtype=torch.int32, device=dev)
        allowed = ((bitmask.to(dev, non_blocking=True).unsqueeze(-1) >> shifts) & 1).view(len(rows), -1)[:, :vocab]
        idx = torch.tensor(rows, dtype=torch.long, device=dev)
        logits[idx] = logits[idx].masked_fill(allowed == 0, float("-inf"))
        return logits


def _bit(b: int) -> int:
    """Bit b of an int32 word as a Python int that fits int32 (bit 31 is the sign)."""
    return -(1 << 31) if b == 31 else 1 << b
