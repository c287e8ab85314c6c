"""--generation-config auto|vllm|DIR: generation_config.json (written by transformers) as request defaults, over HTTP
and gRPC, checked against the offline engine run with those values."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
from server_process import AgentProcess, start_agent
from transformers import GenerationConfig

from kvfleet_agent import LLM, SamplingParams
from kvfleet_agent.server import kvfleet_pb2 as pb
from kvfleet_agent.server import kvfleet_pb2_grpc as pb_grpc
from kvfleet_agent.server.request_defaults import load_request_defaults

PROMPT = "The quick brown fox"
GEN = {"do_sample": True, "temperature": 0.7, "top_p": 0.9, "top_k": 7, "min_p": 0.02, "repetition_penalty": 1.3,
       "max_new_tokens": 6}
AS_PARAMS = {k: v for k, v in GEN.items() if k not in ("do_sample", "max_new_tokens")}


def _save(folder: Path, base: Path, **fields: Any) -> Path:
    """generation_config.json as transformers writes it, keeping the checkpoint's token ids."""
    ids = json.loads((base / "generation_config.json").read_text())
    GenerationConfig(**ids, **fields).save_pretrained(folder)  # type: ignore[no-untyped-call]
    return folder


@pytest.fixture(scope="module")
def with_file(ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    copy = tmp_path_factory.mktemp("gen") / "model"
    shutil.copytree(ckpt, copy)
    return _save(copy, ckpt, **GEN)


def test_the_file_gives_vllms_defaults_and_vllm_gives_none(with_file: Path, ckpt: Path, tmp_path: Path) -> None:
    d = load_request_defaults("auto", str(with_file))
    assert d.sampling == pytest.approx(AS_PARAMS) and d.max_new_tokens == 6
    assert load_request_defaults(str(with_file), str(ckpt)) == d  # DIR: that folder's file
    assert load_request_defaults("vllm", str(with_file)).sampling == {}
    assert load_request_defaults("auto", str(ckpt)).sampling == {}  # the tiny checkpoint's file has token ids only
    # transformers' own defaults are no defaults (vLLM reads the file through to_diff_dict): top_k 50 stays off.
    assert load_request_defaults("auto", str(_save(tmp_path / "k", ckpt, do_sample=True, top_k=50))).sampling == {}
    with pytest.raises(ValueError, match=r"no generation_config\.json"):
        load_request_defaults(str(tmp_path / "none"), str(ckpt))
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "generation_config.json").write_text('{"top_p": 3}')
    with pytest.raises(ValueError, match="top_p"):
        load_request_defaults(str(tmp_path / "bad"), str(ckpt))


@pytest.fixture(scope="module")
def offline(ckpt: Path) -> LLM:
    return LLM(model=str(ckpt))


def _agent(model: Path, *flags: str) -> Callable[[], Iterator[AgentProcess]]:
    def fixture() -> Iterator[AgentProcess]:
        a = start_agent(str(model), *flags)
        try:
            yield a
        finally:
            assert a.stop() == 0, "".join(a.lines)
    return fixture


@pytest.fixture(scope="module")
def auto(with_file: Path) -> Iterator[AgentProcess]:
    yield from _agent(with_file)()  # no flag: auto is the default, as vLLM's


def _http(agent: AgentProcess, **fields: Any) -> str:
    client = openai.OpenAI(base_url=agent.url + "/v1", api_key="unused", max_retries=0, timeout=30)
    out = client.completions.create(model="model", prompt=PROMPT, seed=5, extra_body={"ignore_eos": True}, **fields)
    return str(out.choices[0].text)


def _grpc(agent: AgentProcess, **fields: Any) -> list[int]:
    assert agent.grpc_port is not None
    with grpc.insecure_channel(f"127.0.0.1:{agent.grpc_port}") as channel:
        stub = pb_grpc.GenerationStub(channel)  # type: ignore[no-untyped-call]
        resp = stub.Generate(pb.GenerateRequest(text=PROMPT, seed=5, ignore_eos=True, **fields), timeout=30)
    return [int(t) for t in resp.token_ids]


def _want(offline: LLM, **params: Any) -> tuple[list[int], str]:
    out = offline.generate(PROMPT, SamplingParams(seed=5, ignore_eos=True, **params), use_tqdm=False)[0].outputs[0]
    return list(out.token_ids), out.text


def test_omitted_fields_take_the_files_values_over_http_and_grpc(auto: AgentProcess, offline: LLM) -> None:
    ids, text = _want(offline, max_tokens=6, **AS_PARAMS)
    assert ids != _want(offline, max_tokens=6)[0]  # the defaults change the tokens: the test can tell
    # max_new_tokens caps even an explicit max_tokens, as vLLM does.
    assert _grpc(auto, max_tokens=40) == ids
    assert _http(auto, max_tokens=40) == text
    # A field the request sets wins over the file; the others still come from it.
    ids, text = _want(offline, max_tokens=6, **{**AS_PARAMS, "temperature": 0.0})
    assert _grpc(auto, temperature=0.0) == ids
    assert _http(auto, temperature=0) == text


def test_vllm_keeps_the_built_in_defaults_and_dir_reads_another_folder(with_file: Path, ckpt: Path,
                                                                      offline: LLM) -> None:
    for model, flag, params in ((with_file, "vllm", {"max_tokens": 16}),
                                (ckpt, str(with_file), {"max_tokens": 6, **AS_PARAMS})):
        for agent in _agent(model, "--generation-config", flag)():
            assert _grpc(agent) == _want(offline, **params)[0], flag
