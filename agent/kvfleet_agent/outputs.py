"""What generation returns: RequestOutput with one CompletionOutput, in vLLM's shape."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """One step's log-probabilities: the chosen token's and the top alternatives'."""

    token_id: int
    logprob: float
    top: dict[int, float] = field(default_factory=dict)
    # 1 + the vocabulary entries with a strictly higher logprob; set for prompt tokens only (the sampled token's
    # rank is not computed: it would cost a comparison over the vocabulary on every decode step).
    rank: int | None = None


@dataclass
class CompletionOutput:
    """The generated continuation of one request."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that matched
    logprobs: list[Logprob] | None = None


@dataclass
class RequestOutput:
    """A request's prompt and its output so far (final when `finished`)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    # With prompt_logprobs: one entry per prompt token, None for the first (nothing predicts it), as vLLM.
    prompt_logprobs: list[Logprob | None] | None = None
