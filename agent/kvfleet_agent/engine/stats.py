"""What the engine counts and reports: its counters, a scrape-time snapshot, and the per-token observer hook."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from kvfleet_agent.core.request import Request


class EngineObserver(Protocol):
    """Told of every token and every finished request, on the engine's thread (for metrics)."""

    def on_token(self, req: Request, now: float, gap: float | None) -> None:
        """A token was generated; gap is the time since the request's previous token (None for the first)."""

    def on_finish(self, req: Request, now: float) -> None:
        """The request ended (stop, length or abort)."""


@dataclass
class EngineCounters:
    """Monotonic totals since start, kept by the engine."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: dict[str, int] = field(default_factory=lambda: {"stop": 0, "length": 0, "abort": 0})
    last_step_time: float = 0.0  # Unix seconds of the last step, or of the last wake-up from idle


@dataclass(frozen=True)
class EngineStats:
    """The engine's gauges and counters at one moment, as exporters read them.

    Read from another thread than the engine's without a lock: every field is one atomic read, and
    a snapshot one step stale is all a scrape or a health check needs.
    """

    num_waiting: int  # accepted, not yet running (including adds still on their way to the engine thread)
    num_running: int
    has_unfinished: bool
    kv_cache_usage: float
    prompt_tokens: int
    generation_tokens: int
    finished: dict[str, int]  # by outcome: stop, length, abort
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    last_step_time: float
    spec: SpecSnapshot | None = None  # speculative decoding's counters, when it is configured


@dataclass(frozen=True)
class SpecSnapshot:
    """Speculative decoding's totals (vLLM's meaning): verifications, draft tokens proposed and accepted, accepted
    tokens by draft position (position i: verifications that accepted at least i + 1 drafts)."""

    method: str
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_position: tuple[int, ...]

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verification yields on average: the accepted drafts plus the one it always adds (1.0: none)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0
