"""The opt-in vLLM-compatible metric view: the engine's figures under vLLM's `vllm:*` names, labels and buckets."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvfleet_agent.core.request import Request
from kvfleet_agent.engine.async_llm import AsyncLLM
from kvfleet_agent.server import spec_metrics
from kvfleet_contract import metrics as contract


def one_two_five(limit: int) -> tuple[float, ...]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to and including the first bound >= limit."""
    out: list[float] = []
    scale = 1
    while True:
        for step in (1, 2, 5):
            out.append(float(step * scale))
            if step * scale >= limit:
                return tuple(out)
        scale *= 10


class VllmView(Collector):
    """vLLM's families beside kvfleet's own (the autoscaler reads those): one engine, labelled model_name, engine.

    Both names of a renamed vLLM family are exported where published dashboards still query the old one
    (gpu_cache_usage_perc, time_per_output_token_seconds): same values, so either query works.
    """

    def __init__(self, llm: AsyncLLM, model: str, registry: CollectorRegistry) -> None:
        self.llm = llm
        self.values = [model, "0"]
        self.labels = [contract.VLLM_MODEL_LABEL, contract.VLLM_ENGINE_LABEL]
        tokens = one_two_five(llm.max_model_len)

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            family = Histogram(f"vllm:{name}", doc, self.labels, buckets=buckets, registry=registry)
            return family.labels(*self.values)

        req = contract.VLLM_REQUEST_BUCKETS
        self.ttft = hist("time_to_first_token_seconds", "Time to first token in seconds.", contract.VLLM_TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Inter-token latency in seconds.", contract.VLLM_ITL_BUCKETS)
        self.tpot = hist("time_per_output_token_seconds", "Inter-token latency in seconds (vLLM's name before 0.11).",
                         contract.VLLM_ITL_BUCKETS)
        self.request_tpot = hist("request_time_per_output_token_seconds",
                                 "Per request: decode time over output tokens after the first.",
                                 contract.VLLM_ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "End-to-end request latency in seconds.", req)
        self.queue = hist("request_queue_time_seconds", "Time spent in the WAITING phase.", req)
        self.inference = hist("request_inference_time_seconds", "Time spent in the RUNNING phase.", req)
        self.prefill = hist("request_prefill_time_seconds", "First scheduled to first token.", req)
        self.decode = hist("request_decode_time_seconds", "First token to last token.", req)
        self.prompt_len = hist("request_prompt_tokens", "Prompt tokens per finished request.", tokens)
        self.output_len = hist("request_generation_tokens", "Generated tokens per finished request.", tokens)
        self.max_tokens = hist("request_params_max_tokens", "The max_tokens request parameter.", tokens)
        # vLLM's per-group maximum of max_tokens; each sample of n > 1 is its own request here, so the same value.
        self.max_gen = hist("request_max_num_generation_tokens", "Maximum generation tokens requested.", tokens)
        registry.register(self)
        llm.add_observer(self)

    # -- EngineObserver (engine thread) -----------------------------------------------------------

    def on_token(self, req: Request, now: float, gap: float | None) -> None:
        """TTFT on a request's first token; the gap since the previous one on every later token."""
        if gap is None:
            self.ttft.observe(now - req.arrival_time)
        else:
            self.itl.observe(gap)
            self.tpot.observe(gap)

    def on_finish(self, req: Request, now: float) -> None:
        """The per-request histograms; phases a request never reached (aborted while waiting) are not observed."""
        self.e2e.observe(now - req.arrival_time)
        self.prompt_len.observe(req.num_prompt_tokens)
        self.output_len.observe(req.num_output_tokens)
        self.max_tokens.observe(req.sampling_params.max_tokens)
        self.max_gen.observe(req.sampling_params.max_tokens)
        scheduled, first, last = req.first_scheduled_time, req.first_token_time, req.last_token_time
        if scheduled is None:
            return
        self.queue.observe(scheduled - req.arrival_time)
        if first is None or last is None:
            return
        self.inference.observe(last - scheduled)
        self.prefill.observe(first - scheduled)
        self.decode.observe(last - first)
        if req.num_output_tokens > 1:
            self.request_tpot.observe((last - first) / (req.num_output_tokens - 1))

    # -- Collector (scrape) -----------------------------------------------------------------------

    def collect(self) -> Iterator[Metric]:
        """vLLM's gauges and counters, read from the engine now (the same figures as kvfleet's families)."""
        stats = self.llm.stats()

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(f"vllm:{name}", doc, labels=self.labels)
            g.add_metric(self.values, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(f"vllm:{name}", doc, labels=self.labels)
            c.add_metric(self.values, value)
            return c

        yield gauge("num_requests_running", "Requests in the model execution batches.", stats.num_running)
        yield gauge("num_requests_waiting", "Requests waiting to be processed.", stats.num_waiting)
        yield gauge("kv_cache_usage_perc", "KV-cache usage; 1 means 100 percent.", stats.kv_cache_usage)
        yield gauge("gpu_cache_usage_perc", "KV-cache usage; 1 means 100 percent (vLLM's name before 0.9).",
                    stats.kv_cache_usage)
        yield counter("prompt_tokens", "Prefill tokens processed.", stats.prompt_tokens)
        yield counter("generation_tokens", "Generation tokens processed.", stats.generation_tokens)
        yield counter("num_preemptions", "Cumulative number of preemptions.", stats.num_preemptions)
        yield counter("prefix_cache_queries", "Prefix cache queries, in queried tokens.", stats.prefix_cache_queries)
        yield counter("prefix_cache_hits", "Prefix cache hits, in cached tokens.", stats.prefix_cache_hits)
        # vLLM counts every finished request here, aborts included; requests refused at admission never reach
        # its engine, so kvfleet's rejected_* outcomes stay out of this family.
        success = CounterMetricFamily("vllm:request_success", "Finished requests by finish reason.",
                                      labels=[*self.labels, "finished_reason"])
        for reason, n in stats.finished.items():
            success.add_metric([*self.values, reason], n)
        yield success
        yield from spec_metrics.vllm_families(stats.spec, self.labels, self.values)
