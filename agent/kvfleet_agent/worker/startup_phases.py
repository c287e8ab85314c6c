"""StartupPhases: how long each start-up phase took (logged as it ends, exported as gauges); the process's age."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator

log = logging.getLogger(__name__)

_IMPORTED = time.monotonic()  # the fallback origin of process_age_s where /proc cannot say when the process began


class StartupPhases:
    """Seconds per start-up phase (names from kvfleet_contract.metrics.STARTUP_PHASES), and the phases skipped.

    A phase may be timed in parts (the KV pool is sized, then allocated): the parts add up, and its log line comes
    when its last part ends. A phase that does not run here is recorded as skipped with the reason, never as 0 s:
    a zero would read as "free" on a dashboard, where the truth is "not done on this replica".
    """

    def __init__(self, label: str = "", clock: Callable[[], float] = time.perf_counter) -> None:
        """label: prefixed to log lines (a tensor-parallel rank's, e.g. "rank 1"); clock: seconds, monotonic."""
        self.label = label
        self.clock = clock
        self.seconds: dict[str, float] = {}
        self.skipped: dict[str, str] = {}

    @contextlib.contextmanager
    def phase(self, name: str, *, last: bool = True) -> Iterator[None]:
        """Time the block as (a part of) phase `name`; last=False: more parts follow, log when the last one ends.

        A block that raises records nothing: start-up failed, and the error says where.
        """
        start = self.clock()
        yield
        self.record(name, self.clock() - start, last=last)

    def record(self, name: str, seconds: float, *, last: bool = True) -> None:
        """Add `seconds` to phase `name` (measured elsewhere); log the phase's total if this was its last part."""
        self.seconds[name] = self.seconds.get(name, 0.0) + max(0.0, seconds)
        self.skipped.pop(name, None)
        if last:
            log.info("%sstart-up phase %s: %.3f s", self._prefix(), name, self.seconds[name])

    def skip(self, name: str, why: str) -> None:
        """Phase `name` does not run on this replica, for reason `why` (logged, and kept for the summary)."""
        self.skipped[name] = why
        log.info("%sstart-up phase %s: skipped (%s)", self._prefix(), name, why)

    def summary(self, total_name: str) -> str:
        """One line: the total, each phase in the order it ran (or why it was skipped), and the time in no phase."""
        total = self.seconds.get(total_name)
        parts = [f"{n} {s:.3f} s" for n, s in self.seconds.items() if n != total_name]
        parts += [f"{n} skipped ({why})" for n, why in self.skipped.items()]
        if total is None:
            return f"{self._prefix()}start-up: {', '.join(parts)}"
        rest = total - sum(s for n, s in self.seconds.items() if n != total_name)
        # "other" is what no phase covers: interpreter start and imports, the tokenizer, binding the ports.
        parts.append(f"other {rest:.3f} s")
        return f"{self._prefix()}start-up: {total_name} after {total:.3f} s ({', '.join(parts)})"

    def _prefix(self) -> str:
        return f"{self.label}: " if self.label else ""


def process_age_s() -> float:
    """Seconds since this process began (Linux: its start time in /proc), else since this module was imported.

    From the process's own start, not from main(): interpreter start and imports (torch alone takes seconds) are
    part of what a replica's start-up costs.
    """
    try:
        with open(f"/proc/{os.getpid()}/stat") as f:
            # Field 22 is the start time in clock ticks after boot; fields are counted after the ")" that ends the
            # command name, which may itself hold spaces and parentheses.
            fields = f.read().rpartition(")")[2].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - started)
    except (OSError, ValueError, IndexError, AttributeError):
        return time.monotonic() - _IMPORTED
