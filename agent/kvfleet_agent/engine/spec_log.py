"""SpecLog: speculative decoding's summary in the log every interval, as vLLM prints it (acceptance length and rate,
per-position acceptance, drafted and accepted throughput since the last line)."""

from __future__ import annotations

import logging

from kvfleet_agent.engine.stats import SpecSnapshot

log = logging.getLogger(__name__)
INTERVAL_S = 10.0


class SpecLog:
    """Logs the deltas of a SpecSnapshot at most every interval_s seconds, and only when something was drafted."""

    def __init__(self, interval_s: float = INTERVAL_S) -> None:
        self.interval_s = interval_s
        self.last: SpecSnapshot | None = None
        self.last_time: float | None = None

    def due(self, now: float) -> bool:
        """Whether a line may be due (cheap: the engine builds a snapshot only then)."""
        return self.last_time is None or now - self.last_time >= self.interval_s

    def maybe_log(self, snap: SpecSnapshot, now: float) -> str | None:
        """The line logged now, if one is due (returned for tests)."""
        if self.last_time is None:
            self.last, self.last_time = snap, now
            return None
        if now - self.last_time < self.interval_s or self.last is None:
            return None
        prev, elapsed = self.last, now - self.last_time
        self.last, self.last_time = snap, now
        drafts = snap.num_drafts - prev.num_drafts
        if drafts <= 0:
            return None
        drafted = snap.num_draft_tokens - prev.num_draft_tokens
        accepted = snap.num_accepted_tokens - prev.num_accepted_tokens
        per_pos = [(a - b) / drafts for a, b in zip(snap.accepted_per_position, prev.accepted_per_position,
                                                      strict=True)]
        line = (f"SpecDecoding metrics ({snap.method}): mean acceptance length {1 + accepted / drafts:.2f}, "
                f"accepted throughput {accepted / elapsed:.1f} tokens/s, drafted throughput {drafted / elapsed:.1f} "
                f"tokens/s, accepted {accepted} of {drafted} draft tokens in {drafts} verifications, per-position "
                f"acceptance rate {', '.join(f'{r:.3f}' for r in per_pos)}, avg draft acceptance rate "
                f"{100 * accepted / drafted if drafted else 0.0:.1f}%")
        log.info("%s", line)
        return line
