"""spec.runtime.speculativeConfig (pydantic, with its CEL rules): vLLM's --speculative-config for the agents."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import ConfigDict, Field, model_validator

from kvfleet_operator.core_types import SpecModel
from kvfleet_operator.model_sources import HostPathSource, ImageSource, ModelSource, PvcSource
from kvfleet_operator.rules import Rule, SourceRules, cel, check, source_rules

# The agent's limits and defaults (kvfleet_agent/spec_config.py), declared again: the operator imports nothing of
# the agent. tests/operator/test_speculative_models.py checks that both agree.
METHODS = ("ngram", "suffix", "draft_model")
MAX_SPECULATIVE_TOKENS = 16
DEFAULT_PROMPT_LOOKUP = 5  # vLLM's prompt_lookup_min and _max when neither is given
# suffix decoding's max tree depth, cached requests, max spec factor, min token probability and cached tokens when
# not given
DEFAULT_SUFFIX = (8, 10_000, 1.0, 0.1, 200_000)
# Their fields, in that order: named as the agent's --speculative-config keys, so agent_config renders them as they are
SUFFIX_FIELDS = ("suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests",
                 "suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob",
                 "suffix_decoding_max_cached_tokens")
# Where the agent container finds the checkpoints: the target's volume at /models/<spec.model.name> (builders.py),
# the draft's at /draft-models/<spec.model.name>; distinct roots, so neither mount can hide the other.
TARGET_MODELS_DIR, DRAFT_MODELS_DIR = "/models", "/draft-models"

_SC = "spec.runtime.speculativeConfig"
DRAFT_SOURCE_RULES = source_rules(f"{_SC}.draftModel.source")
DRAFT_MODEL_REQUIRED_RULE = Rule("self.method != 'draft_model' || has(self.draftModel)",
                                 f"{_SC}.draftModel is required when method is draft_model: give the draft "
                                 "checkpoint's source (pvc, hostPath or image; a small model sharing the target's "
                                 "tokenizer), or use method ngram or suffix, which need no model")
DRAFT_MODEL_UNUSED_RULE = Rule("self.method == 'draft_model' || !has(self.draftModel)",
                               f"{_SC}.draftModel is set but method is not draft_model (ngram and suffix use no "
                               "model): remove draftModel, or set method to draft_model", ".draftModel")
PROMPT_LOOKUP_METHOD_RULE = Rule("self.method == 'ngram' || (!has(self.promptLookupMin) && "
                                 "!has(self.promptLookupMax))",
                                 f"{_SC}.promptLookupMin and promptLookupMax apply to method ngram only: remove them, "
                                 "or set method to ngram")
PROMPT_LOOKUP_ORDER_RULE = Rule("!has(self.promptLookupMin) || !has(self.promptLookupMax) || "
                                "self.promptLookupMin <= self.promptLookupMax",
                                f"{_SC}.promptLookupMin must be <= promptLookupMax: swap them, or give one alone "
                                "(it sets the other, as in vLLM)", ".promptLookupMin")
SUFFIX_METHOD_RULE = Rule("self.method == 'suffix' || (!has(self.suffixDecodingMaxTreeDepth) && "
                          "!has(self.suffixDecodingMaxCachedRequests) && !has(self.suffixDecodingMaxSpecFactor) && "
                          "!has(self.suffixDecodingMinTokenProb) && !has(self.suffixDecodingMaxCachedTokens))",
                          f"{_SC}.suffixDecoding* fields apply to method suffix only: remove them, or set method to "
                          "suffix")
# On InferenceDeploymentSpec, which sees both sources: an image path inside the other model's mount would be hidden.
_DRAFT = "has(self.runtime) && has(self.runtime.speculativeConfig) && has(self.runtime.speculativeConfig.draftModel)"
_DRAFT_SOURCE = "self.runtime.speculativeConfig.draftModel.source"
DRAFT_IMAGE_MOUNT_RULE = Rule(
    f"!({_DRAFT} && has({_DRAFT_SOURCE}.image) && !has(self.model.source.image)) || "
    f"!({_DRAFT_SOURCE}.image.path + '/').startsWith('{TARGET_MODELS_DIR}/' + self.model.name + '/')",
    f"{_SC}.draftModel.source.image.path must not lie inside {TARGET_MODELS_DIR}/<spec.model.name>, where the "
    "target model's volume is mounted over it: keep the draft elsewhere in the image, e.g. /opt/models/draft",
    ".runtime.speculativeConfig.draftModel.source.image.path")
TARGET_IMAGE_MOUNT_RULE = Rule(
    f"!({_DRAFT} && !has({_DRAFT_SOURCE}.image) && has(self.model.source.image)) || "
    f"!(self.model.source.image.path + '/').startsWith('{DRAFT_MODELS_DIR}/' + self.model.name + '/')",
    f"spec.model.source.image.path must not lie inside {DRAFT_MODELS_DIR}/<spec.model.name>, where the draft "
    f"model's volume ({_SC}.draftModel) is mounted over it: keep the model elsewhere in the image, e.g. "
    "/opt/models/tiny", ".model.source.image.path")
RULES = (*DRAFT_SOURCE_RULES.all(), DRAFT_MODEL_REQUIRED_RULE, DRAFT_MODEL_UNUSED_RULE, PROMPT_LOOKUP_METHOD_RULE,
         PROMPT_LOOKUP_ORDER_RULE, SUFFIX_METHOD_RULE, DRAFT_IMAGE_MOUNT_RULE, TARGET_IMAGE_MOUNT_RULE)


class DraftPvcSource(PvcSource):
    """The draft model's directory on a PersistentVolumeClaim, mounted read-only."""

    rules: ClassVar[SourceRules] = DRAFT_SOURCE_RULES
    model_config = ConfigDict(json_schema_extra=cel(DRAFT_SOURCE_RULES.sub_path))


class DraftHostPathSource(HostPathSource):
    """The draft model's directory on every node (a hostPath volume of type Directory), mounted read-only; the
    same system directories as for spec.model.source.hostPath are refused."""

    rules: ClassVar[SourceRules] = DRAFT_SOURCE_RULES
    model_config = ConfigDict(json_schema_extra=cel(DRAFT_SOURCE_RULES.host_path, DRAFT_SOURCE_RULES.host_path_system))


class DraftImageSource(ImageSource):
    """The draft model's directory baked into the agent image."""

    rules: ClassVar[SourceRules] = DRAFT_SOURCE_RULES
    model_config = ConfigDict(json_schema_extra=cel(DRAFT_SOURCE_RULES.image_path))


class DraftModelSource(ModelSource):
    """Where the draft checkpoint directory comes from, as spec.model.source: exactly one of pvc, hostPath or
    image."""

    rules: ClassVar[SourceRules] = DRAFT_SOURCE_RULES
    model_config = ConfigDict(json_schema_extra=cel(DRAFT_SOURCE_RULES.source))
    pvc: DraftPvcSource | None = None
    """A PersistentVolumeClaim holding the draft checkpoint, mounted at /draft-models/<spec.model.name>."""
    host_path: DraftHostPathSource | None = None
    """A directory present on every GPU node, mounted at /draft-models/<spec.model.name>."""
    image: DraftImageSource | None = None
    """A directory inside the agent image, read where it is (nothing is mounted)."""


class DraftModelSpec(SpecModel):
    """The draft model of method draft_model."""

    source: DraftModelSource
    """Where its checkpoint comes from: a small model with the target's tokenizer and vocabulary (e.g. Llama 3.2 1B
    for Llama 3.1 70B). It runs unsharded on tensor-parallel rank 0, whatever spec.runtime.tensorParallelSize."""


class SpeculativeConfigSpec(SpecModel):
    """Speculative decoding, as vLLM's --speculative-config: a proposer guesses up to numSpeculativeTokens tokens a
    step, which the model verifies in one pass (greedy outputs are unchanged; sampled ones keep their distribution)."""

    model_config = ConfigDict(json_schema_extra=cel(DRAFT_MODEL_REQUIRED_RULE, DRAFT_MODEL_UNUSED_RULE,
                                                    PROMPT_LOOKUP_METHOD_RULE, PROMPT_LOOKUP_ORDER_RULE,
                                                    SUFFIX_METHOD_RULE))
    method: Literal["ngram", "suffix", "draft_model"]
    """ngram: prompt lookup, drafts copied from where the last tokens occurred before in the prompt or output (no
    extra model; good for summaries, code edits, RAG); suffix: the same lookup also over earlier requests' outputs,
    each continuation by how often it followed (no extra model; good for agents and repeated tasks); draft_model: a
    small model's greedy guesses (draftModel)."""
    num_speculative_tokens: int = Field(ge=1, le=MAX_SPECULATIVE_TOKENS)
    """Most draft tokens a request verifies per step (3 to 5 is typical)."""
    prompt_lookup_min: int | None = Field(default=None, ge=1, le=1024)
    """ngram only: the shortest n-gram matched (default: promptLookupMax if given, else 5, as vLLM)."""
    prompt_lookup_max: int | None = Field(default=None, ge=1, le=1024)
    """ngram only: the longest n-gram matched (default: promptLookupMin if given, else 5, as vLLM)."""
    suffix_decoding_max_tree_depth: int | None = Field(default=None, ge=1, le=64)
    """suffix only: the longest context matched (default 8)."""
    suffix_decoding_max_cached_requests: int | None = Field(default=None, ge=0, le=1000000)
    """suffix only: finished requests' outputs kept for later ones, oldest evicted first; 0 keeps none (default
    10000)."""
    suffix_decoding_max_spec_factor: float | None = Field(default=None, ge=0.0, le=64.0)
    """suffix only: a match of n tokens proposes at most this times n (default 1.0)."""
    suffix_decoding_min_token_prob: float | None = Field(default=None, ge=0.0, le=1.0)
    """suffix only: stop proposing where the continuation's estimated probability falls below this (default 0.1)."""
    suffix_decoding_max_cached_tokens: int | None = Field(default=None, ge=0, le=100000000)
    """suffix only: the tokens of finished outputs kept, oldest evicted first (default 200000: some 50 MB on typical
    outputs, up to 700 MB where nothing repeats)."""
    disable_by_batch_size: int | None = Field(default=None, ge=1, le=1000000)
    """No speculation while this many decodes or more are running (default: speculate at any batch size)."""
    adaptive: bool = True
    """Let the agent pick each step's draft length from measured acceptance and step cost, down to none when
    speculation does not pay; false always drafts numSpeculativeTokens."""
    draft_model: DraftModelSpec | None = None
    """The draft checkpoint: required with method draft_model, refused with ngram and suffix."""

    @model_validator(mode="after")
    def _rules(self) -> SpeculativeConfigSpec:
        check(self.method != "draft_model" or self.draft_model is not None, DRAFT_MODEL_REQUIRED_RULE)
        check(self.method == "draft_model" or self.draft_model is None, DRAFT_MODEL_UNUSED_RULE)
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        check(self.method == "ngram" or (lo is None and hi is None), PROMPT_LOOKUP_METHOD_RULE)
        check(lo is None or hi is None or lo <= hi, PROMPT_LOOKUP_ORDER_RULE)
        check(self.method == "suffix" or self._suffix_given() == (None,) * len(SUFFIX_FIELDS), SUFFIX_METHOD_RULE)
        return self

    def _suffix_given(self) -> tuple[int | float | None, ...]:
        return tuple(getattr(self, name) for name in SUFFIX_FIELDS)

    def prompt_lookup(self) -> tuple[int, int]:
        """The n-gram bounds in force: one given sets the other; neither, vLLM's 5 and 5."""
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        return (lo or hi or DEFAULT_PROMPT_LOOKUP), (hi or lo or DEFAULT_PROMPT_LOOKUP)

    def agent_config(self, draft_dir: str | None) -> dict[str, Any]:
        """The --speculative-config object (vLLM's snake_case keys), every value explicit so that agent default
        changes never leak in; `draft_dir` is where the pod sees the draft checkpoint (draft_model)."""
        out: dict[str, Any] = {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens}
        if self.method == "draft_model":
            out["model"] = draft_dir
        elif self.method == "suffix":
            out |= {key: default if v is None else v
                    for key, v, default in zip(SUFFIX_FIELDS, self._suffix_given(), DEFAULT_SUFFIX, strict=True)}
        else:
            out["prompt_lookup_min"], out["prompt_lookup_max"] = self.prompt_lookup()
        if self.disable_by_batch_size is not None:
            out["disable_by_batch_size"] = self.disable_by_batch_size
        return out | {"adaptive": self.adaptive}


def inside(path: str, directory: str) -> bool:
    """`path` is `directory` or lies under it (as the mount-path rules write it in CEL)."""
    return f"{path}/".startswith(f"{directory}/")


def check_mounts(model_name: str, target: ModelSource, config: SpeculativeConfigSpec | None) -> None:
    """DRAFT_IMAGE_MOUNT_RULE and TARGET_IMAGE_MOUNT_RULE: no image path hidden under the other model's mount."""
    draft = config.draft_model.source if config is not None and config.draft_model is not None else None
    if draft is None or (draft.image is None) == (target.image is None):
        return  # no draft, both mounted (distinct roots) or both in the image (nothing mounted)
    if draft.image is not None:
        check(not inside(draft.image.path, f"{TARGET_MODELS_DIR}/{model_name}"), DRAFT_IMAGE_MOUNT_RULE)
    elif target.image is not None:
        check(not inside(target.image.path, f"{DRAFT_MODELS_DIR}/{model_name}"), TARGET_IMAGE_MOUNT_RULE)
