"""spec.runtime.speculativeConfig in the agent pods: the --speculative-config the agent itself parses to the intended
config, and the draft checkpoint mounted read-only where no other mount can hide it or be hidden by it."""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvfleet_agent.spec_config import SpeculativeConfig
from kvfleet_operator.builders import CONFIG_HASH_ANNOTATION, agent_args, deployment, draft_dir, model_dir
from kvfleet_operator.config import DEFAULT_AGENT_IMAGE
from kvfleet_operator.models import InferenceDeployment, InferenceDeploymentSpec
from kvfleet_operator.speculative_models import DRAFT_MODELS_DIR

GOLDEN = Path(__file__).parent / "golden"
BASE: dict[str, Any] = {"model": {"name": "org/m", "source": {"pvc": {"claimName": "c", "path": "m"}}}}

# The golden inputs (test_builders.py renders them in full) and the config each must give the agent.
GOLDEN_CONFIGS = {
    "speculative-ngram": SpeculativeConfig("ngram", 4, None, 3, 3, 32, True),
    "speculative-draft-pvc": SpeculativeConfig("draft_model", 5, "/draft-models/meta-llama/Llama-3.1-70B-Instruct",
                                               adaptive=False),
    "speculative-draft-image": SpeculativeConfig("draft_model", 3, "/opt/models/qwen2-0.5b"),
}


def with_config(config: dict[str, Any] | None, **runtime: Any) -> InferenceDeploymentSpec:
    return InferenceDeploymentSpec.model_validate(
        {**BASE, "runtime": runtime | ({"speculativeConfig": config} if config is not None else {})})


def rendered(spec: InferenceDeploymentSpec) -> str | None:
    args = agent_args(spec)
    return args[args.index("--speculative-config") + 1] if "--speculative-config" in args else None


def pod(spec: InferenceDeploymentSpec) -> dict[str, Any]:
    cr = InferenceDeployment.model_validate({"metadata": {"name": "x", "uid": "u"}, "spec": spec.model_dump(
        by_alias=True, exclude_none=True)})
    return deployment(cr, DEFAULT_AGENT_IMAGE, 1)["spec"]["template"]  # type: ignore[no-any-return]


@pytest.mark.parametrize("name", sorted(GOLDEN_CONFIGS))
def test_the_agent_parses_the_golden_flags_to_the_intended_config(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvfleet_agent import cli, cli_serve

    seen: list[argparse.Namespace] = []
    monkeypatch.setattr(cli_serve, "run_serve", lambda a, options: seen.append(a) or 0)
    cr = InferenceDeployment.model_validate(yaml.safe_load((GOLDEN / f"{name}.input.yaml").read_text()))
    assert cli.main(agent_args(cr.spec)) == 0  # the real CLI takes the argument list as the pod passes it
    assert SpeculativeConfig.parse(seen[0].speculative_config) == GOLDEN_CONFIGS[name]


def test_every_ngram_config_renders_to_what_it_means() -> None:
    for lo, hi, k, off, adaptive in itertools.product((None, 1, 4), (None, 4, 9), (1, 3, 16), (None, 8),
                                                      (None, False, True)):
        if lo is not None and hi is not None and lo > hi:
            continue  # refused (test_speculative_models.py)
        config: dict[str, Any] = {"method": "ngram", "numSpeculativeTokens": k}
        for key, value in (("promptLookupMin", lo), ("promptLookupMax", hi), ("disableByBatchSize", off),
                           ("adaptive", adaptive)):
            if value is not None:
                config[key] = value
        text = rendered(with_config(config))
        assert text is not None and " " not in text  # compact
        raw = json.loads(text)
        assert list(raw) == ["method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
                             *(["disable_by_batch_size"] if off else []), "adaptive"], config  # explicit, vLLM's keys
        want_lo, want_hi = (lo or hi or 5), (hi or lo or 5)  # vLLM: one given sets the other
        assert SpeculativeConfig.parse(text) == SpeculativeConfig("ngram", k, None, want_lo, want_hi, off,
                                                                  adaptive is not False), config


def test_no_config_renders_no_flag_and_no_draft_volume() -> None:
    spec = with_config(None)
    assert rendered(spec) is None and draft_dir(spec) is None
    template = pod(spec)
    assert [v["name"] for v in template["spec"]["volumes"]] == ["tmp", "model"]
    assert rendered(with_config({"method": "ngram", "numSpeculativeTokens": 2})) is not None
    assert draft_dir(with_config({"method": "ngram", "numSpeculativeTokens": 2})) is None


@pytest.mark.parametrize(("source", "volume"), [
    ({"pvc": {"claimName": "drafts", "path": "tiny-draft"}},
     {"name": "draft-model", "persistentVolumeClaim": {"claimName": "drafts", "readOnly": True}}),
    ({"pvc": {"claimName": "c"}},  # the target's claim too: a volume of its own all the same
     {"name": "draft-model", "persistentVolumeClaim": {"claimName": "c", "readOnly": True}}),
    ({"hostPath": {"path": "/data/drafts/d"}},
     {"name": "draft-model", "hostPath": {"path": "/data/drafts/d", "type": "Directory"}}),
])
def test_a_mounted_draft_is_read_only_at_its_own_root(source: dict[str, Any], volume: dict[str, Any]) -> None:
    spec = with_config({"method": "draft_model", "numSpeculativeTokens": 3, "draftModel": {"source": source}},
                       tensorParallelSize=2)
    where = f"{DRAFT_MODELS_DIR}/org/m"
    assert draft_dir(spec) == where and model_dir(spec) == "/models/org/m"
    template = pod(spec)
    assert volume in template["spec"]["volumes"]
    [agent] = template["spec"]["containers"]
    mount = next(m for m in agent["volumeMounts"] if m["name"] == "draft-model")
    sub_path = source.get("pvc", {}).get("path")
    assert mount == {"name": "draft-model", "mountPath": where, "readOnly": True} | (
        {"subPath": sub_path} if sub_path else {})
    paths = [m["mountPath"] for m in agent["volumeMounts"]]
    for a, b in itertools.permutations(paths, 2):  # no mount hides (part of) another
        assert not f"{a}/".startswith(f"{b}/"), (a, b)
    raw = json.loads(agent["args"][agent["args"].index("--speculative-config") + 1])
    # The draft runs unsharded on rank 0: nothing about tensor parallelism (the agent refuses any other size).
    assert raw == {"method": "draft_model", "num_speculative_tokens": 3, "model": where, "adaptive": True}
    assert SpeculativeConfig.parse(json.dumps(raw)).model == where


def test_a_draft_in_the_image_is_read_where_it_is() -> None:
    spec = with_config({"method": "draft_model", "numSpeculativeTokens": 2, "adaptive": False,
                        "draftModel": {"source": {"image": {"path": "/opt/models/draft"}}}})
    assert draft_dir(spec) == "/opt/models/draft"
    assert [v["name"] for v in pod(spec)["spec"]["volumes"]] == ["tmp", "model"]
    assert SpeculativeConfig.parse(rendered(spec) or "") == SpeculativeConfig("draft_model", 2, "/opt/models/draft",
                                                                              adaptive=False)


def test_changing_the_speculative_config_rolls_the_pods() -> None:
    hashes = {pod(with_config(c))["metadata"]["annotations"][CONFIG_HASH_ANNOTATION] for c in (
        None, {"method": "ngram", "numSpeculativeTokens": 3}, {"method": "ngram", "numSpeculativeTokens": 4},
        {"method": "ngram", "numSpeculativeTokens": 3, "adaptive": False},
        {"method": "draft_model", "numSpeculativeTokens": 3, "draftModel": {"source": {"pvc": {"claimName": "d"}}}},
        {"method": "draft_model", "numSpeculativeTokens": 3, "draftModel": {"source": {"pvc": {"claimName": "e"}}}})}
    assert len(hashes) == 6


def test_extra_args_still_come_last() -> None:
    args = agent_args(with_config({"method": "ngram", "numSpeculativeTokens": 3}, extraArgs=["--seed", "7"]))
    assert args[-2:] == ["--seed", "7"] and args.index("--speculative-config") < len(args) - 2
