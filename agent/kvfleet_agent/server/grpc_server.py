"""The agent's gRPC front end: kvfleet.v1 Generation (unary and server-streaming) and Health."""

# The stubs next to this file are generated from kvfleet.proto; from the repository root run
#
#   .venv/bin/python -m grpc_tools.protoc -I agent --python_out=agent --pyi_out=agent --grpc_python_out=agent \
#       agent/kvfleet_agent/server/kvfleet.proto
#
# `-I agent` makes the proto's import path kvfleet_agent/server/kvfleet.proto, so the generated
# kvfleet_pb2_grpc.py imports `from kvfleet_agent.server import kvfleet_pb2` and works inside the
# package. tests/agent/test_grpc_server.py reruns the command and fails if the committed files differ.

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Iterator
from typing import NoReturn

import grpc

from kvfleet_agent.engine.async_llm import AsyncLLM, EngineDeadError
from kvfleet_agent.outputs import RequestOutput
from kvfleet_agent.server import kvfleet_pb2 as pb
from kvfleet_agent.server import kvfleet_pb2_grpc as pb_grpc
from kvfleet_agent.server.admission import Admission, Refusal
from kvfleet_agent.server.api.common import DEFAULT_MAX_LOGPROBS
from kvfleet_agent.server.auth import APIKey
from kvfleet_agent.server.connections import ConnectionLimits
from kvfleet_agent.server.fanout import OutputStream, start_samples
from kvfleet_agent.server.grpc_messages import (
    Status,
    Undecodable,
    invalid,
    lenient,
    prompt_of,
    response,
    sample,
    samples_of,
    sampling_params,
    set_usage,
)
from kvfleet_agent.server.prompts import PromptEncoder
from kvfleet_agent.server.protocol import APIError, GenerateRequest
from kvfleet_agent.server.request_defaults import RequestDefaults


async def _fail(context: grpc.aio.ServicerContext, status: Status) -> NoReturn:
    await context.abort(status.code, status.details, status.trailers)
    raise AssertionError("context.abort returned")  # it always raises; this tells the type checker so


@contextlib.contextmanager
def _engine_errors() -> Iterator[None]:
    """Turn AsyncLLM's errors into statuses; it raises them from generate() and from the stream."""
    try:
        yield
    except APIError as e:  # the prompt checks shared with HTTP (too long for the context, ...)
        raise invalid(e.message) from None
    except ValueError as e:  # make_request's checks (prompt too long, token id out of vocab, id in use)
        raise invalid(str(e)) from None
    except EngineDeadError as e:
        raise Status(grpc.StatusCode.UNAVAILABLE, f"{e}; retry on another replica") from None


async def _next(stream: OutputStream) -> RequestOutput | None:
    """The stream's next output, None at its end.

    Only the engine's calls are guarded, so that a ValueError from the server's own code is not reported as bad input.
    """
    with _engine_errors():
        return await anext(stream, None)


async def _last(stream: OutputStream) -> RequestOutput:
    final = None
    while (out := await _next(stream)) is not None:
        final = out
    if final is None:  # AsyncLLM always ends a stream with a finished output or an error
        raise Status(grpc.StatusCode.INTERNAL, "the engine ended the request without output")
    return final


async def _close(started: list[OutputStream]) -> None:
    """Close every stream started: an unfinished request is aborted in the engine and its KV blocks return."""
    for stream in started:
        await stream.aclose()


class GenerationService(pb_grpc.GenerationServicer):
    """kvfleet.v1.Generation: validates, asks Admission, and streams from AsyncLLM (n samples through fanout)."""

    def __init__(self, llm: AsyncLLM, admission: Admission, model_name: str,
                 prompts: PromptEncoder | None = None, max_logprobs: int = DEFAULT_MAX_LOGPROBS,
                 defaults: RequestDefaults | None = None) -> None:
        self.llm, self.admission, self.model_name = llm, admission, model_name
        self.prompts = prompts or PromptEncoder(llm)
        self.max_logprobs, self.defaults = max_logprobs, defaults or RequestDefaults()

    async def _start(self, request: pb.GenerateRequest | Undecodable, started: list[OutputStream]
                     ) -> tuple[str | None, list[OutputStream]]:
        """Check the request, admit it and queue its samples; returns the request id (n > 1) and their streams.

        Every stream is also appended to `started` as soon as it exists, for the caller to close.
        """
        if isinstance(request, Undecodable):
            raise invalid(request.error)
        if request.model and request.model != self.model_name:
            shown = request.model if len(request.model) <= 64 else request.model[:64] + "..."
            raise invalid(f"model {shown!r} is not served here: this agent serves {self.model_name!r} "
                          "(or leave `model` empty)")
        prompt = prompt_of(request, self.llm.max_model_len)
        params = sampling_params(request, self.max_logprobs, self.llm.vocab_size, self.defaults)
        n = samples_of(request)
        if n > max(1, self.admission.max_queue_length):  # could never be admitted: bad input, not load
            raise invalid(f"n={n} is above what this server queues at once ({self.admission.max_queue_length}, "
                          "its --max-queue-length): ask for fewer")
        request_id = str(request.request_id) if request.HasField("request_id") else None
        if request_id == "":
            raise invalid("request_id is empty: give a non-empty id or leave it unset")
        # Bad input is answered before admission so that it is not counted as a refusal. Admission
        # is asked before tokenizing (no work for a refused request) and again after (exact).
        self._admit(n)
        name = request.WhichOneof("prompt")
        with _engine_errors():  # compiled and tokenized off the loop; bad constraints or prompts refused by name
            kind = request.structured_outputs.WhichOneof("kind")  # errors name the field, as HTTP's do
            await self.prompts.compile(params.structured_outputs, f"structured_outputs.{kind}")
            ids = (await self.prompts.encode([prompt], name))[0]
            if request.HasField("max_tokens"):
                self.prompts.check_fits(len(ids), params.max_tokens, name, "max_tokens")
        self._admit(n)
        with _engine_errors():
            if n == 1:  # the engine request carries the client's id as given
                started.append(self.llm.generate(ids, params, request_id))
                return None, list(started)
            rid = request_id or f"grpc-{uuid.uuid4().hex[:16]}"
            # HTTP's fan-out: sample 0 first, the others once its prompt blocks are cached (and shared).
            fan = GenerateRequest([ids], params, stream=False, include_usage=True, chat=False, n=n, best_of=n)
            return rid, await start_samples([ids], fan, rid, self.llm.generate, started)

    def _admit(self, n: int) -> None:
        refusal = self.admission.check(n)
        if refusal is Refusal.QUEUE_FULL:
            raise Status(grpc.StatusCode.RESOURCE_EXHAUSTED, "the queue is full; retry later",
                         (("retry-after", str(self.admission.retry_after_s)),))
        if refusal is not None:
            raise Status(grpc.StatusCode.UNAVAILABLE,
                         f"this replica is not taking requests ({refusal.value}); retry on another replica")

    async def Generate(self, request: pb.GenerateRequest | Undecodable,
                       context: grpc.aio.ServicerContext) -> pb.GenerateResponse:
        """Unary: the finished request (every sample of it) in one response."""
        # Closing every stream in `finally` covers a cancelled call too (client gone, deadline passed):
        # the requests are aborted in the engine and their KV blocks return at once.
        started: list[OutputStream] = []
        try:
            try:
                rid, streams = await self._start(request, started)
                # Every sample is awaited even if one fails, so no task is left reading a stream being closed.
                results = await asyncio.gather(*(_last(s) for s in streams), return_exceptions=True)
            finally:
                await _close(started)
            finals = [r for r in results if isinstance(r, RequestOutput)]
            for r in results:
                if isinstance(r, BaseException):
                    raise r
        except Status as e:
            await _fail(context, e)
        if rid is None:
            return response(finals[0])
        resp = pb.GenerateResponse(request_id=rid, samples=[sample(i, out) for i, out in enumerate(finals)])
        set_usage(resp, finals)
        return resp

    async def GenerateStream(self, request: pb.GenerateRequest | Undecodable,
                             context: grpc.aio.ServicerContext) -> None:
        """Server streaming: one response per output, with only what is new since the previous one."""
        # Written with context.write rather than as an async generator: when the call is cancelled,
        # gRPC cancels this coroutine and `finally` closes the engine streams here and now. A handler
        # that yields could be left suspended at its yield, and the requests would run on until the
        # garbage collector finalised them.
        started: list[OutputStream] = []
        try:
            try:
                rid, streams = await self._start(request, started)
                if rid is None:
                    await self._stream_one(streams[0], context)
                else:
                    await self._stream_samples(rid, streams, context)
            finally:
                await _close(started)
        except Status as e:
            await _fail(context, e)

    async def _stream_one(self, stream: OutputStream, context: grpc.aio.ServicerContext) -> None:
        text_sent = tokens_sent = 0
        while (out := await _next(stream)) is not None:
            await context.write(response(out, text_sent, tokens_sent))
            # The engine only ever extends the text it shows (it holds back a possible
            # stop-string prefix), so the next delta starts where this one ended.
            text_sent, tokens_sent = len(out.outputs[0].text), len(out.outputs[0].token_ids)

    async def _stream_samples(self, rid: str, streams: list[OutputStream], context: grpc.aio.ServicerContext) -> None:
        """n > 1: each sample's outputs as they come, one sample's delta per response, tagged with its index."""
        queue: asyncio.Queue[tuple[int, RequestOutput | Status | None]] = asyncio.Queue()

        async def pump(i: int, stream: OutputStream) -> None:
            try:
                while (out := await _next(stream)) is not None:
                    queue.put_nowait((i, out))
            except Status as e:
                queue.put_nowait((i, e))
            queue.put_nowait((i, None))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        sent = [(0, 0)] * len(streams)
        finals: list[RequestOutput] = []
        try:
            running = len(streams)
            while running:
                i, item = await queue.get()
                if isinstance(item, Status):
                    raise item
                if item is None:
                    running -= 1
                    continue
                resp = pb.GenerateResponse(request_id=rid, samples=[sample(i, item, *sent[i])])
                sent[i] = (len(item.outputs[0].text), len(item.outputs[0].token_ids))
                if item.finished:
                    finals.append(item)
                    if len(finals) == len(streams):
                        set_usage(resp, finals)
                await context.write(resp)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


class HealthService(pb_grpc.HealthServicer):
    """kvfleet.v1.Health: SERVING unless draining or the engine has failed."""

    def __init__(self, llm: AsyncLLM, admission: Admission) -> None:
        self.llm, self.admission = llm, admission

    async def Check(self, request: pb.HealthCheckRequest | Undecodable,
                    context: grpc.aio.ServicerContext) -> pb.HealthCheckResponse:
        """Reads the state directly: Admission.check() would count the probe as a refused request."""
        if isinstance(request, Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.error)
        if not self.llm.is_alive:
            return pb.HealthCheckResponse(status=pb.HealthCheckResponse.NOT_SERVING,
                                          reason=Refusal.ENGINE_DEAD.value)
        if self.admission.draining:
            return pb.HealthCheckResponse(status=pb.HealthCheckResponse.NOT_SERVING, reason=Refusal.DRAINING.value)
        return pb.HealthCheckResponse(status=pb.HealthCheckResponse.SERVING)


def _register(server: grpc.aio.Server, generation: GenerationService, health: HealthService) -> None:
    """What the generated add_*Servicer_to_server helpers do, with deserializers that never raise."""
    services = {
        "kvfleet.v1.Generation": {
            "Generate": grpc.unary_unary_rpc_method_handler(
                generation.Generate, request_deserializer=lenient(pb.GenerateRequest),
                response_serializer=pb.GenerateResponse.SerializeToString),
            "GenerateStream": grpc.unary_stream_rpc_method_handler(
                generation.GenerateStream, request_deserializer=lenient(pb.GenerateRequest),
                response_serializer=pb.GenerateResponse.SerializeToString)},
        "kvfleet.v1.Health": {
            "Check": grpc.unary_unary_rpc_method_handler(
                health.Check, request_deserializer=lenient(pb.HealthCheckRequest),
                response_serializer=pb.HealthCheckResponse.SerializeToString)},
    }
    for name, handlers in services.items():
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))
        server.add_registered_method_handlers(name, handlers)


async def start_grpc_server(llm: AsyncLLM, admission: Admission, model_name: str, host: str, port: int, *,
                            api_key: APIKey | None = None, prompts: PromptEncoder | None = None,
                            limits: ConnectionLimits | None = None, max_logprobs: int = DEFAULT_MAX_LOGPROBS,
                            defaults: RequestDefaults | None = None) -> tuple[grpc.aio.Server, int]:
    """Start serving Generation and Health on host:port (0 picks a free port); returns the server and its port."""
    # gRPC turns SO_REUSEPORT on by default, which would let a second agent bind a port that is
    # already taken and silently split its traffic; without it, a taken port fails here.
    options = [("grpc.so_reuseport", 0), *(limits.grpc_options() if limits is not None else [])]
    server = grpc.aio.server(options=options,
                             interceptors=[api_key.interceptor()] if api_key is not None else None)
    _register(server, GenerationService(llm, admission, model_name, prompts, max_logprobs, defaults),
              HealthService(llm, admission))
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        bound = int(server.add_insecure_port(address))
    except RuntimeError as e:  # recent grpcio raises; older ones return 0
        raise OSError(f"gRPC cannot listen on {address}: {e}") from None
    if bound == 0:
        raise OSError(f"gRPC cannot listen on {address}")
    await server.start()
    return server, bound
