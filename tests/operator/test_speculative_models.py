"""spec.runtime.speculativeConfig: the models refuse what its CEL rules refuse, with the same message; they draw the
agent's line (kvfleet_agent.spec_config), and declare its limits again without importing it."""

from __future__ import annotations

import copy
import itertools
from typing import Any

import pytest
from pydantic import ValidationError

from kvfleet_agent import spec_config
from kvfleet_agent.spec_config import SpeculativeConfig
from kvfleet_operator import speculative_models as sm
from kvfleet_operator.crd import crd
from kvfleet_operator.models import InferenceDeploymentSpec
from kvfleet_operator.rules import Rule

BASE: dict[str, Any] = {"model": {"name": "m", "source": {"pvc": {"claimName": "c"}}}}
NGRAM: dict[str, Any] = {"method": "ngram", "numSpeculativeTokens": 3}
DRAFT_PVC: dict[str, Any] = {"source": {"pvc": {"claimName": "drafts"}}}
DRAFT: dict[str, Any] = {"method": "draft_model", "numSpeculativeTokens": 3, "draftModel": DRAFT_PVC}
SUFFIX: dict[str, Any] = {"method": "suffix", "numSpeculativeTokens": 4}
DR = sm.DRAFT_SOURCE_RULES


def spec(config: dict[str, Any] | None, model: dict[str, Any] | None = None) -> InferenceDeploymentSpec:
    body = copy.deepcopy(BASE)
    if config is not None:
        body["runtime"] = {"speculativeConfig": config}
    if model is not None:
        body["model"] = model
    return InferenceDeploymentSpec.model_validate(body)


def draft(source: dict[str, Any]) -> dict[str, Any]:
    return {**DRAFT, "draftModel": {"source": source}}


# (case, speculativeConfig, spec.model or None, the rule it breaks): one mistake per rule, every rule covered.
CASES: list[tuple[str, dict[str, Any], dict[str, Any] | None, Rule]] = [
    ("draft_model without draftModel", {"method": "draft_model", "numSpeculativeTokens": 3}, None,
     sm.DRAFT_MODEL_REQUIRED_RULE),
    ("ngram with a draftModel", {**NGRAM, "draftModel": DRAFT_PVC}, None, sm.DRAFT_MODEL_UNUSED_RULE),
    ("promptLookupMax with draft_model", {**DRAFT, "promptLookupMax": 3}, None, sm.PROMPT_LOOKUP_METHOD_RULE),
    ("promptLookupMin with draft_model", {**DRAFT, "promptLookupMin": 1}, None, sm.PROMPT_LOOKUP_METHOD_RULE),
    ("suffix with a draftModel", {**SUFFIX, "draftModel": DRAFT_PVC}, None, sm.DRAFT_MODEL_UNUSED_RULE),
    ("suffixDecodingMaxTreeDepth with ngram", {**NGRAM, "suffixDecodingMaxTreeDepth": 4}, None,
     sm.SUFFIX_METHOD_RULE),
    ("suffixDecodingMinTokenProb with draft_model", {**DRAFT, "suffixDecodingMinTokenProb": 0.2}, None,
     sm.SUFFIX_METHOD_RULE),
    ("suffixDecodingMaxCachedTokens with ngram", {**NGRAM, "suffixDecodingMaxCachedTokens": 10}, None,
     sm.SUFFIX_METHOD_RULE),
    ("promptLookupMin above promptLookupMax", {**NGRAM, "promptLookupMin": 4, "promptLookupMax": 2}, None,
     sm.PROMPT_LOOKUP_ORDER_RULE),
    ("draft with two sources", draft({"pvc": {"claimName": "d"}, "image": {"path": "/d"}}), None, DR.source),
    ("draft with no source", draft({}), None, DR.source),
    ("draft absolute sub-path", draft({"pvc": {"claimName": "d", "path": "/abs"}}), None, DR.sub_path),
    ("draft dotdot sub-path", draft({"pvc": {"claimName": "d", "path": "a/../../b"}}), None, DR.sub_path),
    ("draft relative hostPath", draft({"hostPath": {"path": "models/d"}}), None, DR.host_path),
    ("draft hostPath under /etc", draft({"hostPath": {"path": "/etc/kubernetes"}}), None, DR.host_path_system),
    ("draft relative image path", draft({"image": {"path": "opt/d"}}), None, DR.image_path),
    ("draft image inside the target's mount", draft({"image": {"path": "/models/m/draft"}}), None,
     sm.DRAFT_IMAGE_MOUNT_RULE),
    ("draft image the target's mount itself", draft({"image": {"path": "/models/org/m/"}}),
     {"name": "org/m", "source": {"hostPath": {"path": "/data/m"}}}, sm.DRAFT_IMAGE_MOUNT_RULE),
    ("target image inside the draft's mount", DRAFT, {"name": "m", "source": {"image": {"path": "/draft-models/m/x"}}},
     sm.TARGET_IMAGE_MOUNT_RULE),
]


@pytest.mark.parametrize(("config", "model", "rule"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_rule_rejects_with_its_message(config: dict[str, Any], model: dict[str, Any] | None, rule: Rule) -> None:
    with pytest.raises(ValidationError) as e:
        spec(config, model)
    assert rule.message in str(e.value)
    assert rule.message.startswith("spec.")  # names the field first


def test_every_rule_has_a_case_and_sits_in_the_crd() -> None:
    assert set(sm.RULES) == {c[3] for c in CASES}
    text = str(crd())
    for rule in sm.RULES:  # (test_models.py checks the CRD holds no rule but these and rules.py's)
        assert rule.rule in text and rule.message in text, rule.message


def test_draft_source_messages_name_the_draft_field() -> None:
    for rule in sm.RULES[:5]:
        assert rule.message.startswith("spec.runtime.speculativeConfig.draftModel.source"), rule.message


@pytest.mark.parametrize(("config", "model"), [
    (NGRAM, None),
    ({**NGRAM, "promptLookupMin": 2, "promptLookupMax": 2, "disableByBatchSize": 1, "adaptive": False}, None),
    ({**NGRAM, "promptLookupMin": 7}, None),  # one alone sets the other (vLLM)
    ({**NGRAM, "numSpeculativeTokens": sm.MAX_SPECULATIVE_TOKENS}, None),
    (SUFFIX, None),
    ({**SUFFIX, "suffixDecodingMaxTreeDepth": 16, "suffixDecodingMaxCachedRequests": 0,
      "suffixDecodingMaxSpecFactor": 2.5, "suffixDecodingMinTokenProb": 0.0}, None),
    (DRAFT, None),
    (draft({"hostPath": {"path": "/data/models/draft"}}), None),
    (draft({"image": {"path": "/models/m-draft"}}), None),  # beside /models/m, not inside it
    (draft({"image": {"path": "/models"}}), None),  # holds the target's mount point, hides nothing of the draft's
    (draft({"image": {"path": "/models/m/draft"}}), {"name": "m", "source": {"image": {"path": "/opt/m"}}}),
    (DRAFT, {"name": "m", "source": {"image": {"path": "/draft-models/other"}}}),
    (draft({"image": {"path": "/opt/draft"}}), {"name": "m", "source": {"image": {"path": "/draft-models/m"}}}),
])
def test_accepts_the_edges_the_rules_allow(config: dict[str, Any], model: dict[str, Any] | None) -> None:
    assert spec(config, model).runtime.speculative_config is not None


def test_schema_ranges_and_required_keys() -> None:
    for bad in ({"method": "ngram"}, {"numSpeculativeTokens": 3}, {**NGRAM, "method": "eagle"},
                {**NGRAM, "numSpeculativeTokens": 0}, {**NGRAM, "numSpeculativeTokens": 17},
                {**NGRAM, "promptLookupMin": 0}, {**NGRAM, "disableByBatchSize": 0}, {**NGRAM, "model": "/x"},
                {**SUFFIX, "suffixDecodingMaxTreeDepth": 0}, {**SUFFIX, "suffixDecodingMinTokenProb": 1.5},
                {**SUFFIX, "suffixDecodingMaxCachedRequests": -1},
                {**DRAFT, "draftModel": {"source": {"pvc": {"claimName": "d"}}, "tensorParallelSize": 2}}):
        with pytest.raises(ValidationError):
            spec(bad)


def test_absent_means_no_speculation_and_adaptive_defaults_on() -> None:
    assert spec(None).runtime.speculative_config is None
    config = spec(NGRAM).runtime.speculative_config
    assert config is not None and config.adaptive is True and config.prompt_lookup() == (5, 5)
    runtime = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["runtime"]
    schema = runtime["properties"]["speculativeConfig"]
    assert "speculativeConfig" not in runtime["default"] and "default" not in schema
    assert schema["required"] == ["method", "numSpeculativeTokens"]
    assert schema["properties"]["adaptive"]["default"] is True
    assert schema["properties"]["numSpeculativeTokens"]["maximum"] == sm.MAX_SPECULATIVE_TOKENS
    assert schema["properties"]["draftModel"]["required"] == ["source"]


def test_limits_declared_again_agree_with_the_agent() -> None:
    assert sm.METHODS == spec_config.METHODS
    assert sm.MAX_SPECULATIVE_TOKENS == spec_config.MAX_SPECULATIVE_TOKENS
    defaults = SpeculativeConfig("ngram", 1)
    assert (defaults.prompt_lookup_min, defaults.prompt_lookup_max) == (sm.DEFAULT_PROMPT_LOOKUP,) * 2
    assert defaults.adaptive is sm.SpeculativeConfigSpec.model_fields["adaptive"].default
    assert (defaults.suffix_max_tree_depth, defaults.suffix_max_cached_requests, defaults.suffix_max_spec_factor,
            defaults.suffix_min_token_prob, defaults.suffix_max_cached_tokens) == sm.DEFAULT_SUFFIX


def test_suffix_renders_every_key_explicitly_and_the_agent_takes_it() -> None:
    config = spec({**SUFFIX, "suffixDecodingMaxSpecFactor": 2.0}).runtime.speculative_config
    assert config is not None
    raw = config.agent_config(None)
    assert raw == {"method": "suffix", "num_speculative_tokens": 4, "suffix_decoding_max_tree_depth": 8,
                   "suffix_decoding_max_cached_requests": 10_000, "suffix_decoding_max_spec_factor": 2.0,
                   "suffix_decoding_min_token_prob": 0.1, "suffix_decoding_max_cached_tokens": 200_000,
                   "adaptive": True}
    parsed = SpeculativeConfig.parse(raw)
    assert (parsed.method, parsed.suffix_max_spec_factor, parsed.suffix_max_tree_depth) == ("suffix", 2.0, 8)


def _agent_raw(config: dict[str, Any]) -> dict[str, Any]:
    """The agent's JSON for a speculativeConfig as written (draftModel as a directory), without the operator."""
    keys = {"method": "method", "numSpeculativeTokens": "num_speculative_tokens", "adaptive": "adaptive",
            "promptLookupMin": "prompt_lookup_min", "promptLookupMax": "prompt_lookup_max",
            "disableByBatchSize": "disable_by_batch_size",
            "suffixDecodingMaxTreeDepth": "suffix_decoding_max_tree_depth",
            "suffixDecodingMinTokenProb": "suffix_decoding_min_token_prob"}
    return {keys[k]: v for k, v in config.items() if k in keys} | ({"model": "/d"} if "draftModel" in config else {})


def _grid() -> list[dict[str, Any]]:
    out = []
    for method, k, lo, hi, dm, depth in itertools.product(("ngram", "suffix", "draft_model"), (0, 1, 16, 17),
                                                          (None, 2, 5), (None, 1, 5), (False, True), (None, 0, 4)):
        config: dict[str, Any] = {"method": method, "numSpeculativeTokens": k}
        config |= ({"promptLookupMin": lo} if lo else {}) | ({"promptLookupMax": hi} if hi else {})
        config |= {"suffixDecodingMaxTreeDepth": depth} if depth is not None else {}
        out.append(config | ({"draftModel": DRAFT_PVC} if dm else {}))
    out += [{**SUFFIX, "suffixDecodingMinTokenProb": p} for p in (-0.1, 0.0, 1.0, 1.1)]
    return out


def test_the_operator_and_the_agent_refuse_the_same_configs() -> None:
    verdicts = []
    for config in _grid():
        try:
            spec(config)
            ours = True
        except ValidationError:
            ours = False
        try:
            SpeculativeConfig.parse(_agent_raw(config))
            agent = True
        except ValueError:
            agent = False
        assert ours == agent, (config, ours, agent)
        verdicts.append(ours)
    assert any(verdicts) and not all(verdicts)
