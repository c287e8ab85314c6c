"""Request: one sequence's tokens, progress and timings as the scheduler and engine see them."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from kvfleet_agent.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    """Where a request is in its life."""

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        """Whether the request is done for good."""
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)


@dataclass(eq=False)
class Request:
    """A prompt, the tokens generated so far, and how many of all of them have KV computed.

    `token_ids` is prompt + output; the scheduler's one job is to bring num_computed_tokens up
    to len(token_ids) for every running request, a chunk at a time.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    prompt: str | None = None
    max_model_len: int = 1 << 62  # prompt + output may not grow past this
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at (first) admission
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    num_new_tokens: int = 0  # tokens the last step appended (more than one when it verified a speculation)
    # Timings for metrics: first scheduled, first token, last token (monotonic seconds).
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens known so far."""
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """The generated tokens."""
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        """How many tokens were generated."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        """Whether the request is done for good."""
        return self.status.finished

    def append_token(self, token_id: int) -> None:
        """Add a generated token and decide whether it ends the request."""
        self.token_ids.append(token_id)
        params = self.sampling_params
        # Before min_tokens, no token stops the output (the sampler masked EOS and the stop ids); lengths still do.
        early = params.min_tokens and self.num_output_tokens < params.min_tokens
        if not early and token_id in params.stop_token_ids:
            self.status, self.stop_reason = RequestStatus.FINISHED_STOPPED, token_id
        elif not early and not params.ignore_eos and token_id in self.eos_token_ids:
            self.status, self.stop_reason = RequestStatus.FINISHED_STOPPED, None
        elif self.num_output_tokens >= params.max_tokens or len(self.token_ids) >= self.max_model_len:
            self.status = RequestStatus.FINISHED_LENGTH
