"""The agent process: load the engine, serve HTTP and gRPC, drain on SIGTERM, exit with a meaningful code."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import resource
import signal
import time
from dataclasses import dataclass, field

from aiohttp import web

from kvfleet_agent.config import EngineConfig
from kvfleet_agent.engine.async_llm import AsyncLLM
from kvfleet_agent.server import log_limit
from kvfleet_agent.server.admission import Admission
from kvfleet_agent.server.api.common import DEFAULT_MAX_LOGPROBS
from kvfleet_agent.server.auth import APIKey
from kvfleet_agent.server.connections import MAX_LINGERING, ConnectionGate, ConnectionLimits
from kvfleet_agent.server.http import HTTPFrontend
from kvfleet_agent.server.metrics import AgentMetrics
from kvfleet_agent.server.prompts import PromptEncoder
from kvfleet_agent.server.request_defaults import RequestDefaults
from kvfleet_agent.worker.startup_phases import process_age_s
from kvfleet_contract import metrics as contract

log = logging.getLogger("kvfleet_agent.server")


@dataclass
class ServeOptions:
    """Process-level settings (the engine's are in EngineConfig)."""

    served_model_name: str
    host: str = "127.0.0.1"
    port: int = 8000
    grpc_port: int | None = 50051  # None disables gRPC; 0 picks a free port
    max_queue_length: int = 256
    drain_grace_period_s: float = 30.0
    api_key: str | None = None  # required as `Authorization: Bearer <key>` on /v1 and gRPC Generation
    limits: ConnectionLimits = field(default_factory=ConnectionLimits)
    max_logprobs: int = DEFAULT_MAX_LOGPROBS  # alternatives a request may ask for per token (vLLM's flag)
    chat_template: str | None = None  # replaces the checkpoint's (--chat-template); needs a tokenizer
    metrics_compat: str | None = None  # --metrics-compat: kvfleet or vllm; None reads KVFLEET_METRICS_COMPAT
    # --generation-config: values for the sampling fields a request omits (HTTP and gRPC alike)
    request_defaults: RequestDefaults = field(default_factory=RequestDefaults)


_FD_RESERVE = 128  # descriptors kept for everything but client connections: files, pipes, gRPC, logs


def _fit_file_limit(limits: ConnectionLimits) -> ConnectionLimits:
    """Raise the soft descriptor limit to fit both front ends' connections, or lower the cap to fit it.

    Past the limit, accept() fails in a loop (asyncio logs every failure) and no client gets in.
    """
    # HTTP and gRPC each have their own cap; refused HTTP sockets linger a moment to deliver the 503.
    want = 2 * limits.max_connections + MAX_LINGERING + _FD_RESERVE
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < want:
        target = want if hard == resource.RLIM_INFINITY else min(want, hard)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
    if soft == resource.RLIM_INFINITY or soft >= want:
        return limits
    cap = max(1, (soft - _FD_RESERVE - MAX_LINGERING) // 2)
    log.warning("the open-file limit is %d (hard %d): lowering --max-connections from %d to %d", soft, hard,
                limits.max_connections, cap)
    return dataclasses.replace(limits, max_connections=cap)


async def serve(engine_config: EngineConfig, opts: ServeOptions) -> int:
    """Run until SIGTERM/SIGINT (drain, then 0) or until the engine dies (1)."""
    loop = asyncio.get_running_loop()
    log_limit.install()  # a flood of bad clients must not become a flood of log lines
    api_key = APIKey(opts.api_key) if opts.api_key is not None else None
    limits = _fit_file_limit(opts.limits)
    # Loading can take minutes for large models: keep the event loop responsive meanwhile.
    llm = await loop.run_in_executor(None, AsyncLLM, engine_config)
    if opts.chat_template is not None and llm.tokenizer is not None:
        # Before anything renders a chat: the tokenizer compiles its template on first use.
        llm.tokenizer.chat_template = opts.chat_template
    admission = Admission(llm, opts.max_queue_length)
    startup = llm.engine.runner.startup  # rank 0's phases, recorded by the runner and the executor as they ran
    metrics = AgentMetrics(llm, admission, opts.served_model_name, compat=opts.metrics_compat, startup=startup)
    prompts = await loop.run_in_executor(None, PromptEncoder, llm)  # reads the whole vocabulary once
    # The listener is ours rather than a TCPSite: this gate between it and aiohttp caps connections.
    gate = ConnectionGate(limits.max_connections, limits.header_timeout_s)
    http = HTTPFrontend(llm, admission, metrics, opts.served_model_name, prompts=prompts, api_key=api_key,
                        gate=gate, body_timeout_s=limits.body_timeout_s, max_logprobs=opts.max_logprobs,
                        defaults=opts.request_defaults)
    # handler_cancellation: a client that hangs up cancels its handler, which aborts its request.
    # keepalive_timeout closes idle connections, and (aiohttp does not restart it on partial data)
    # those that never finish a request head; auto_decompress off: compressed bodies are refused.
    runner = web.AppRunner(http.app(), handler_cancellation=True, access_log=None, shutdown_timeout=5.0,
                           keepalive_timeout=limits.keep_alive_timeout_s, auto_decompress=False, lingering_time=2.0)
    await runner.setup()
    gate.factory = runner.server
    listener = await loop.create_server(gate, opts.host, opts.port)
    http_port = listener.sockets[0].getsockname()[1]
    grpc_server, grpc_port = None, None
    if opts.grpc_port is not None:
        from kvfleet_agent.server.grpc_server import start_grpc_server

        grpc_server, grpc_port = await start_grpc_server(llm, admission, opts.served_model_name, opts.host,
                                                         opts.grpc_port, api_key=api_key, prompts=prompts,
                                                         limits=limits, max_logprobs=opts.max_logprobs,
                                                         defaults=opts.request_defaults)
    pids = llm.worker_pids()
    if pids:  # machine-readable too: supervisors and tests can watch (or kill) the tensor-parallel ranks
        print(f"kvfleet-agent workers: {' '.join(map(str, pids))}", flush=True)
    if opts.request_defaults.source is not None:  # as vLLM, said once: a request's results depend on it
        log.info("requests that omit them default to %s (from %s; --generation-config vllm ignores it)",
                 opts.request_defaults.describe() or "the built-in values", opts.request_defaults.source)
    if api_key is not None:
        log.info("an API key is required on /v1 routes and gRPC Generation calls")
    # From here /ready answers 200: both front ends listen and the engine is loaded, warmed up and alive.
    startup.record(contract.FIRST_READY_PHASE, process_age_s())
    log.info("%s", startup.summary(contract.FIRST_READY_PHASE))
    # One machine-readable line: tests and supervisors learn the real ports (0 means "any free one").
    print(f"kvfleet-agent ready: http://{opts.host}:{http_port} grpc={grpc_port} model={opts.served_model_name}",
          flush=True)

    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    watchdog = asyncio.create_task(_watch_engine(llm, stop))
    await stop.wait()
    if llm.is_alive:
        await _drain(llm, admission, http, opts.drain_grace_period_s)
    watchdog.cancel()
    # Whatever is still running after the grace period is aborted now: its streams end with an
    # abort chunk and [DONE] instead of holding the process past the pod's termination grace.
    await loop.run_in_executor(None, llm.shutdown)
    if grpc_server is not None:
        await grpc_server.stop(grace=1.0)
    listener.close()
    await runner.cleanup()
    prompts.close()
    # After the drain: an engine (or a tensor-parallel worker) that died meanwhile is a failure.
    code = 0 if llm.failure() is None else 1
    log.info("kvfleet-agent stopped (exit %d)", code)
    return code


async def _drain(llm: AsyncLLM, admission: Admission, http: HTTPFrontend, grace_s: float) -> None:
    """Refuse new work, let accepted requests finish within the grace period, then stop."""
    admission.draining = True  # /ready turns 503 and new requests are refused from here on
    log.info("draining: %d requests in flight, up to %.0f s", llm.num_unfinished(), grace_s)
    deadline = time.monotonic() + grace_s
    while llm.num_unfinished() or http.in_flight:
        left = deadline - time.monotonic()
        if left <= 0:
            log.warning("drain grace period over with %d requests unfinished; aborting them", llm.num_unfinished())
            break
        if http.in_flight:  # woken as soon as the HTTP side goes idle
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(http.idle.wait(), timeout=left)
        else:  # only gRPC requests remain: they have no event of their own, so poll
            await asyncio.sleep(min(left, 0.05))


async def _watch_engine(llm: AsyncLLM, stop: asyncio.Event) -> None:
    """Stop the process when the engine thread (or a tensor-parallel worker) dies, so the pod restarts."""
    while llm.is_alive:
        await asyncio.sleep(1.0)
    log.error("the engine died (%s); exiting", llm.failure())
    stop.set()
