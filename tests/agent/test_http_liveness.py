"""/health keeps answering while the largest prompts the agent accepts are tokenized, and while huge ones are refused.

A liveness probe must never wait on a prompt: before this was fixed a 10.5 MB prompt froze
/health for 15 s, since the whole text was tokenized on the event loop before any length check.
The bound asserted (100 ms) is a behaviour, not a speed goal: a probe answered in a few
milliseconds, never one stuck behind a tokenization. Each probe is timed while big requests
run; on a loaded machine a probe may be slow by chance, so the measurement is tried up to three
times and must pass once (a loop really blocked by tokenizing fails every time).
"""

from __future__ import annotations

import http.client
import json
import re
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from server_process import AgentProcess, start_agent

# The checkpoint of test_http.py (so the session makes it once), at its 4096 positions and at 32768.
SLOW = {"hidden_size": 128, "intermediate_size": 352, "num_hidden_layers": 4}
PROBE_BOUND_S = 0.1
ATTEMPTS = 3
ROUNDS = 4  # "four such requests in a row must not fail the liveness probe"
# At 32768 positions the largest prompt accepted has 393,216 characters, some 0.2 s of tokenizing:
# only a tokenizer that releases the GIL keeps /health answering meanwhile (models/tokenizer.py calls
# tokenizers' encode_batch(), which does; encode() would not).


@pytest.fixture(scope="module", params=[4096, 32768], ids=lambda n: f"context-{n}")
def agent(request: pytest.FixtureRequest, tiny_checkpoint: Callable[..., str]) -> Iterator[AgentProcess]:
    context = request.param
    a = start_agent(tiny_checkpoint("llama", max_position_embeddings=context, **SLOW), "--served-model-name", "tiny",
                    "--kv-cache-memory-bytes", str(context * 4096))  # 1 KiB a token, with room to spare
    try:
        yield a
    finally:
        assert a.stop() == 0, "".join(a.lines)


class Prober(threading.Thread):
    """GET /health over one keep-alive connection, as fast as it answers, timing each answer."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.host, port = url.removeprefix("http://").split(":")
        self.port = int(port)
        self.stop = threading.Event()
        self.probes: list[tuple[float, float, int]] = []  # (sent, answered, status)

    def run(self) -> None:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=30)
        while not self.stop.is_set():
            sent = time.perf_counter()
            conn.request("GET", "/health")
            resp = conn.getresponse()
            resp.read()
            self.probes.append((sent, time.perf_counter(), resp.status))
        conn.close()


def _post(url: str, body: bytes) -> tuple[int, str, float, float]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    started = time.perf_counter()
    conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = json.loads(resp.read())
    conn.close()
    return resp.status, data["error"]["message"] if "error" in data else "", started, time.perf_counter()


def _body(text: str) -> bytes:
    return json.dumps({"model": "tiny", "prompt": text, "max_tokens": 1}).encode()


def test_health_answers_while_the_largest_prompts_are_tokenized(agent: AgentProcess) -> None:
    # The agent says how many characters can fit; the largest accepted prompt has exactly that many.
    status, message, _, _ = _post(agent.url, _body("x" * 10_500_000))
    match = re.search(r"no more than (\d+)", message)
    assert status == 400 and match, message
    largest = ("the quick brown fox jumps over the lazy dog, " * 10_000)[:int(match.group(1))]
    bodies = [_body(largest)] * ROUNDS + [_body("y" * 10_500_000)] * ROUNDS  # encoded once, before timing

    worst: list[float] = []
    for _ in range(ATTEMPTS):
        prober = Prober(agent.url)
        prober.start()
        results = [_post(agent.url, body) for body in bodies]
        prober.stop.set()
        prober.join(60)
        # Tokenized (refused for its tokens, not its characters), then the huge ones refused unread.
        assert all(r[0] == 400 and "tokens; this model's context" in r[1] for r in results[:ROUNDS]), results
        assert all(r[0] == 400 and "characters" in r[1] for r in results[ROUNDS:]), results
        assert all(status == 200 for _, _, status in prober.probes)
        for _, _, started, ended in results[:ROUNDS]:  # probes really ran while each prompt was tokenized
            assert any(sent < ended and answered > started for sent, answered, _ in prober.probes)
        worst.append(max(answered - sent for sent, answered, _ in prober.probes))
        if worst[-1] < PROBE_BOUND_S:
            return
    pytest.fail(f"/health took up to {[f'{w * 1000:.0f} ms' for w in worst]} in {ATTEMPTS} attempts while prompts "
                f"were tokenized; it must answer within {PROBE_BOUND_S * 1000:.0f} ms")
