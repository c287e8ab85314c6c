"""What one InferenceDeployment's autoscaling loop keeps between rounds (in memory, by uid; lost on restart)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvfleet_operator.autoscaling.decide import AutoscalerState
from kvfleet_operator.autoscaling.fleet import StartupTracker
from kvfleet_operator.autoscaling.scrape import MetricsWindow


@dataclass
class Memory:
    """The metrics window, the startups seen so far and the decision function's carried state."""

    window: MetricsWindow = field(default_factory=MetricsWindow)
    startups: StartupTracker = field(default_factory=StartupTracker.empty)
    state: AutoscalerState | None = None  # None: rebuild from status.autoscaling on the first round
