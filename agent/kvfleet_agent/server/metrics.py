"""The agent's Prometheus metrics: the contract in ARCHITECTURE.md, labelled by served model name."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvfleet_agent.engine.async_llm import AsyncLLM
from kvfleet_agent.engine.request import Request
from kvfleet_agent.server.admission import Admission

# Latency buckets in seconds. TTFT starts at 5 ms so fast CPU/GPU replicas still resolve p50.
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
               0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class AgentMetrics(Collector):
    """Gauges and counters read from the engine at scrape time; latency histograms fed per token.

    Reading counters from the engine (instead of incrementing copies) keeps them exact: the engine
    is the one place that counts. Histograms are observed on the engine thread via EngineObserver.
    """

    def __init__(self, llm: AsyncLLM, admission: Admission, model: str) -> None:
        self.llm, self.admission, self.model = llm, admission, model
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model"]

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=self.registry)

        self.ttft = hist("kvfleet_time_to_first_token_seconds", "Arrival to first output token.", TTFT_BUCKETS)
        self.itl = hist("kvfleet_inter_token_latency_seconds", "Time between successive output tokens.",
                        ITL_BUCKETS)
        self.e2e = hist("kvfleet_e2e_request_latency_seconds", "Arrival to the request's end (any outcome).",
                        E2E_BUCKETS)
        self.queue = hist("kvfleet_request_queue_time_seconds", "Arrival to first scheduled.", QUEUE_BUCKETS)
        self._children = [h.labels(model=model) for h in (self.ttft, self.itl, self.e2e, self.queue)]
        self.registry.register(self)
        llm.engine.observers.append(self)

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
        engine = self.llm.engine
        sched, kv, counters = engine.scheduler, engine.kv, engine.counters
        m = [self.model]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=["model"])
            g.add_metric(m, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=["model"])
            c.add_metric(m, value)
            return c

        yield gauge("kvfleet_requests_waiting", "Requests accepted and not yet running (the queue).",
                    self.llm.num_waiting())
        yield gauge("kvfleet_requests_running", "Requests holding KV blocks and generating.", len(sched.running))
        yield gauge("kvfleet_kv_cache_usage_ratio", "Fraction of KV blocks held by requests.", kv.pool.usage())
        yield gauge("kvfleet_engine_last_step_timestamp_seconds",
                    "Unix time of the engine's last step (progress watchdog).", counters.last_step_time)
        yield counter("kvfleet_prompt_tokens", "Prompt tokens accepted.", counters.prompt_tokens)
        yield counter("kvfleet_generation_tokens", "Tokens generated.", counters.generation_tokens)
        yield counter("kvfleet_preemptions", "Requests preempted for lack of KV blocks.", sched.num_preemptions)
        yield counter("kvfleet_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      kv.prefix_queries)
        yield counter("kvfleet_prefix_cache_hits", "Prompt tokens found in the prefix cache.", kv.prefix_hits)
        outcomes = CounterMetricFamily("kvfleet_requests", "Requests by outcome.", labels=["model", "outcome"])
        for outcome, n in counters.finished.items():
            outcomes.add_metric([self.model, outcome], n)
        for reason, n in self.admission.rejected.items():
            outcomes.add_metric([self.model, f"rejected_{reason}"], n)
        yield outcomes

    def exposition(self) -> bytes:
        """The text format served at /metrics."""
        return generate_latest(self.registry)
