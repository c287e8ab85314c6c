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

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn

import grpc
from google.protobuf.message import DecodeError, Message

from kvfleet_agent.engine.async_llm import AsyncLLM, EngineDeadError
from kvfleet_agent.engine.request_stream import RequestStream
from kvfleet_agent.outputs import Logprob, RequestOutput
from kvfleet_agent.sampling_params import SamplingParams
from kvfleet_agent.server import kvfleet_pb2 as pb
from kvfleet_agent.server import kvfleet_pb2_grpc as pb_grpc
from kvfleet_agent.server.admission import Admission, Refusal
from kvfleet_agent.server.api.common import DEFAULT_MAX_LOGPROBS
from kvfleet_agent.server.auth import APIKey
from kvfleet_agent.server.connections import ConnectionLimits
from kvfleet_agent.server.prompts import PromptEncoder
from kvfleet_agent.server.protocol import APIError

# GenerateRequest fields declared `optional`: passed to SamplingParams only when set, so that the
# defaults (max_tokens 16, temperature 1, top_p 1, ...) live in SamplingParams alone.
_OPTIONAL_SAMPLING = ("max_tokens", "temperature", "top_p", "seed", "logprobs", "skip_special_tokens")


class _Status(Exception):
    """Ends an RPC with a status code; raised inside a handler and sent by context.abort at its edge."""

    def __init__(self, code: grpc.StatusCode, details: str,
                 trailers: Sequence[tuple[str, str]] = ()) -> None:
        super().__init__(details)
        self.code = code
        self.details = details
        self.trailers = tuple(trailers)


def _invalid(details: str) -> _Status:
    return _Status(grpc.StatusCode.INVALID_ARGUMENT, details)


async def _fail(context: grpc.aio.ServicerContext, status: _Status) -> NoReturn:
    await context.abort(status.code, status.details, status.trailers)
    raise AssertionError("context.abort returned")  # it always raises; this tells the type checker so


class _Undecodable:
    """What the lenient deserializer hands a handler for bytes that are not the request message."""

    def __init__(self, error: str) -> None:
        self.error = error


def _lenient(message: type[Message]) -> Callable[[bytes], Message | _Undecodable]:
    """A deserializer that never raises: gRPC would answer a raising one with UNKNOWN, not INVALID_ARGUMENT."""
    def decode(data: bytes) -> Message | _Undecodable:
        try:
            return message.FromString(data)
        except DecodeError as e:  # corrupt wire format, or a string field that is not UTF-8
            return _Undecodable(f"the request is not a valid {message.DESCRIPTOR.full_name} ({e}): send one "
                                "serialized with the kvfleet.v1 protobuf definitions")
    return decode


def _prompt(request: pb.GenerateRequest, max_model_len: int) -> str | list[int]:
    kind = request.WhichOneof("prompt")
    if kind is None:
        raise _invalid("prompt is missing: set `text` or `token_ids`")
    if kind == "text":
        # Checked here because the engine cannot see it: the tokenizer may turn "" into [BOS].
        if not request.text:
            raise _invalid("prompt is empty: `text` is the empty string")
        return str(request.text)
    if len(request.token_ids.ids) >= max_model_len:  # before copying them: a huge list is refused in O(1)
        raise _invalid(f"prompt is too long: `token_ids` has {len(request.token_ids.ids)} tokens; this model's "
                       f"context is max_model_len={max_model_len} tokens, which must leave room for one generated "
                       "token")
    ids = [int(t) for t in request.token_ids.ids]
    if not ids:
        raise _invalid("prompt is empty: `token_ids` has no ids")
    return ids


def _sampling_params(request: pb.GenerateRequest) -> SamplingParams:
    options: dict[str, Any] = {name: getattr(request, name) for name in _OPTIONAL_SAMPLING
                               if request.HasField(name)}
    if options.get("logprobs", 0) > DEFAULT_MAX_LOGPROBS:  # as HTTP's default --max-logprobs
        raise _invalid(f"logprobs={options['logprobs']} is invalid: ask for at most {DEFAULT_MAX_LOGPROBS}")
    try:
        return SamplingParams(top_k=request.top_k, stop=list(request.stop),
                              stop_token_ids=list(request.stop_token_ids), ignore_eos=request.ignore_eos,
                              include_stop_str_in_output=request.include_stop_str_in_output, **options)
    except ValueError as e:  # its message names the field: "SamplingParams.top_p=0.0 is invalid: ..."
        raise _invalid(str(e)) from None


@contextlib.contextmanager
def _engine_errors() -> Iterator[None]:
    """Turn AsyncLLM's errors into statuses; it raises them from generate() and from the stream."""
    try:
        yield
    except APIError as e:  # the prompt checks shared with HTTP (too long for the context, ...)
        raise _invalid(e.message) from None
    except ValueError as e:  # make_request's checks (prompt too long, token id out of vocab, id in use)
        raise _invalid(str(e)) from None
    except EngineDeadError as e:
        raise _Status(grpc.StatusCode.UNAVAILABLE, f"{e}; retry on another replica") from None


async def _next(stream: RequestStream) -> RequestOutput | None:
    """The stream's next output, None at its end.

    Only the engine's calls are guarded, so that a ValueError from the server's own code is not reported as bad input.
    """
    with _engine_errors():
        return await anext(stream, None)


def _logprob(lp: Logprob) -> pb.TokenLogprob:
    top = sorted(lp.top.items(), key=lambda kv: -kv[1])  # the proto promises most likely first
    return pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob,
                           top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in top])


def _response(out: RequestOutput, text_from: int = 0, tokens_from: int = 0) -> pb.GenerateResponse:
    """The response for `out`, leaving out the first text_from characters and tokens_from tokens (sent before)."""
    c = out.outputs[0]
    resp = pb.GenerateResponse(request_id=out.request_id, text=c.text[text_from:], token_ids=c.token_ids[tokens_from:],
                               finish_reason=c.finish_reason or "")
    if c.logprobs is not None:  # one per token, so the token offset is the logprob offset
        resp.logprobs.extend(_logprob(lp) for lp in c.logprobs[tokens_from:])
    if out.finished:
        resp.usage.prompt_tokens = len(out.prompt_token_ids)
        resp.usage.completion_tokens = len(c.token_ids)
    return resp


class GenerationService(pb_grpc.GenerationServicer):
    """kvfleet.v1.Generation: validates, asks Admission, and streams from AsyncLLM."""

    def __init__(self, llm: AsyncLLM, admission: Admission, model_name: str,
                 prompts: PromptEncoder | None = None) -> None:
        self.llm = llm
        self.admission = admission
        self.model_name = model_name
        self.prompts = prompts or PromptEncoder(llm)

    async def _start(self, request: pb.GenerateRequest | _Undecodable) -> RequestStream:
        """Check the request, admit it and queue it in the engine."""
        if isinstance(request, _Undecodable):
            raise _invalid(request.error)
        if request.model and request.model != self.model_name:
            shown = request.model if len(request.model) <= 64 else request.model[:64] + "..."
            raise _invalid(f"model {shown!r} is not served here: this agent serves {self.model_name!r} "
                           "(or leave `model` empty)")
        prompt = _prompt(request, self.llm.max_model_len)
        params = _sampling_params(request)
        request_id = str(request.request_id) if request.HasField("request_id") else None
        if request_id == "":
            raise _invalid("request_id is empty: give a non-empty id or leave it unset")
        # Bad input is answered before admission so that it is not counted as a refusal. Admission
        # is asked before tokenizing (no work for a refused request) and again after (exact).
        self._admit()
        name = request.WhichOneof("prompt")
        with _engine_errors():  # tokenized off the event loop; too long for the context is refused by name
            ids = (await self.prompts.encode([prompt], name))[0]
            if request.HasField("max_tokens"):
                self.prompts.check_fits(len(ids), params.max_tokens, name, "max_tokens")
        self._admit()
        with _engine_errors():
            return self.llm.generate(ids, params, request_id)

    def _admit(self) -> None:
        refusal = self.admission.check()
        if refusal is Refusal.QUEUE_FULL:
            raise _Status(grpc.StatusCode.RESOURCE_EXHAUSTED, "the queue is full; retry later",
                          (("retry-after", str(self.admission.retry_after_s)),))
        if refusal is not None:
            raise _Status(grpc.StatusCode.UNAVAILABLE,
                          f"this replica is not taking requests ({refusal.value}); retry on another replica")

    async def Generate(self, request: pb.GenerateRequest | _Undecodable,
                       context: grpc.aio.ServicerContext) -> pb.GenerateResponse:
        """Unary: the finished request in one response."""
        final: RequestOutput | None = None
        try:
            stream = await self._start(request)
            # aclosing: if the call is cancelled (client gone, deadline passed), closing the stream
            # aborts the request in the engine so its KV blocks return at once.
            async with contextlib.aclosing(stream):
                while (out := await _next(stream)) is not None:
                    final = out
        except _Status as e:
            await _fail(context, e)
        if final is None:  # AsyncLLM always ends a stream with a finished output or an error
            await _fail(context, _Status(grpc.StatusCode.INTERNAL, "the engine ended the request without output"))
        return _response(final)

    async def GenerateStream(self, request: pb.GenerateRequest | _Undecodable,
                             context: grpc.aio.ServicerContext) -> None:
        """Server streaming: one response per output, with only what is new since the previous one."""
        # Written with context.write rather than as an async generator: when the call is cancelled,
        # gRPC cancels this coroutine and aclosing closes the engine stream here and now. A handler
        # that yields could be left suspended at its yield, and the request would run on until the
        # garbage collector finalised it.
        try:
            stream = await self._start(request)
            async with contextlib.aclosing(stream):
                text_sent = tokens_sent = 0
                while (out := await _next(stream)) is not None:
                    await context.write(_response(out, text_sent, tokens_sent))
                    # The engine only ever extends the text it shows (it holds back a possible
                    # stop-string prefix), so the next delta starts where this one ended.
                    text_sent, tokens_sent = len(out.outputs[0].text), len(out.outputs[0].token_ids)
        except _Status as e:
            await _fail(context, e)


class HealthService(pb_grpc.HealthServicer):
    """kvfleet.v1.Health: SERVING unless draining or the engine has failed."""

    def __init__(self, llm: AsyncLLM, admission: Admission) -> None:
        self.llm = llm
        self.admission = admission

    async def Check(self, request: pb.HealthCheckRequest | _Undecodable,
                    context: grpc.aio.ServicerContext) -> pb.HealthCheckResponse:
        """Reads the state directly: Admission.check() would count the probe as a refused request."""
        if isinstance(request, _Undecodable):
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
                generation.Generate, request_deserializer=_lenient(pb.GenerateRequest),
                response_serializer=pb.GenerateResponse.SerializeToString),
            "GenerateStream": grpc.unary_stream_rpc_method_handler(
                generation.GenerateStream, request_deserializer=_lenient(pb.GenerateRequest),
                response_serializer=pb.GenerateResponse.SerializeToString)},
        "kvfleet.v1.Health": {
            "Check": grpc.unary_unary_rpc_method_handler(
                health.Check, request_deserializer=_lenient(pb.HealthCheckRequest),
                response_serializer=pb.HealthCheckResponse.SerializeToString)},
    }
    for name, handlers in services.items():
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))
        server.add_registered_method_handlers(name, handlers)


async def start_grpc_server(llm: AsyncLLM, admission: Admission, model_name: str, host: str, port: int, *,
                            api_key: APIKey | None = None, prompts: PromptEncoder | None = None,
                            limits: ConnectionLimits | None = None) -> tuple[grpc.aio.Server, int]:
    """Start serving Generation and Health on host:port (0 picks a free port); returns the server and its port."""
    # gRPC turns SO_REUSEPORT on by default, which would let a second agent bind a port that is
    # already taken and silently split its traffic; without it, a taken port fails here.
    options = [("grpc.so_reuseport", 0), *(limits.grpc_options() if limits is not None else [])]
    server = grpc.aio.server(options=options,
                             interceptors=[api_key.interceptor()] if api_key is not None else None)
    _register(server, GenerationService(llm, admission, model_name, prompts), HealthService(llm, admission))
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        bound = int(server.add_insecure_port(address))
    except RuntimeError as e:  # recent grpcio raises; older ones return 0
        raise OSError(f"gRPC cannot listen on {address}: {e}") from None
    if bound == 0:
        raise OSError(f"gRPC cannot listen on {address}")
    await server.start()
    return server, bound
