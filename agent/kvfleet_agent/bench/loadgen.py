"""Load generator for OpenAI-compatible streaming completion servers (`kvfleet-agent bench serve`)."""

from __future__ import annotations

import argparse
import asyncio
import collections
import datetime as dt
import email.utils
import importlib.util
import json
import math
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from kvfleet_agent.bench.report import RequestRecord, Slo, format_table, summarize, write_plot
from kvfleet_agent.bench.runner import RunOutcome, run_load
from kvfleet_agent.bench.sse import SSEParser, StreamState
from kvfleet_agent.bench.workload import (
    LengthDist,
    RequestSpec,
    file_requests,
    load_prompt_file,
    synthetic_requests,
)

# The workload, SSE, runner and report pieces live in their own modules.
__all__ = ["BenchConfig", "BenchResult", "HttpSender", "add_arguments", "config_from_args", "discover_model", "main",
           "normalize_url", "parse_retry_after", "run_benchmark"]


# ----------------------------------------------------------------------------------------------------------------
# HTTP


def parse_retry_after(value: str | None, now: dt.datetime | None = None) -> float | None:
    """Seconds to wait from a Retry-After header (delay-seconds or an HTTP date); None if absent or unreadable."""
    if value is None:
        return None
    v = value.strip()
    try:
        seconds = float(v)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(v)
        except (TypeError, ValueError):
            return None
        if when.tzinfo is None:
            when = when.replace(tzinfo=dt.UTC)
        seconds = (when - (now or dt.datetime.now(dt.UTC))).total_seconds()
    return max(seconds, 0.0) if math.isfinite(seconds) else None


class HttpSender:
    """Sends one streamed /v1/completions request over a shared session and fills in its record."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str, model: str, *, temperature: float,
                 ignore_eos: bool, request_timeout_s: float) -> None:
        self.session = session
        self.url = f"{base_url}/v1/completions"
        self.model = model
        self.temperature = temperature
        self.ignore_eos = ignore_eos
        self.request_timeout_s = request_timeout_s

    def payload(self, spec: RequestSpec) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": spec.prompt,
            "max_tokens": spec.max_tokens,
            "temperature": self.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.ignore_eos:
            body["ignore_eos"] = True  # not OpenAI's; vLLM-style servers accept it, so send it only when asked
        return body

    async def __call__(self, spec: RequestSpec, rec: RequestRecord) -> None:
        assert rec.start is not None
        state = StreamState(rec.start)
        try:
            async with asyncio.timeout(self.request_timeout_s):
                await self._stream(spec, rec, state)
        except TimeoutError:
            rec.status, rec.error = "failed", f"request timed out after {self.request_timeout_s:g} s"
        except aiohttp.ClientError as e:
            rec.status, rec.error = "failed", f"{type(e).__name__}: {e}"
        finally:
            # Also on cancellation: a request cut off at the time bound keeps what it had received.
            rec.ttft_s, rec.itl_s = state.ttft_s, state.itl_s
            rec.output_tokens, rec.prompt_tokens = state.output_tokens, state.prompt_tokens
            rec.finish_reason = state.finish_reason

    async def _stream(self, spec: RequestSpec, rec: RequestRecord, state: StreamState) -> None:
        async with self.session.post(self.url, json=self.payload(spec)) as resp:
            rec.http_status = resp.status
            if resp.status != 200:
                body = (await resp.text(errors="replace"))[:300]
                rec.status, rec.error = ("rejected" if resp.status == 429 else "failed"), f"HTTP {resp.status}: {body}"
                rec.retry_after_s = parse_retry_after(resp.headers.get("Retry-After"))
                rec.end = time.perf_counter()
                return
            parser = SSEParser()
            async for chunk in resp.content.iter_any():
                now = time.perf_counter()  # every event in this read arrived now
                for ev in parser.feed(chunk):
                    state.on_data(ev.data, now)
                    if state.error is not None or state.done:
                        break
                if state.error is not None or state.done:
                    break
            else:
                for ev in parser.close():
                    state.on_data(ev.data, time.perf_counter())
            rec.end = state.last_time if state.done and state.last_time is not None else time.perf_counter()
        if state.error is not None:
            rec.status, rec.error = "failed", state.error
        elif not state.complete:
            ctype = resp.headers.get("Content-Type", "?")
            rec.status, rec.error = "failed", f"stream ended without [DONE] or a finish_reason (Content-Type {ctype})"
        else:
            rec.status = "ok"


async def discover_model(session: aiohttp.ClientSession, base_url: str, timeout_s: float) -> str:
    """The first model id that GET /v1/models lists."""
    async with asyncio.timeout(timeout_s), session.get(f"{base_url}/v1/models") as resp:
        if resp.status != 200:
            raise RuntimeError(f"GET {base_url}/v1/models: HTTP {resp.status}")
        body = await resp.json(content_type=None)
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list) or not data or not isinstance(data[0], dict) or "id" not in data[0]:
        raise RuntimeError(f"GET {base_url}/v1/models lists no model; pass --model")
    return str(data[0]["id"])


def normalize_url(url: str) -> str:
    """Base URL without a trailing slash or /v1, so both http://h:8000 and http://h:8000/v1/ work."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


# ----------------------------------------------------------------------------------------------------------------
# Configuration, the whole benchmark, and the command line


@dataclass
class BenchConfig:
    url: str
    model: str | None = None
    num_requests: int | None = None
    duration_s: float | None = None
    timeout_s: float | None = 3600.0
    request_timeout_s: float = 600.0
    request_rate: float | None = math.inf
    concurrency: int | None = None
    seed: int = 0
    prompt_len: LengthDist = field(default_factory=lambda: LengthDist(128, 128, 128))
    prompt_file: str | None = None
    max_tokens: LengthDist = field(default_factory=lambda: LengthDist(128, 128, 128))
    ignore_eos: bool = False
    temperature: float = 0.0
    slo: Slo = field(default_factory=Slo)
    progress: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "model": self.model,
            "num_requests": self.num_requests,
            "duration_s": self.duration_s,
            "timeout_s": self.timeout_s,
            "request_timeout_s": self.request_timeout_s,
            "mode": "closed" if self.concurrency is not None else "open",
            # JSON has no Infinity; the string keeps the file strict JSON.
            "request_rate": "inf" if self.request_rate is not None and math.isinf(self.request_rate)
            else self.request_rate,
            "concurrency": self.concurrency,
            "seed": self.seed,
            "prompt_source": "file" if self.prompt_file else "synthetic",
            "prompt_file": self.prompt_file,
            "prompt_len": None if self.prompt_file else self.prompt_len.to_json(),
            "max_tokens": self.max_tokens.to_json(),
            "ignore_eos": self.ignore_eos,
            "temperature": self.temperature,
            "slo_ttft_ms": None if self.slo.ttft_s is None else self.slo.ttft_s * 1e3,
            "slo_itl_ms": None if self.slo.itl_s is None else self.slo.itl_s * 1e3,
        }


@dataclass
class BenchResult:
    config: BenchConfig  # with model resolved and num_requests defaulted
    outcome: RunOutcome
    summary: dict[str, Any]
    started_at: str

    def to_json(self) -> dict[str, Any]:
        return {
            "schema_version": 1,
            "tool": "kvfleet-agent bench serve",
            "started_at": self.started_at,
            "config": self.config.to_json(),
            "summary": self.summary,
            "requests": [r.to_json(self.outcome.t0, self.config.slo) for r in self.outcome.records],
        }


def _requests_for(cfg: BenchConfig) -> Iterator[RequestSpec]:
    if cfg.prompt_file is not None:
        return file_requests(load_prompt_file(cfg.prompt_file), cfg.seed, cfg.max_tokens)
    return synthetic_requests(cfg.seed, cfg.prompt_len, cfg.max_tokens)


async def run_benchmark(cfg: BenchConfig) -> BenchResult:
    """Resolve the model, run the load against cfg.url over one session, and summarize."""
    from tqdm import tqdm

    base = normalize_url(cfg.url)
    requests = _requests_for(cfg)
    started_at = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    # The connector's default cap of 100 connections would queue requests inside the client and show up
    # as server latency; the load shape is ours to decide (open loop: the schedule, closed: the semaphore).
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        if cfg.model is None:
            cfg.model = await discover_model(session, base, min(cfg.request_timeout_s, 60.0))
        send = HttpSender(session, base, cfg.model, temperature=cfg.temperature, ignore_eos=cfg.ignore_eos,
                          request_timeout_s=cfg.request_timeout_s)
        with tqdm(total=cfg.num_requests, disable=not cfg.progress, file=sys.stderr, unit="req",
                  dynamic_ncols=True) as bar:
            outcome = await run_load(
                requests, send, request_rate=None if cfg.concurrency is not None else cfg.request_rate,
                concurrency=cfg.concurrency, seed=cfg.seed, num_requests=cfg.num_requests,
                duration_s=cfg.duration_s, timeout_s=cfg.timeout_s, on_done=lambda _r: bar.update(1))
    summary = summarize(outcome.records, outcome.duration_s, cfg.slo, outcome.stop_reason)
    return BenchResult(cfg, outcome, summary, started_at)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `kvfleet-agent bench serve`."""
    g = parser.add_argument_group("target")
    g.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000 (requests go to "
                   "{url}/v1/completions)")
    g.add_argument("--model", default=None, help="model name to send (default: the first id of GET {url}/v1/models)")

    g = parser.add_argument_group("bounds (issuing stops at whichever comes first)")
    g.add_argument("--num-requests", type=int, default=None, metavar="N",
                   help="requests to issue (default: 100, or every line of --prompt-file once, when --duration "
                   "is not given either)")
    g.add_argument("--duration", type=float, default=None, metavar="SECONDS",
                   help="stop issuing after this long and cancel requests still in flight")
    g.add_argument("--timeout", type=float, default=3600.0, metavar="SECONDS",
                   help="hard limit on the whole run; requests in flight are cancelled (default: 3600)")
    g.add_argument("--request-timeout", type=float, default=600.0, metavar="SECONDS",
                   help="limit on each request, response stream included (default: 600)")

    g = parser.add_argument_group("arrival process")
    m = g.add_mutually_exclusive_group()
    m.add_argument("--request-rate", type=float, default=None, metavar="R",
                   help="open loop: Poisson arrivals at R requests/s; inf sends all at once (the default)")
    m.add_argument("--concurrency", type=int, default=None, metavar="C",
                   help="closed loop: keep C requests in flight, honouring Retry-After of a 429")
    g.add_argument("--seed", type=int, default=0, help="seeds the arrivals and the prompts (default: 0)")

    g = parser.add_argument_group("requests")
    g.add_argument("--prompt-len", type=int, default=None, metavar="MEAN",
                   help="synthetic prompts of random common words, about one token each (default: 128)")
    g.add_argument("--prompt-len-range", type=int, nargs=2, default=None, metavar=("LO", "HI"),
                   help="draw prompt lengths in [LO, HI] with mean MEAN (uniform when MEAN is the midpoint)")
    g.add_argument("--prompt-file", default=None, metavar="FILE",
                   help='JSONL lines {"prompt": ..., "max_tokens": ...} (max_tokens optional), used in order, cycled')
    g.add_argument("--max-tokens", type=int, default=None, metavar="MEAN", help="output length (default: 128)")
    g.add_argument("--max-tokens-range", type=int, nargs=2, default=None, metavar=("LO", "HI"),
                   help="draw max_tokens in [LO, HI] with mean --max-tokens")
    g.add_argument("--ignore-eos", action="store_true", help='send "ignore_eos": true (vLLM-style servers)')
    g.add_argument("--temperature", type=float, default=0.0, help="(default: 0)")

    g = parser.add_argument_group("goodput SLOs (a request is good if within all that are given)")
    g.add_argument("--slo-ttft-ms", type=float, default=None, metavar="MS", help="time to first token")
    g.add_argument("--slo-itl-ms", type=float, default=None, metavar="MS", help="mean inter-token latency of a request")

    g = parser.add_argument_group("output")
    g.add_argument("--result-json", default=None, metavar="PATH", help="config, summary and per-request records")
    g.add_argument("--plot", default=None, metavar="PATH", help="PNG of latencies over time (needs matplotlib)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar (it is off anyway when stderr "
                   "is not a terminal)")


def config_from_args(a: argparse.Namespace) -> BenchConfig:
    """Validate the parsed options into a BenchConfig; ValueError says what is wrong."""
    def positive(name: str, v: float | None) -> None:
        if v is not None and not v > 0:
            raise ValueError(f"{name} must be positive, got {v}")

    positive("--num-requests", a.num_requests)
    positive("--duration", a.duration)
    positive("--timeout", a.timeout)
    positive("--request-timeout", a.request_timeout)
    positive("--request-rate", a.request_rate)
    positive("--concurrency", a.concurrency)
    if a.prompt_file is not None and (a.prompt_len is not None or a.prompt_len_range is not None):
        raise ValueError("--prompt-file and --prompt-len/--prompt-len-range exclude each other")
    if a.temperature < 0:
        raise ValueError(f"--temperature must be >= 0, got {a.temperature}")
    num_requests = a.num_requests
    if num_requests is None and a.duration is None:
        num_requests = len(load_prompt_file(a.prompt_file)) if a.prompt_file is not None else 100
    rate = a.request_rate if a.request_rate is not None or a.concurrency is not None else math.inf
    if rate is not None and math.isinf(rate) and num_requests is None:
        raise ValueError("with an infinite --request-rate, --duration alone would issue requests without end: "
                         "give --num-requests, a finite --request-rate, or --concurrency")
    return BenchConfig(
        url=a.url, model=a.model, num_requests=num_requests, duration_s=a.duration, timeout_s=a.timeout,
        request_timeout_s=a.request_timeout, request_rate=None if a.concurrency is not None else rate,
        concurrency=a.concurrency, seed=a.seed,
        prompt_len=LengthDist.build(a.prompt_len, a.prompt_len_range, 128), prompt_file=a.prompt_file,
        max_tokens=LengthDist.build(a.max_tokens, a.max_tokens_range, 128), ignore_eos=a.ignore_eos,
        temperature=a.temperature,
        slo=Slo(None if a.slo_ttft_ms is None else a.slo_ttft_ms / 1e3,
                None if a.slo_itl_ms is None else a.slo_itl_ms / 1e3),
        progress=not a.no_progress and sys.stderr.isatty(),
    )


def main(args: argparse.Namespace) -> int:
    """Run `kvfleet-agent bench serve`: 0 if any request succeeded, 1 if none did or the server is unreachable,
    2 for bad options."""
    prog = "kvfleet-agent bench serve"
    try:
        cfg = config_from_args(args)
    except (ValueError, OSError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    if args.plot is not None and importlib.util.find_spec("matplotlib") is None:
        # Checked before the run so a long benchmark is not lost to a missing optional dependency.
        print(f"{prog}: error: --plot needs matplotlib (pip install 'kvfleet[plot]')", file=sys.stderr)
        return 2
    try:
        result = asyncio.run(run_benchmark(cfg))
    except (aiohttp.ClientError, RuntimeError, TimeoutError, OSError) as e:
        print(f"{prog}: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(format_table(result.summary))
    errors = collections.Counter(r.error for r in result.outcome.records if r.status in ("failed", "rejected"))
    for error, count in errors.most_common(3):  # the why of failures, without opening the JSON
        print(f"{prog}: {count} x {error}", file=sys.stderr)
    if args.result_json is not None:
        with open(args.result_json, "w", encoding="utf-8") as f:
            json.dump(result.to_json(), f, indent=1, allow_nan=False)
            f.write("\n")
    if args.plot is not None:
        write_plot(args.plot, result.outcome.records, result.outcome.t0, result.summary)
    return 0 if result.summary["completed"] > 0 else 1


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="python -m kvfleet_agent.bench.loadgen", description=__doc__)
    add_arguments(_parser)
    sys.exit(main(_parser.parse_args()))
