"""Admission control shared by the HTTP and gRPC front ends: queue limit, drain, and their counts."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvfleet_agent.engine.async_llm import AsyncLLM


class Refusal(enum.Enum):
    """Why a request was not accepted; each front end maps it to its own status code."""

    QUEUE_FULL = "queue_full"  # HTTP 429 with Retry-After, gRPC RESOURCE_EXHAUSTED
    DRAINING = "draining"  # HTTP 503, gRPC UNAVAILABLE
    ENGINE_DEAD = "engine_dead"  # HTTP 503, gRPC UNAVAILABLE


@dataclass
class Admission:
    """Decides whether one more request may enter the engine's queue.

    The queue counted is the engine's waiting requests (not yet running); running requests are
    bounded by max_num_seqs inside the engine. Counts are read by /metrics.
    """

    llm: AsyncLLM
    max_queue_length: int
    retry_after_s: int = 1
    draining: bool = False
    rejected: dict[str, int] = field(default_factory=lambda: {r.value: 0 for r in Refusal})

    def check(self, n: int = 1) -> Refusal | None:
        """None to accept n more requests, else the reason to refuse (and the refusal is counted)."""
        reason = None
        if not self.llm.is_alive:
            reason = Refusal.ENGINE_DEAD
        elif self.draining:
            reason = Refusal.DRAINING
        elif self.llm.num_waiting() + n > self.max_queue_length:
            reason = Refusal.QUEUE_FULL
        if reason is not None:
            self.rejected[reason.value] += 1
        return reason
