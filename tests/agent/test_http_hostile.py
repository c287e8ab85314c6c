"""A catalogue of hostile requests (HTTP and gRPC) against one real agent: each gets a 4xx naming the problem.

After each one, /health must answer and a normal request must still be served. The agent runs
with an API key, so the catalogue covers authentication too; its checkpoint is the small tiny
one (512 positions), so the characters-per-token bound is small and oversized text is cheap.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc
import pytest
from server_process import AgentProcess, running_agent

from kvfleet_agent.server import kvfleet_pb2 as pb

KEY = "sk-hostile-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
JSON = {"Content-Type": "application/json"}
IO_TIMEOUT_S = 30.0  # no answer in this time fails the case (a hang), rather than hanging the suite
MAX_MODEL_LEN = 512  # the tiny checkpoint's max_position_embeddings
QUEUE = 64


@dataclass(frozen=True)
class Case:
    """One hostile request: raw HTTP bytes or a gRPC call, the status it must get, and words its error must hold."""

    name: str
    status: int | str  # an HTTP status, or a grpc.StatusCode name
    says: str  # a fragment of the error message (case-insensitive) naming the problem
    raw: bytes = b""  # the whole HTTP request
    grpc_method: str = ""
    grpc_payload: bytes = b""
    grpc_key: str | None = KEY
    param: str | None = None  # the OpenAI error's `param`, when the problem is one field


def http(name: str, status: int, says: str, body: object = None, *, method: str = "POST",
         path: str = "/v1/completions", headers: dict[str, str] | None = None, auth: bool = True,
         param: str | None = None) -> Case:
    """A well-formed HTTP/1.1 request; body is JSON-encoded unless it is already bytes or a str."""
    data = body if isinstance(body, bytes) else (body.encode() if isinstance(body, str) else
                                                  b"" if body is None else json.dumps(body).encode())
    head = {"Host": "agent", **(JSON if body is not None else {}), **(AUTH if auth else {}), **(headers or {})}
    if data or method == "POST":
        head.setdefault("Content-Length", str(len(data)))
    lines = "".join(f"{k}: {v}\r\n" for k, v in head.items())
    return Case(name, status, says, raw=f"{method} {path} HTTP/1.1\r\n{lines}\r\n".encode() + data, param=param)


def raw(name: str, status: int, says: str, data: bytes) -> Case:
    """Bytes sent as they are: malformed HTTP that no client library would write."""
    return Case(name, status, says, raw=data)


def rpc(name: str, code: str, says: str, payload: bytes | pb.GenerateRequest, *, method: str = "Generate",
        service: str = "kvfleet.v1.Generation", key: str | None = KEY) -> Case:
    data = payload if isinstance(payload, bytes) else payload.SerializeToString()
    return Case(name, code, says, grpc_method=f"/{service}/{method}", grpc_payload=data, grpc_key=key)


def prompt(**fields: object) -> dict[str, object]:
    return {"model": "tiny", "prompt": "hello", "max_tokens": 2, **fields}


def chat(**fields: object) -> dict[str, object]:
    return {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2, **fields}


def nested(depth: int, open_: str = "[", close: str = "]") -> str:
    return '{"model": "tiny", "prompt": ' + open_ * depth + close * depth + "}"


CHAT = "/v1/chat/completions"
BIG = 16 << 20
LONG_TEXT = "hello world " * 100_000  # 1.2 M characters: far past what 512 tokens can hold

CATALOGUE: list[Case] = [
    # -- JSON: syntax, nesting, text ------------------------------------------------------------------
    http("not-json", 400, "not valid JSON", "{not json"),
    http("empty-body", 400, "empty", ""),
    http("array-body", 400, "JSON object", [1, 2]),
    http("string-body", 400, "JSON object", '"hello"'),
    http("nested-1000-arrays", 400, "nested too deeply", nested(1000)),
    http("nested-1000-objects", 400, "nested too deeply", '{"a":' * 1000 + "1" + "}" * 1000),
    http("nested-100k", 400, "nested too deeply", nested(100_000)),
    http("nested-500-prompt", 400, "prompt", nested(500), param="prompt"),
    http("lone-high-surrogate", 400, "surrogate", '{"model":"tiny","prompt":"a\\ud800b"}', param="prompt"),
    http("lone-low-surrogate", 400, "surrogate", '{"model":"tiny","prompt":"\\udc00"}', param="prompt"),
    http("surrogate-in-batch", 400, "surrogate", '{"model":"tiny","prompt":["ok","a\\udbffb"]}', param="prompt"),
    http("surrogate-in-chat", 400, "surrogate",
         '{"model":"tiny","messages":[{"role":"user","content":"a\\ud800b"}]}', path=CHAT,
         param="messages[0].content"),
    http("surrogate-in-role", 400, "surrogate", '{"model":"tiny","messages":[{"role":"\\ud800","content":"x"}]}',
         path=CHAT, param="messages[0].role"),
    http("surrogate-in-stop", 400, "surrogate", '{"model":"tiny","prompt":"x","stop":"\\ud800"}', param="stop"),
    http("invalid-utf8", 400, "not UTF-8", b'{"model":"tiny","prompt":"\xff\xfe"}'),
    http("utf8-bom", 400, "not valid JSON", b'\xef\xbb\xbf{"model":"tiny","prompt":"x"}'),
    http("nan", 400, "NaN", '{"model":"tiny","prompt":"x","temperature":NaN}'),
    http("infinity", 400, "Infinity", '{"model":"tiny","prompt":"x","temperature":-Infinity}'),
    http("5000-digit-integer", 400, "cannot be read", '{"model":"tiny","prompt":"x","max_tokens":' + "9" * 5000 + "}"),
    http("1e400-temperature", 400, "temperature", '{"model":"tiny","prompt":"x","temperature":1e400}',
         param="temperature"),
    http("huge-int-temperature", 400, "temperature", prompt(temperature=10**400), param="temperature"),
    # -- prompts --------------------------------------------------------------------------------------
    http("prompt-number", 400, "prompt", prompt(prompt=42), param="prompt"),
    http("prompt-object", 400, "prompt", prompt(prompt={"text": "x"}), param="prompt"),
    http("prompt-null", 400, "prompt", prompt(prompt=None), param="prompt"),
    http("prompt-empty-list", 400, "empty", prompt(prompt=[]), param="prompt"),
    http("prompt-empty-inner-list", 400, "empty", prompt(prompt=[[]]), param="prompt"),
    http("prompt-mixed", 400, "prompt", prompt(prompt=[1, "a"]), param="prompt"),
    http("prompt-booleans", 400, "prompt", prompt(prompt=[True, False]), param="prompt"),
    http("token-out-of-vocab", 400, "vocab", prompt(prompt=[1, 10**9]), param="prompt"),
    http("token-negative", 400, "prompt", prompt(prompt=[1, -1]), param="prompt"),
    http("token-ids-past-context", 400, "max_model_len", prompt(prompt=[5] * 5000), param="prompt"),
    http("text-10mb", 400, "characters", prompt(prompt="a" * 10_500_000), param="prompt"),
    http("text-past-char-bound", 400, "characters", prompt(prompt=LONG_TEXT), param="prompt"),
    http("too-many-prompts", 400, f"at most {QUEUE}", prompt(prompt=["x"] * 300), param="prompt"),
    http("too-many-token-prompts", 400, f"at most {QUEUE}", prompt(prompt=[[1, 2]] * 300), param="prompt"),
    # -- sampling and limits --------------------------------------------------------------------------
    http("max-tokens-past-context", 400, "maximum context length", prompt(max_tokens=100_000), param="max_tokens"),
    http("max-completion-tokens-past-context", 400, "max_completion_tokens", chat(max_completion_tokens=10**6),
         path=CHAT, param="max_completion_tokens"),
    http("max-tokens-zero", 400, "max_tokens", prompt(max_tokens=0), param="max_tokens"),
    http("max-tokens-string", 400, "integer", prompt(max_tokens="8"), param="max_tokens"),
    http("max-tokens-boolean", 400, "boolean", prompt(max_tokens=True), param="max_tokens"),
    http("max-completion-tokens-zero", 400, "max_completion_tokens", chat(max_completion_tokens=0), path=CHAT,
         param="max_completion_tokens"),
    http("top-logprobs-50", 400, "top_logprobs", chat(logprobs=True, top_logprobs=50), path=CHAT,
         param="top_logprobs"),
    http("top-logprobs-without-logprobs", 400, "logprobs", chat(top_logprobs=3), path=CHAT, param="top_logprobs"),
    http("logprobs-50", 400, "logprobs", prompt(logprobs=50), param="logprobs"),
    http("temperature-negative", 400, "temperature", prompt(temperature=-1), param="temperature"),
    http("top-p-zero", 400, "top_p", prompt(top_p=0), param="top_p"),
    http("top-k-negative", 400, "top_k", prompt(top_k=-5), param="top_k"),
    http("seed-2-64", 400, "seed", prompt(seed=2**64), param="seed"),
    http("stop-17", 400, "stop", prompt(stop=[str(i) for i in range(17)]), param="stop"),
    http("stop-empty-string", 400, "stop", prompt(stop=[""]), param="stop"),
    http("stop-token-ids-2000", 400, "stop_token_ids", prompt(stop_token_ids=list(range(2000))),
         param="stop_token_ids"),
    http("stop-token-ids-negative", 400, "stop_token_ids", prompt(stop_token_ids=[-1]), param="stop_token_ids"),
    http("n-0", 400, "'n'", prompt(n=0), param="n"),
    http("n-huge", 400, "'n'", prompt(n=10**6), param="n"),
    http("misspelt-field", 400, "temprature", prompt(temprature=0.5), param="temprature"),
    http("stream-string", 400, "stream", prompt(stream="yes"), param="stream"),
    http("include-usage-string", 400, "include_usage", prompt(stream=True, stream_options={"include_usage": "y"}),
         param="stream_options.include_usage"),
    http("unknown-model", 404, "does not exist", prompt(model="gpt-4"), param="model"),
    http("huge-model-name", 404, "does not exist", prompt(model="m" * 1_000_000), param="model"),
    http("presence-penalty", 400, "presence_penalty", prompt(presence_penalty=3.0), param="presence_penalty"),
    http("logit-bias-key", 400, "logit_bias", prompt(logit_bias={"one": 100}), param="logit_bias"),
    http("logit-bias-value", 400, "logit_bias", prompt(logit_bias={"1": 1000}), param="logit_bias"),
    http("tools", 400, "tool calling", prompt(tools=[{"type": "function"}]), param="tools"),
    # -- chat -----------------------------------------------------------------------------------------
    http("messages-missing", 400, "messages", {"model": "tiny"}, path=CHAT, param="messages"),
    http("messages-empty", 400, "messages", chat(messages=[]), path=CHAT, param="messages"),
    http("message-without-role", 400, "role", chat(messages=[{"content": "hi"}]), path=CHAT,
         param="messages[0].role"),
    http("message-content-number", 400, "content", chat(messages=[{"role": "user", "content": 3}]), path=CHAT,
         param="messages[0].content"),
    http("message-image-part", 400, "text parts", chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]), path=CHAT, param="messages[0].content"),
    http("messages-10000", 400, "at most", chat(messages=[{"role": "user", "content": "x"}] * 10_000), path=CHAT,
         param="messages"),
    http("role-refused-by-template", 400, "Unsupported role", chat(messages=[{"role": "tool", "content": "x"}]),
         path=CHAT, param="messages"),
    http("chat-content-10mb", 400, "characters", chat(messages=[{"role": "user", "content": "a" * 10_000_000}]),
         path=CHAT, param="messages"),
    # -- media types, encodings, sizes ----------------------------------------------------------------
    http("text-plain", 415, "application/json", prompt(), headers={"Content-Type": "text/plain"}),
    http("form-urlencoded", 415, "application/json", prompt(),
         headers={"Content-Type": "application/x-www-form-urlencoded"}),
    http("multipart", 415, "application/json", prompt(), headers={"Content-Type": "multipart/form-data; boundary=x"}),
    http("latin-1-charset", 415, "charset", prompt(), headers={"Content-Type": "application/json; charset=latin-1"}),
    http("gzip-body", 415, "Content-Encoding", prompt(), headers={"Content-Encoding": "gzip"}),
    http("declared-17mib", 413, "limit", b"", headers={"Content-Length": str(BIG + (1 << 20))}),
    http("body-over-16mib", 413, "limit", b'{"prompt": "' + b"a" * BIG + b'"}'),
    raw("chunked-over-16mib", 413, "limit", b"POST /v1/completions HTTP/1.1\r\nHost: a\r\nAuthorization: Bearer "
        + KEY.encode() + b"\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        + b"".join(b"%x\r\n" % (1 << 20) + b"a" * (1 << 20) + b"\r\n" for _ in range(17)) + b"0\r\n\r\n"),
    # -- methods and routes ---------------------------------------------------------------------------
    http("get-completions", 405, "use POST", method="GET"),
    http("put-chat", 405, "use POST", prompt(), method="PUT", path=CHAT),
    http("delete-health", 405, "not allowed", method="DELETE", path="/health"),
    http("post-health", 405, "not allowed", prompt(), path="/health"),
    http("trace-models", 405, "not allowed", method="TRACE", path="/v1/models"),
    http("unknown-route", 404, "no route", method="GET", path="/v1/nowhere"),
    http("dot-dot-path", 404, "no route", method="GET", path="/../../etc/passwd"),
    raw("bad-method-token", 400, "method", b"G@T /health HTTP/1.1\r\nHost: a\r\n\r\n"),
    # -- malformed HTTP -------------------------------------------------------------------------------
    raw("header-10kb", 400, "8190 bytes", b"GET /health HTTP/1.1\r\nHost: a\r\nX-Big: " + b"a" * 10_000 + b"\r\n\r\n"),
    raw("200-headers", 400, "headers", b"GET /health HTTP/1.1\r\nHost: a\r\n"
        + b"".join(b"X-%d: 1\r\n" % i for i in range(200)) + b"\r\n"),
    raw("length-and-chunked", 400, "Transfer-Encoding", b"POST /v1/completions HTTP/1.1\r\nHost: a\r\n"
        b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"),
    raw("content-length-letters", 400, "Content-Length", b"POST /v1/completions HTTP/1.1\r\nHost: a\r\n"
        b"Content-Length: abc\r\n\r\n"),
    raw("content-length-negative", 400, "Content-Length", b"POST /v1/completions HTTP/1.1\r\nHost: a\r\n"
        b"Content-Length: -5\r\n\r\n"),
    raw("bad-chunk-size", 400, "chunk", b"POST /v1/completions HTTP/1.1\r\nHost: a\r\nAuthorization: Bearer "
        + KEY.encode() + b"\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"),
    raw("nul-in-header", 400, "header value", b"GET /health HTTP/1.1\r\nHost: a\r\nX-A: a\x00b\r\n\r\n"),
    raw("space-in-header-name", 400, "header token", b"GET /health HTTP/1.1\r\nHost: a\r\nBad Name: x\r\n\r\n"),
    raw("http-9-9", 400, "HTTP version", b"GET /health HTTP/9.9\r\nHost: a\r\n\r\n"),
    raw("url-10kb", 400, "8190 bytes", b"GET /" + b"a" * 10_000 + b" HTTP/1.1\r\nHost: a\r\n\r\n"),
    raw("tls-on-http-port", 400, "HTTPS", b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03" + b"\x00" * 40),
    # -- authentication -------------------------------------------------------------------------------
    http("no-key", 401, "API key", prompt(), auth=False),
    http("wrong-key", 401, "incorrect API key", prompt(), auth=False, headers={"Authorization": "Bearer nope"}),
    http("basic-auth", 401, "Bearer", prompt(), auth=False, headers={"Authorization": "Basic dXNlcjpwYXNz"}),
    http("empty-bearer", 401, "Bearer", prompt(), auth=False, headers={"Authorization": "Bearer "}),
    http("models-without-key", 401, "API key", method="GET", path="/v1/models", auth=False),
    http("key-prefix", 401, "incorrect API key", prompt(), auth=False,
         headers={"Authorization": f"Bearer {KEY[:-1]}"}),
    http("key-non-ascii", 401, "incorrect API key", prompt(), auth=False,
         headers={"Authorization": "Bearer kéy"}),
    # -- gRPC -----------------------------------------------------------------------------------------
    rpc("grpc-undecodable", "INVALID_ARGUMENT", "not a valid", b"\xff\xff\xff\xff"),
    rpc("grpc-undecodable-stream", "INVALID_ARGUMENT", "not a valid", b"\x0a\x05ab", method="GenerateStream"),
    rpc("grpc-text-not-utf8", "INVALID_ARGUMENT", "not a valid", b"\x12\x02\xff\xfe"),
    rpc("grpc-health-undecodable", "INVALID_ARGUMENT", "not a valid", b"\xff", service="kvfleet.v1.Health",
        method="Check", key=None),
    rpc("grpc-no-key", "UNAUTHENTICATED", "API key", pb.GenerateRequest(text="x"), key=None),
    rpc("grpc-wrong-key", "UNAUTHENTICATED", "incorrect API key", pb.GenerateRequest(text="x"), key="nope"),
    rpc("grpc-stream-no-key", "UNAUTHENTICATED", "API key", pb.GenerateRequest(text="x"), key=None,
        method="GenerateStream"),
    rpc("grpc-unknown-method", "UNIMPLEMENTED", "method", pb.GenerateRequest(text="x"), method="Nope"),
    rpc("grpc-text-past-char-bound", "INVALID_ARGUMENT", "characters", pb.GenerateRequest(text=LONG_TEXT)),
    rpc("grpc-max-tokens-past-context", "INVALID_ARGUMENT", "max_tokens",
        pb.GenerateRequest(text="x", max_tokens=100_000)),
    rpc("grpc-token-ids-past-context", "INVALID_ARGUMENT", "too long",
        pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5] * 5000))),
    rpc("grpc-over-4mib", "RESOURCE_EXHAUSTED", "larger than max", pb.GenerateRequest(text="a" * (5 << 20))),
    rpc("grpc-top-p-zero", "INVALID_ARGUMENT", "top_p", pb.GenerateRequest(text="x", top_p=0.0)),
    rpc("grpc-unknown-model", "INVALID_ARGUMENT", "model", pb.GenerateRequest(model="gpt-4", text="x")),
]
# The HTTP statuses a hostile request may get (4xx), and the gRPC codes that are the client's fault.
CLIENT_CODES = {"INVALID_ARGUMENT", "UNAUTHENTICATED", "UNIMPLEMENTED", "RESOURCE_EXHAUSTED", "NOT_FOUND"}


@pytest.fixture(scope="module")
def agent(tiny_checkpoint: Callable[..., str]) -> Iterator[AgentProcess]:
    with running_agent(tiny_checkpoint("llama"), "--served-model-name", "tiny", "--api-key", KEY,
                    "--max-queue-length", str(QUEUE)) as a:
        yield a


def test_the_catalogue_is_large() -> None:
    assert len(CATALOGUE) >= 60 and len({c.name for c in CATALOGUE}) == len(CATALOGUE)
    assert sum(bool(c.grpc_method) for c in CATALOGUE) >= 10


@pytest.mark.parametrize("case", CATALOGUE, ids=[c.name for c in CATALOGUE])
def test_hostile_request_gets_a_4xx_naming_the_problem_and_the_server_keeps_serving(agent: AgentProcess,
                                                                                     case: Case) -> None:
    host, port = agent.url.removeprefix("http://").split(":")
    if case.grpc_method:
        assert agent.grpc_port is not None
        code, message = asyncio.run(_grpc(agent.grpc_port, case))
        assert code in CLIENT_CODES and code == case.status, (code, message)
    else:
        status, message, body = asyncio.run(asyncio.wait_for(_http(host, int(port), case.raw), IO_TIMEOUT_S))
        assert 400 <= status < 500 and status == case.status, (status, message)
        if isinstance(body, dict):  # ours: OpenAI's error shape, never a traceback
            assert set(body) == {"error"} and body["error"]["message"], body
            if case.param is not None:
                assert body["error"]["param"] == case.param, body
            assert len(message) < 1000, "an error must not echo a huge value back"
    assert case.says.lower() in message.lower(), message
    assert "Traceback" not in message
    assert asyncio.run(_still_serving(agent.url)) == (200, 200)


async def _http(host: str, port: int, request: bytes) -> tuple[int, str, object]:
    """Send raw bytes; return the status, the error message (or the raw body) and the parsed JSON body."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        try:
            writer.write(request)
            await writer.drain()
        except ConnectionError:
            pass  # the server may answer (and close) before taking the whole body: read what it said
        head = await reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), None)
        data = await (reader.readexactly(length) if length is not None else reader.read())
    finally:
        writer.close()
    text = data.decode("utf-8", "replace")
    try:
        body = json.loads(text)
    except ValueError:
        return status, text, None
    return status, body["error"]["message"] if isinstance(body, dict) and "error" in body else text, body


async def _grpc(port: int, case: Case) -> tuple[str, str]:
    metadata = (("authorization", f"Bearer {case.grpc_key}"),) if case.grpc_key else None
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        if case.grpc_method.endswith("Stream"):
            call = channel.unary_stream(case.grpc_method)(case.grpc_payload, timeout=IO_TIMEOUT_S, metadata=metadata)
            try:
                async for _ in call:
                    pass
            except grpc.aio.AioRpcError as e:
                return e.code().name, e.details() or ""
            return "OK", ""
        try:
            await channel.unary_unary(case.grpc_method)(case.grpc_payload, timeout=IO_TIMEOUT_S, metadata=metadata)
        except grpc.aio.AioRpcError as e:
            return e.code().name, e.details() or ""
        return "OK", ""


async def _still_serving(url: str) -> tuple[int, int]:
    """/health, and a normal completion: both must still work after each hostile request."""
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=IO_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        async with s.get(url + "/health") as r:
            health = r.status
        async with s.post(url + "/v1/completions", json=prompt(), headers=AUTH) as r:
            normal = r.status
            assert normal != 200 or (await r.json())["usage"]["completion_tokens"] == 2
    return health, normal
