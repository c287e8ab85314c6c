"""Router test fixtures: two real agents on the tiny checkpoint, and a router in front of them."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator

import pytest
from router_helpers import MODEL, OpenAIless, RouterProcess, start_router, wait_for
from server_process import AgentProcess, start_agent


@pytest.fixture(scope="module")
def agents(tiny_checkpoint: Callable[..., str]) -> Iterator[list[AgentProcess]]:
    started = [start_agent(tiny_checkpoint("llama"), "--served-model-name", MODEL, "--max-queue-length", "64",
                           "--max-num-seqs", "8") for _ in range(2)]
    yield started
    for a in started:
        a.stop()


@pytest.fixture(scope="module")
def router(agents: list[AgentProcess]) -> Iterator[RouterProcess]:
    r = start_router(f"{MODEL}={agents[0].url},{agents[1].url}")
    wait_for(lambda: '"ready_replicas": 2' in json.dumps(json.loads(OpenAIless.get(f"{r.url}/v1/models"))))
    yield r
    r.stop()
