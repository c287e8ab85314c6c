"""The small endpoints against a real agent: /v1/models/{id} through the openai client, /tokenize and /detokenize
against the engine's own tokenizer, /version, /ping; all as the OpenAPI document's models declare."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import openai
import pytest
from server_process import AgentProcess, running_agent

from kvfleet_agent.models.tokenizer import Tokenizer
from kvfleet_agent.server.api import responses

MODEL = "tiny"
KEY = "sk-small-routes"


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint: Callable[..., str]) -> str:
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def agent(model_dir: str) -> Iterator[AgentProcess]:
    with running_agent(model_dir, "--served-model-name", MODEL, "--api-key", KEY, "--max-model-len", "128") as a:
        yield a


@pytest.fixture(scope="module")
def client(agent: AgentProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=agent.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def _call(agent: AgentProcess, path: str, body: Any = None, method: str | None = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(agent.url + path, data=data, method=method,
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def test_models_retrieve_and_list_carry_vllm_fields(client: openai.OpenAI, model_dir: str) -> None:
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.owned_by == "kvfleet"
    listed = responses.ModelList.model_validate(client.models.with_raw_response.list().http_response.json())
    one = responses.ModelCard.model_validate(client.models.with_raw_response.retrieve(MODEL).http_response.json())
    assert listed.data == [one] and one.root == model_dir and one.max_model_len == 128
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-4")
    assert info.value.body["code"] == "model_not_found"  # type: ignore[index]
    responses.ErrorResponse.model_validate(info.value.response.json())


def test_tokenize_matches_the_engine_tokenizer_and_detokenize_inverts_it(agent: AgentProcess,
                                                                          model_dir: str) -> None:
    tok = Tokenizer.from_dir(model_dir)
    assert tok is not None
    text = "Tokenize me, please."
    status, body = _call(agent, "/tokenize", {"model": MODEL, "prompt": text, "return_token_strs": True})
    assert status == 200, body
    responses.TokenizeResponse.model_validate(body)
    assert body["tokens"] == tok.encode(text) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 128 and len(body["token_strs"]) == body["count"]
    status, bare = _call(agent, "/tokenize", {"prompt": text, "add_special_tokens": False})
    assert bare["tokens"] == tok.encode(text, add_special_tokens=False)
    status, chat = _call(agent, "/tokenize", {"messages": [{"role": "user", "content": text}]})
    assert status == 200 and chat["count"] > bare["count"]
    status, back = _call(agent, "/detokenize", {"tokens": bare["tokens"]})
    assert status == 200 and back == {"prompt": tok.decode(bare["tokens"], skip_special_tokens=False)}


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, "prompt"),
    ("/tokenize", {"prompt": "x", "add_bos": True}, "add_bos"),
    ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
    ("/detokenize", {"tokens": [1], "model": "other"}, "model"),
])
def test_bad_tokenizer_requests_name_the_field(agent: AgentProcess, path: str, body: dict[str, Any],
                                               param: str) -> None:
    status, err = _call(agent, path, body)
    assert status in (400, 404) and err["error"]["param"] == param, err


def test_version_and_ping(agent: AgentProcess) -> None:
    status, body = _call(agent, "/version")
    assert status == 200 and responses.VersionResponse.model_validate(body).version
    assert _call(agent, "/ping") == (200, {"status": "ok"})
    assert _call(agent, "/ping", method="POST") == (200, {"status": "ok"})
