"""The registry every kvfleet exporter (agent, router, operator) serves from: prometheus_client's, less *_created."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric


class ExpositionRegistry(CollectorRegistry):
    """A registry that leaves out prometheus_client's *_created samples: creation times, not data, that double the
    series of every counter and histogram. Per registry rather than prometheus_client's process-wide switch, so
    that other registries in the same process (tests run several exporters) keep their own behaviour."""

    def collect(self) -> Iterator[Metric]:
        """Every collector's families, less their _created samples."""
        for metric in super().collect():
            metric.samples = [s for s in metric.samples if s.name != metric.name + "_created"]
            yield metric
