"""SamplingParams: how one request picks its tokens and when it stops, validated on construction."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvfleet_agent.structured_outputs import StructuredOutputs

MAX_STOP_STRINGS = 16


@dataclass
class SamplingParams:
    """Per-request sampling settings, in vLLM's vocabulary.

    temperature 0 means greedy; top_k 0 or -1 means no top-k cut; logprobs k returns the sampled
    token's log-probability and the k most likely alternatives at each step. The logits processing
    fields (penalties, min_p, logit_bias, min_tokens) mean what they mean in vLLM; at their defaults
    the sampler skips them entirely.
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
    prompt_logprobs: int | None = None  # the prompt tokens' logprobs (and k alternatives): no prefix-cache hits
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0  # minus this for every token already generated
    frequency_penalty: float = 0.0  # minus this times how often a token was generated
    repetition_penalty: float = 1.0  # divides positive (multiplies negative) logits of prompt and output tokens
    min_p: float = 0.0  # drop tokens whose probability is below min_p times the top token's
    logit_bias: dict[int, float] = field(default_factory=dict)  # added to the logits by token id
    min_tokens: int = 0  # EOS and stop_token_ids are masked (and no stop applies) until this many tokens
    structured_outputs: StructuredOutputs | None = None  # the output must match it (token masks from a grammar)
    # Whether any logits processing above is set: only then does the sampler leave its fast path, and
    # only then does the scheduler hand it the request's tokens. Computed once, read every step.
    processes_logits: bool = field(init=False, repr=False, compare=False, default=False)
    # Whether the sampler reads the request's tokens each step (logits processing, or a grammar to follow).
    needs_history: bool = field(init=False, repr=False, compare=False, default=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        self.logit_bias = dict(self.logit_bias)
        if self.top_k == -1:
            self.top_k = 0
        self._check()
        self.processes_logits = bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                                     or self.logit_bias or self.min_tokens)
        self.needs_history = self.processes_logits or self.structured_outputs is not None

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
                                          or self.logprobs < 0):
            raise bad("logprobs", self.logprobs, "use a non-negative integer (the server bounds it by --max-logprobs)")
        if self.prompt_logprobs is not None and (isinstance(self.prompt_logprobs, bool) or
                                                 not isinstance(self.prompt_logprobs, int) or self.prompt_logprobs < 0):
            raise bad("prompt_logprobs", self.prompt_logprobs, "use a non-negative integer or leave it unset")
        self._check_processing(bad)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputs):
            raise bad("structured_outputs", self.structured_outputs, "use a StructuredOutputs or None")

    def _check_processing(self, bad: Callable[[str, object, str], ValueError]) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not -2.0 <= value <= 2.0:
                raise bad(name, value, "use a number from -2 to 2; 0 disables it")
        rp = self.repetition_penalty
        if isinstance(rp, bool) or not isinstance(rp, int | float) or not 0.0 < rp <= 100.0:
            raise bad("repetition_penalty", rp, "use a number in (0, 100]; 1 disables it")
        if isinstance(self.min_p, bool) or not isinstance(self.min_p, int | float) or not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", self.min_p, "use a number from 0 (disabled) to 1")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", self.min_tokens, "use a non-negative integer")
        for token, bias in self.logit_bias.items():
            if isinstance(token, bool) or not isinstance(token, int) or token < 0 or \
                    isinstance(bias, bool) or not isinstance(bias, int | float) or not -100.0 <= bias <= 100.0:
                raise bad("logit_bias", {token: bias}, "map non-negative token ids to biases from -100 to 100")

    @property
    def greedy(self) -> bool:
        """Whether this request takes the argmax at every step."""
        return self.temperature < 1e-5
