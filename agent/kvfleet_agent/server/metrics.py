"""The agent's Prometheus exporter: the families of kvfleet_contract.metrics, labelled by served model name."""

from __future__ import annotations

import os
from collections.abc import Iterator

from prometheus_client import Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvfleet_agent.core.request import Request
from kvfleet_agent.engine.async_llm import AsyncLLM
from kvfleet_agent.server import spec_metrics
from kvfleet_agent.server.admission import Admission
from kvfleet_agent.server.vllm_metrics import VllmView
from kvfleet_agent.worker.startup_phases import StartupPhases
from kvfleet_contract import metrics as contract
from kvfleet_contract.exposition import ExpositionRegistry

COMPAT_VIEWS = contract.METRICS_COMPAT_VIEWS  # kvfleet: kvfleet's families only (also "", unset); vllm: vLLM's too



class AgentMetrics(Collector):
    """Gauges and counters read from the engine at scrape time; latency histograms fed per token.

    Reading counters from the engine (instead of incrementing copies) keeps them exact: the engine
    is the one place that counts. Histograms are observed on the engine thread via EngineObserver.
    """

    def __init__(self, llm: AsyncLLM, admission: Admission, model: str, compat: str | None = None,
                 startup: StartupPhases | None = None) -> None:
        """compat: the view (see COMPAT_VIEWS); None reads KVFLEET_METRICS_COMPAT from the environment.
        startup: the start-up phases to export (kvfleet_startup_phase_seconds), read at each scrape."""
        self.llm, self.admission, self.model, self.startup = llm, admission, model, startup
        compat = (os.environ.get(contract.METRICS_COMPAT_ENV, "") if compat is None else compat) or "kvfleet"
        if compat not in COMPAT_VIEWS:
            raise ValueError(f"{contract.METRICS_COMPAT_ENV}={compat!r}: expected one of {COMPAT_VIEWS} or unset")
        self.registry = ExpositionRegistry(auto_describe=True)
        labels = [contract.MODEL_LABEL]

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=self.registry)

        self.ttft = hist(contract.TTFT, "Arrival to first output token.", contract.TTFT_BUCKETS)
        self.itl = hist(contract.ITL, "Time between successive output tokens.", contract.ITL_BUCKETS)
        self.e2e = hist(contract.E2E, "Arrival to the request's end (any outcome).", contract.E2E_BUCKETS)
        self.queue = hist(contract.QUEUE_TIME, "Arrival to first scheduled.", contract.QUEUE_BUCKETS)
        self._children = [h.labels(model) for h in (self.ttft, self.itl, self.e2e, self.queue)]
        self.registry.register(self)
        llm.add_observer(self)
        self.vllm = VllmView(llm, model, self.registry) if compat == "vllm" else None

    # -- EngineObserver (engine thread) -----------------------------------------------------------

    def on_token(self, req: Request, now: float, gap: float | None) -> None:
        """Record TTFT for a request's first token, ITL for every later one."""
        ttft, itl, _, _ = self._children
        if gap is None:
            ttft.observe(now - req.arrival_time)
        else:
            itl.observe(gap)

    def on_finish(self, req: Request, now: float) -> None:
        """Record end-to-end latency and queue time of a finished request."""
        _, _, e2e, queue = self._children
        e2e.observe(now - req.arrival_time)
        if req.first_scheduled_time is not None:  # aborted while waiting: it never left the queue
            queue.observe(req.first_scheduled_time - req.arrival_time)

    # -- Collector (scrape) -----------------------------------------------------------------------

    def collect(self) -> Iterator[Metric]:
        """The engine's gauges and counters as they are now."""
        stats = self.llm.stats()
        m = [self.model]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=[contract.MODEL_LABEL])
            g.add_metric(m, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=[contract.MODEL_LABEL])
            c.add_metric(m, value)
            return c

        yield gauge(contract.REQUESTS_WAITING, "Requests accepted and not yet running (the queue).",
                    stats.num_waiting)
        yield gauge(contract.REQUESTS_RUNNING, "Requests holding KV blocks and generating.", stats.num_running)
        yield gauge(contract.KV_CACHE_USAGE, "Fraction of KV blocks held by requests.", stats.kv_cache_usage)
        yield gauge(contract.LAST_STEP_TIMESTAMP,
                    "Unix time of the engine's last step (progress watchdog).", stats.last_step_time)
        yield counter(contract.PROMPT_TOKENS, "Prompt tokens accepted.", stats.prompt_tokens)
        yield counter(contract.GENERATION_TOKENS, "Tokens generated.", stats.generation_tokens)
        yield counter(contract.PREEMPTIONS, "Requests preempted for lack of KV blocks.", stats.num_preemptions)
        yield counter(contract.PREFIX_CACHE_QUERIES, "Prompt tokens looked up in the prefix cache.",
                      stats.prefix_cache_queries)
        yield counter(contract.PREFIX_CACHE_HITS, "Prompt tokens found in the prefix cache.", stats.prefix_cache_hits)
        outcomes = CounterMetricFamily(contract.REQUESTS, "Requests by outcome.",
                                       labels=[contract.MODEL_LABEL, contract.OUTCOME_LABEL])
        for outcome, n in stats.finished.items():
            outcomes.add_metric([self.model, outcome], n)
        for reason, n in self.admission.rejected.items():
            outcomes.add_metric([self.model, f"rejected_{reason}"], n)
        yield outcomes
        yield from spec_metrics.kvfleet_families(stats.spec, contract.MODEL_LABEL, self.model)
        if self.startup is not None:
            phases = GaugeMetricFamily(contract.STARTUP_PHASE_SECONDS,
                                       "Seconds each start-up phase took (first_ready: process start to ready).",
                                       labels=[contract.MODEL_LABEL, contract.PHASE_LABEL])
            for phase, seconds in list(self.startup.seconds.items()):  # a copy: first_ready may land meanwhile
                phases.add_metric([self.model, phase], seconds)
            yield phases

    def exposition(self) -> bytes:
        """The text format served at /metrics."""
        return generate_latest(self.registry)
