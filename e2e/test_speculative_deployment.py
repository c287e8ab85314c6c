"""Speculative decoding through the operator on the local control plane: an InferenceDeployment with
spec.runtime.speculativeConfig (n-gram prompt lookup) becomes Ready, its agent answers greedy requests exactly as an
agent of the same checkpoint without speculation does, and counts its draft tokens; the apiserver refuses what the
models refuse, with the same messages."""

from __future__ import annotations

import copy
import json
import urllib.request
from pathlib import Path
from typing import Any

from cluster import LocalCluster
from kube_util import is_running_ready, pods
from operator_proc import SELECTOR, Operator, apply_cr, inference_deployment, wait_ready
from pydantic import ValidationError
from router_fleet import AGENT_PORT, metrics, total

# e2e/ is type-checked on its own (`cd e2e && mypy --strict *.py`), without the project's mypy_path.
from kvfleet_operator.models import InferenceDeployment  # type: ignore[import-not-found]
from kvfleet_operator.speculative_models import DRAFT_MODEL_REQUIRED_RULE  # type: ignore[import-not-found]

CONFIG: dict[str, Any] = {"method": "ngram", "numSpeculativeTokens": 3, "promptLookupMax": 3, "promptLookupMin": 1,
                          "adaptive": False}
DRAFT: dict[str, Any] = {"method": "draft_model", "numSpeculativeTokens": 3}  # and no draftModel
RENDERED = ('{"method":"ngram","num_speculative_tokens":3,"prompt_lookup_min":1,"prompt_lookup_max":3,'
            '"adaptive":false}')
# Repetitive prompts: their last tokens occurred before, so prompt lookup has drafts to propose from the first step.
PROMPTS = ["one two three four one two three four one two three four one two three",
           "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef add(a,",
           "the cat sat on the mat. the cat sat on the mat. the cat sat on the mat. the cat",
           "red green blue red green blue red green blue red green blue red green"]
MAX_TOKENS = 32


def agent(cluster: LocalCluster, namespace: str, name: str) -> dict[str, Any]:
    [pod] = [p for p in pods(cluster, namespace, f"{SELECTOR}={name}")
             if is_running_ready(p) and not p["metadata"].get("deletionTimestamp")]
    return pod


def speculative(namespace: str, model: Path, config: dict[str, Any], name: str = "spec") -> dict[str, Any]:
    body = inference_deployment(name, namespace, model)
    body["spec"]["runtime"]["speculativeConfig"] = config
    return body


def greedy(port: int, prompt: str) -> tuple[str, int]:
    """A temperature-0 completion of exactly MAX_TOKENS tokens: its text and token count."""
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                       "ignore_eos": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        answer = json.loads(resp.read())
    return answer["choices"][0]["text"], answer["usage"]["completion_tokens"]


def test_ngram_speculation_keeps_greedy_outputs_and_counts_its_drafts(cluster: LocalCluster, operator: Operator,
                                                                     namespace: str, tiny_model: Path) -> None:
    apply_cr(cluster, speculative(namespace, tiny_model, CONFIG))
    apply_cr(cluster, inference_deployment("plain", namespace, tiny_model))  # the same checkpoint, no speculation
    wait_ready(cluster, namespace, "spec", 1)
    wait_ready(cluster, namespace, "plain", 1)
    spec_pod, plain_pod = agent(cluster, namespace, "spec"), agent(cluster, namespace, "plain")
    args = spec_pod["spec"]["containers"][0]["args"]
    assert args[args.index("--speculative-config") + 1] == RENDERED, args
    assert "--speculative-config" not in plain_pod["spec"]["containers"][0]["args"]

    spec_ip, plain_ip = spec_pod["status"]["podIP"], plain_pod["status"]["podIP"]
    with cluster.port_forward(spec_ip, AGENT_PORT) as with_drafts, cluster.port_forward(plain_ip, AGENT_PORT) as plain:
        for prompt in PROMPTS:
            want = greedy(plain, prompt)
            assert want[1] == MAX_TOKENS
            assert greedy(with_drafts, prompt) == want, prompt

    samples = metrics(cluster, spec_ip, AGENT_PORT)
    drafted = total(samples, "kvfleet_spec_decode_num_draft_tokens_total", method="ngram")
    assert drafted > 0, {k: v for k, v in samples.items() if "spec_decode" in k}
    assert total(samples, "kvfleet_spec_decode_num_drafts_total", method="ngram") > 0
    assert not any("spec_decode" in k for k in metrics(cluster, plain_ip, AGENT_PORT))  # no speculation, no family


def test_the_apiserver_refuses_draft_model_without_a_draft(cluster: LocalCluster, operator: Operator,
                                                          namespace: str, tiny_model: Path) -> None:
    proc = apply_cr(cluster, speculative(namespace, tiny_model, DRAFT),
                    check=False)
    assert proc.returncode != 0, proc.stdout
    assert DRAFT_MODEL_REQUIRED_RULE.message in proc.stderr, proc.stderr
    assert "spec.runtime.speculativeConfig: Invalid value" in proc.stderr, proc.stderr
    assert not pods(cluster, namespace, f"{SELECTOR}=spec")


DRAFT_ON_PVC: dict[str, Any] = {**DRAFT, "draftModel": {"source": {"pvc": {"claimName": "d", "path": "tiny-draft"}}}}
# speculativeConfig values, each sent to the apiserver (a server-side dry run) and to the models.
AGREE: list[dict[str, Any]] = [
    CONFIG, {"method": "ngram", "numSpeculativeTokens": 1}, {"method": "ngram", "numSpeculativeTokens": 16},
    {"method": "ngram", "numSpeculativeTokens": 0}, {"method": "ngram", "numSpeculativeTokens": 17},
    {"method": "eagle", "numSpeculativeTokens": 3}, {"method": "ngram"}, {"numSpeculativeTokens": 3},
    {"method": "ngram", "numSpeculativeTokens": 3, "promptLookupMin": 4, "promptLookupMax": 2},
    {"method": "ngram", "numSpeculativeTokens": 3, "promptLookupMin": 4},
    {"method": "ngram", "numSpeculativeTokens": 3, "disableByBatchSize": 0},
    {"method": "ngram", "numSpeculativeTokens": 3, "draftModel": {"source": {"pvc": {"claimName": "d"}}}},
    DRAFT, DRAFT_ON_PVC,
    {**DRAFT, "promptLookupMax": 3, "draftModel": {"source": {"pvc": {"claimName": "d"}}}},
    {**DRAFT, "draftModel": {"source": {"pvc": {"claimName": "d", "path": "/abs"}}}},
    {**DRAFT, "draftModel": {"source": {"pvc": {"claimName": "d"}, "image": {"path": "/d"}}}},
    {**DRAFT, "draftModel": {"source": {}}},
    {**DRAFT, "draftModel": {"source": {"hostPath": {"path": "/data/drafts/d"}}}},
    {**DRAFT, "draftModel": {"source": {"hostPath": {"path": "/etc/d"}}}},
    {**DRAFT, "draftModel": {"source": {"hostPath": {"path": "data/d"}}}},
    {**DRAFT, "draftModel": {"source": {"image": {"path": "/opt/d"}}}},
    {**DRAFT, "draftModel": {"source": {"image": {"path": "opt/d"}}}},
    {**DRAFT, "draftModel": {"source": {"image": {"path": "/models/tiny/draft"}}}},  # under the target's mount
    {**DRAFT, "draftModel": {"source": {"image": {"path": "/models/tiny-draft"}}}},  # beside it
]


def _refusal(body: dict[str, Any]) -> list[str] | None:
    """None if the models accept the body, else the messages of the rules it breaks."""
    try:
        InferenceDeployment.model_validate(body)
    except ValidationError as e:
        return [str(err["ctx"]["error"]) for err in e.errors() if err["type"] == "value_error"]
    return None


def test_the_apiserver_and_the_models_agree(cluster: LocalCluster, operator: Operator, namespace: str,
                                            tiny_model: Path) -> None:
    bodies = [(json.dumps(c), speculative(namespace, tiny_model, c, "agree")) for c in AGREE]
    target_in_draft_mount = speculative(namespace, tiny_model, DRAFT_ON_PVC, "agree")
    target_in_draft_mount["spec"]["model"]["source"] = {"image": {"path": "/draft-models/tiny/x"}}
    bodies.append(("target image under /draft-models/tiny", target_in_draft_mount))
    moved = copy.deepcopy(target_in_draft_mount)
    moved["spec"]["model"]["source"] = {"image": {"path": "/opt/models/tiny"}}
    bodies.append(("target image elsewhere", moved))
    disagree = []
    for case, body in bodies:
        server = cluster.kubectl("apply", "--server-side", "--dry-run=server", "--field-manager=e2e-user", "-f", "-",
                                 stdin=json.dumps(body), check=False)
        refusal = _refusal(body)
        if (server.returncode == 0) != (refusal is None):
            disagree.append(f"{case}: apiserver {'accepts' if server.returncode == 0 else 'refuses'} "
                            f"({server.stderr.strip()[-300:]}), models {'accept' if refusal is None else 'refuse'}")
        disagree += [f"{case}: the apiserver does not say {m!r}: {server.stderr.strip()[-300:]}"
                     for m in refusal or [] if m not in server.stderr]
    assert not disagree, "\n".join(disagree)
    accepted = sum(1 for _, body in bodies if _refusal(body) is None)
    assert 0 < accepted < len(bodies)
