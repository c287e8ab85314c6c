"""Unmodified third-party clients against a real agent, offline: guidellm's benchmark run and litellm's calls.

guidellm needs a tokenizer: it is pointed at the checkpoint directory, so nothing is downloaded
(HF_HUB_OFFLINE makes any attempt fail loudly instead).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from server_process import AgentProcess, running_agent

MODEL = "tiny"
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "LITELLM_LOCAL_MODEL_COST_MAP": "True"}  # litellm would fetch its price list at import otherwise
# guidellm's own finding that making its synthetic data took a share of the (tiny model's) time to first
# token: about the client, not the server.
CLIENT_SIDE_WARNINGS = {"generation_delay_ttft"}


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint: Callable[..., str]) -> str:
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def agent(model_dir: str) -> Iterator[AgentProcess]:
    with running_agent(model_dir, "--served-model-name", MODEL, "--max-model-len", "256", positional=True) as a:
        yield a


@pytest.mark.slow
@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_guidellm_runs_a_bounded_benchmark_without_warnings(agent: AgentProcess, model_dir: str, tmp_path: Path,
                                                             route: str) -> None:
    out = tmp_path / "guidellm.json"
    cmd = [str(Path(sys.executable).parent / "guidellm"), "run",
           "--backend", f"kind=openai_http,target={agent.url},model={MODEL},request_format={route}",
           "--profile", "kind=concurrent,streams=2", "--constraint", "kind=max_requests,count=6",
           "--data", "kind=synthetic_text,prompt_tokens=24,output_tokens=8",
           "--tokenizer", f"kind=huggingface_auto,model={model_dir}",
           "--output", f"kind=json,path={out}", "--disable-console-interactive"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env=os.environ | OFFLINE, check=False)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log
    assert "WARNING" not in log and "align" not in log.lower(), log  # e.g. "cannot align without /tokenize"
    (bench,) = json.loads(out.read_text())["benchmarks"]
    made = bench["scheduler_metrics"]["requests_made"]
    assert (made["successful"], made["errored"], made["incomplete"]) == (6, 0, 0), made
    assert {w["code"] for w in bench["warnings"]} <= CLIENT_SIDE_WARNINGS, bench["warnings"]
    for r in bench["requests"]["successful"]:
        assert r["response_id"].startswith("chatcmpl-" if "chat" in route else "cmpl-"), r  # the route asked for
        assert r["output_metrics"]["text_tokens"] == 8, r  # ignore_eos and max tokens honoured, counted by usage


def test_litellm_completion_and_chat(agent: AgentProcess) -> None:
    script = f"""
import json, warnings
warnings.simplefilter("error")  # a deprecation or compatibility warning from litellm fails the test
import litellm
base = {agent.url + "/v1"!r}
chat = litellm.completion(model="hosted_vllm/{MODEL}", api_base=base, api_key="none", max_tokens=4, temperature=0,
                          messages=[{{"role": "user", "content": "hi"}}])
text = litellm.text_completion(model="hosted_vllm/{MODEL}", api_base=base, api_key="none", prompt="The fleet",
                               max_tokens=4, temperature=0, n=2, seed=1)
reply = chat.choices[0]
print(json.dumps({{"chat": [reply.message.content, chat.usage.completion_tokens, reply.finish_reason],
                  "text": [[c.text for c in text.choices], text.usage.completion_tokens]}}))
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env=os.environ | OFFLINE, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    content, tokens, finish = result["chat"]
    assert isinstance(content, str) and content and tokens == 4 and finish == "length"
    texts, tokens = result["text"]
    assert len(texts) == 2 and tokens == 8
