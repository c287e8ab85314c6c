"""vLLM's flag spellings on `kvfleet-agent serve`: accepted where the meaning matches, refused by name where not."""

from __future__ import annotations

import argparse
import json
import shutil
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from server_process import start_agent
from transformers import AutoTokenizer

from kvfleet_agent import cli
from kvfleet_agent.cli_serve import load_chat_template

TEMPLATE = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\\n{% endfor %}=>"  # as typed in a shell


def _engine_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    cli._engine_flags(parser)
    return parser


@pytest.mark.parametrize(("argv", "prefix", "chunked"), [
    ([], True, True),
    (["--no-enable-prefix-caching", "--no-enable-chunked-prefill"], False, False),
    (["--no-prefix-caching", "--no-chunked-prefill"], False, False),  # kvfleet's first spellings (the operator's)
    (["--no-prefix-caching", "--enable-prefix-caching", "--enable-chunked-prefill"], True, True),  # the last wins
])
def test_prefix_caching_and_chunked_prefill_spellings(argv: list[str], prefix: bool, chunked: bool) -> None:
    options = cli._engine_options(_engine_parser().parse_args(argv))
    assert (options["enable_prefix_caching"], options["enable_chunked_prefill"]) == (prefix, chunked)


def test_the_environment_turns_a_vllm_spelled_feature_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVFLEET_ENABLE_PREFIX_CACHING", "false")
    parser = _engine_parser()
    cli._env_defaults(parser)
    assert cli._engine_options(parser.parse_args([]))["enable_prefix_caching"] is False
    assert cli._engine_options(parser.parse_args(["--enable-prefix-caching"]))["enable_prefix_caching"] is True


def test_chat_template_is_a_file_or_the_template_with_escapes_decoded(tmp_path: Path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0].content }}\n", encoding="utf-8")
    assert load_chat_template(str(path)) == "{{ messages[0].content }}\n"
    assert load_chat_template("{{ 'café → ' }}\\n\\t") == "{{ 'café → ' }}\n\t"  # non-ASCII kept as typed


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert cli.main(["serve", *argv]) == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(("argv", "named"), [
    ([], "the model is required"),
    (["{model}", "--model", "{other}"], "--model"),
    (["{model}", "--tokenizer", "{other}"], "--tokenizer"),
    (["{model}", "--generation-config", "{other}"], "there is no generation_config.json"),
    (["{model}", "--chat-template", "no/such/template.jinja"], "--chat-template 'no/such/template.jinja' looks like"),
    (["{model}", "--chat-template", "{% for m in messages %}"], "--chat-template has a jinja syntax error"),
    (["{other}", "--chat-template", "{{ x }}"], "--chat-template needs a tokenizer"),
])
def test_flags_kvfleet_cannot_honour_are_refused_by_name(argv: list[str], named: str, tmp_path: Path,
                                                          tiny_checkpoint: Callable[..., str],
                                                          capsys: pytest.CaptureFixture[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVFLEET_MODEL", raising=False)
    values = {"{model}": tiny_checkpoint("llama"), "{other}": str(tmp_path)}
    err = _refused([values.get(a, a) for a in argv], capsys)
    assert named in err and "Traceback" not in err, err


def _post(url: str, body: dict[str, Any]) -> Any:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.load(r)


def test_a_vllm_style_command_line_serves(tiny_checkpoint: Callable[..., str], tmp_path: Path) -> None:
    # The weights without a tokenizer, and the tokenizer (as transformers saves it) in a directory of its own.
    model, tokenizer = tmp_path / "weights", tmp_path / "tokenizer"
    shutil.copytree(tiny_checkpoint("llama"), model)
    AutoTokenizer.from_pretrained(str(model)).save_pretrained(str(tokenizer))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model / name).unlink()
    agent = start_agent(str(model), "--served-model-name", "tiny", "--tokenizer", str(tokenizer), "--chat-template",
                        TEMPLATE, "--generation-config", "vllm", "--disable-log-requests", "--no-enable-prefix-caching",
                        "--no-enable-chunked-prefill", "--max-model-len", "128", "--max-num-batched-tokens", "128",
                        positional=True)
    try:
        messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
        rendered = _post(agent.url + "/tokenize", {"messages": messages})
        assert rendered == _post(agent.url + "/tokenize", {"prompt": "[user] hi\n[assistant] yo\n=>"})
        with urllib.request.urlopen(agent.url + "/tokenizer_info", timeout=30) as r:
            assert json.load(r)["chat_template"] == TEMPLATE.replace("\\n", "\n")
        chat = _post(agent.url + "/v1/chat/completions", {"model": "tiny", "messages": messages, "max_tokens": 3})
        assert chat["usage"]["prompt_tokens"] == rendered["count"]
    finally:
        assert agent.stop() == 0, "".join(agent.lines)
