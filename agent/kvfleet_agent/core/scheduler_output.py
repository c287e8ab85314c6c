"""The scheduler's output: a step's plan as plain data (which tokens of which requests), handed to the executor."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvfleet_agent.sampling_params import SamplingParams


@dataclass(slots=True)
class TokenHistory:
    """What the sampler's logits processing reads of a request: its tokens so far and where output starts.

    `token_ids` is the request's own list (prompt + output), not a copy: the sampler reads it during
    the step, before the scheduler's update appends the new token.
    """

    token_ids: list[int]
    num_prompt_tokens: int
    eos_token_ids: frozenset[int]


@dataclass(slots=True)
class ScheduledChunk:
    """One request's share of a step: compute KV for token_ids at positions start_pos onwards."""

    request_id: str
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    sample: bool  # the chunk reaches the last known token, so the step yields a new token
    sampling_params: SamplingParams
    history: TokenHistory | None = None  # only when it samples with logits processing or a grammar
    # With prompt_logprobs: the prompt's tokens, whose logprobs the positions of this chunk before
    # len(prompt_ids) - 1 yield (position q predicts token q + 1). None otherwise.
    prompt_ids: list[int] | None = None
    # Speculation: the draft tokens after the request's last known token (token_ids is [last, *draft]). The step
    # verifies them: every position of the chunk samples, and 1 to len(draft) + 1 tokens come out.
    draft: list[int] = field(default_factory=list)


@dataclass(slots=True)
class SchedulerOutput:
    """A step's plan, as plain data for the model runner."""

    chunks: list[ScheduledChunk]
    num_batched_tokens: int
    preempted: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)  # finished since the last step: drop their state
    # Drafts a draft model proposes after this step, for the next, per request (0: it does not run; the speculator
    # decided the next step does not speculate). -1: as many as it is configured for.
    draft_k: int = -1
