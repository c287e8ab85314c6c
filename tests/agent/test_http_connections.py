"""Connections against a real agent: idle, slowloris and slow-body clients are cut off; a cap refuses with 503.

Timeouts are set small by flags; nothing sleeps to synchronise: each test polls a socket for the
server's answer or its EOF until a generous deadline, and measures when that happened.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable, Iterator

import pytest
from server_process import AgentProcess, running_agent, start_agent

KEEP_ALIVE_S = 3.0
HEADER_S = 1.0
BODY_S = 1.0
DEADLINE_S = 30.0  # far past every timeout: only a connection that is never closed reaches it
CAP = 4


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint: Callable[..., str]) -> str:
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def agent(model_dir: str) -> Iterator[AgentProcess]:
    with running_agent(model_dir, "--served-model-name", "tiny", "--keep-alive-timeout", str(KEEP_ALIVE_S),
                    "--header-timeout", str(HEADER_S), "--body-timeout", str(BODY_S)) as a:
        yield a


def _connect(agent: AgentProcess) -> socket.socket:
    host, port = agent.url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=DEADLINE_S)


def _read_until_eof(sock: socket.socket, dribble: bytes = b"") -> tuple[bytes, float]:
    """Everything the server sends until it closes, and when it closed (seconds from now).

    With `dribble`, sends it every 0.2 s meanwhile, as a slowloris client does (a pace, not a wait).
    """
    started = time.monotonic()
    sock.settimeout(0.2 if dribble else DEADLINE_S)
    data = b""
    while time.monotonic() - started < DEADLINE_S:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            try:
                sock.send(dribble)
            except OSError:  # closed by the server while we dribbled
                return data, time.monotonic() - started
            continue
        except ConnectionResetError:
            return data, time.monotonic() - started
        if not chunk:
            return data, time.monotonic() - started
        data += chunk
    raise AssertionError(f"the server kept the connection open for {DEADLINE_S} s; it sent {data[:200]!r}")


def _get(agent: AgentProcess, path: str = "/health") -> tuple[int, bytes]:
    """A one-shot request on a fresh connection: status and body."""
    with _connect(agent) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n".encode())
        data, _ = _read_until_eof(sock)
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


def test_an_idle_connection_is_closed_after_the_keep_alive_timeout(agent: AgentProcess) -> None:
    with _connect(agent) as sock:
        data, closed_after = _read_until_eof(sock)
    assert data == b"" and closed_after >= KEEP_ALIVE_S - 0.1, closed_after
    assert _get(agent)[0] == 200


def test_a_connection_idle_after_a_response_is_closed_too(agent: AgentProcess) -> None:
    with _connect(agent) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: a\r\n\r\n")
        data, closed_after = _read_until_eof(sock)
    assert data.startswith(b"HTTP/1.1 200") and closed_after >= KEEP_ALIVE_S - 0.1, (data, closed_after)


def test_a_slowloris_head_is_cut_off_by_the_header_timeout(agent: AgentProcess) -> None:
    before = sum("--header-timeout" in line for line in agent.lines)
    with _connect(agent) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: a\r\n")
        _, closed_after = _read_until_eof(sock, dribble=b"X-Slow: 1\r\n")
    assert closed_after >= HEADER_S - 0.1, closed_after
    # The header deadline closed it (the keep-alive timer would too, later): the agent says which.
    assert _wait_for(lambda: sum("--header-timeout" in line for line in agent.lines) > before)
    assert _get(agent)[0] == 200


def test_a_body_that_never_arrives_gets_408(agent: AgentProcess) -> None:
    with _connect(agent) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: a\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"model\": ")
        data, _ = _read_until_eof(sock)
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), data
    assert "--body-timeout" in json.loads(body)["error"]["message"]
    assert _get(agent)[0] == 200


def test_keep_alive_requests_on_one_connection_are_not_cut(agent: AgentProcess) -> None:
    with _connect(agent) as sock:
        for _ in range(3):
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: a\r\n\r\n")
            data = b""
            while not data.endswith(b'"ok"}'):
                chunk = sock.recv(4096)
                assert chunk, f"closed mid-conversation after {data!r}"
                data += chunk
            assert data.startswith(b"HTTP/1.1 200")


def test_connections_beyond_the_cap_get_503_and_clients_are_served_once_abusers_leave(model_dir: str) -> None:
    a = start_agent(model_dir, "--served-model-name", "tiny", "--max-connections", str(CAP),
                    "--keep-alive-timeout", "120")
    abusers: list[socket.socket] = []
    try:
        for _ in range(CAP):  # each is served once (so it is surely accepted), then holds its slot idle
            sock = _connect(a)
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: a\r\n\r\n")
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")
            abusers.append(sock)
        refusals, started = 200, time.monotonic()
        for _ in range(refusals):
            status, body = _get(a)
            assert status == 503, body
            assert f"limit of {CAP} open connections" in json.loads(body)["error"]["message"]
        # Logged at most 5 times per 10 s window (log_limit.RateLimitFilter), whatever the flood.
        windows = int((time.monotonic() - started) / 10) + 2
        assert _wait_for(lambda: any("refused a connection" in line for line in a.lines))
        lines = [line for line in a.lines if "refused a connection" in line]
        assert len(lines) <= 5 * windows, f"{len(lines)} log lines for {refusals} refusals: not rate-limited"
        for sock in abusers:
            sock.close()
        # The server sees each close as an EOF at once; poll until a slot is free again.
        assert _wait_for(lambda: _get(a)[0] == 200)
    finally:
        for sock in abusers:
            sock.close()
        assert a.stop() == 0, "".join(a.lines)


def _wait_for(condition: Callable[[], bool], deadline_s: float = DEADLINE_S) -> bool:
    """Poll a condition until it holds or the deadline passes."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.02)  # between polls of a condition, not as synchronisation
    return False
