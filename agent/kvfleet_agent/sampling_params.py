"""SamplingParams: how one request picks its tokens and when it stops, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_STOP_STRINGS = 16


@dataclass
class SamplingParams:
    """Per-request sampling settings, in vLLM's vocabulary.

    temperature 0 means greedy; top_k 0 or -1 means no top-k cut; logprobs k returns the sampled
    token's log-probability and the k most likely alternatives at each step.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        if self.top_k == -1:
            self.top_k = 0
        self._check()

    def _check(self) -> None:
        def bad(name: str, value: object, rule: str) -> ValueError:
            return ValueError(f"SamplingParams.{name}={value!r} is invalid: {rule}")

        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad("max_tokens", self.max_tokens, "it must be an integer >= 1")
        if not isinstance(self.temperature, int | float) or not 0.0 <= self.temperature <= 100.0:
            raise bad("temperature", self.temperature, "use a number from 0 (greedy) to 100")
        if not isinstance(self.top_p, int | float) or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", self.top_p, "use a number in (0, 1]; 1 disables nucleus sampling")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", self.top_k, "use a positive integer, or 0 / -1 to disable it")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not -(2**63) <= self.seed < 2**64):
            raise bad("seed", self.seed, "use an integer in [-2**63, 2**64) or leave it unset")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise bad("stop", f"<{len(self.stop)} strings>", f"pass at most {MAX_STOP_STRINGS} stop strings")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", self.stop, "every stop string must be a non-empty string")
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", self.stop_token_ids, "use non-negative token ids")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= 20):
            raise bad("logprobs", self.logprobs, "use an integer from 0 to 20")

    @property
    def greedy(self) -> bool:
        """Whether this request takes the argmax at every step."""
        return self.temperature < 1e-5
