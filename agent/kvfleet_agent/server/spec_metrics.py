"""Speculative decoding's Prometheus families: kvfleet's (labelled by method) and, in the vLLM view, vLLM's own
vllm:spec_decode_* names with their meaning (draft tokens, accepted tokens, acceptance by position)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvfleet_agent.engine.stats import SpecSnapshot

PREFIX = "kvfleet_spec_decode_"
VLLM_PREFIX = "vllm:spec_decode_"
POSITION_LABEL = "position"
METHOD_LABEL = "method"


def _counters(snap: SpecSnapshot, prefix: str, labels: Sequence[str],
              values: Sequence[str]) -> Iterator[CounterMetricFamily]:
    def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(prefix + name, doc, labels=list(labels))
        c.add_metric(list(values), value)
        return c

    yield counter("num_drafts", "Verifications: steps that checked a request's draft tokens.", snap.num_drafts)
    yield counter("num_draft_tokens", "Draft tokens proposed and verified.", snap.num_draft_tokens)
    yield counter("num_accepted_tokens", "Draft tokens accepted.", snap.num_accepted_tokens)
    per_pos = CounterMetricFamily(prefix + "num_accepted_tokens_per_pos", "Draft tokens accepted at each position "
                                  "(0 = the first draft token).", labels=[*labels, POSITION_LABEL])
    for position, n in enumerate(snap.accepted_per_position):
        per_pos.add_metric([*values, str(position)], n)
    yield per_pos


def kvfleet_families(snap: SpecSnapshot | None, model_label: str, model: str) -> Iterator[Metric]:
    """kvfleet's spec-decode families (none when speculation is off)."""
    if snap is None:
        return
    labels, values = [model_label, METHOD_LABEL], [model, snap.method]
    yield from _counters(snap, PREFIX, labels, values)
    mean = GaugeMetricFamily(PREFIX + "mean_accepted_length", "Tokens a verification yields on average since start "
                             "(accepted drafts plus the one it always adds; 1 = no draft accepted).", labels=labels)
    mean.add_metric(values, snap.mean_accepted_length)
    yield mean


def vllm_families(snap: SpecSnapshot | None, labels: Sequence[str], values: Sequence[str]) -> Iterator[Metric]:
    """vLLM's spec-decode counters, as its dashboards read them (none when speculation is off)."""
    if snap is not None:
        yield from _counters(snap, VLLM_PREFIX, labels, values)
