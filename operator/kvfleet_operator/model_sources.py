"""Where a checkpoint directory comes from (pvc, hostPath or image): spec.model.source, and a draft model's."""

from __future__ import annotations

import re
from typing import ClassVar

from pydantic import ConfigDict, Field, model_validator

from kvfleet_operator.core_types import SpecModel
from kvfleet_operator.rules import MODEL_SOURCE_RULES, SYSTEM_PARENTS, SYSTEM_SUBTREES, SourceRules, cel, check


def clean_path(path: str) -> bool:
    """No '..' segment."""
    return "/../" not in f"/{path}/"


def host_path_is_clean(path: str) -> bool:
    """The host-path rule: absolute, without '.', '..' or empty segments ("/" passes: see host_path_is_system)."""
    return path == "/" or (re.fullmatch(r"(/[^/]+)+/?", path) is not None and clean_path(path)
                           and "/./" not in f"{path}/")


def host_path_is_system(path: str) -> bool:
    """The system-directory rule: the node's root or a system directory (the path as written: see HostPathSource)."""
    return (path in SYSTEM_PARENTS or path in {f"{p}/" for p in SYSTEM_PARENTS[1:]}
            or any(f"{path}/".startswith(f"{d}/") for d in SYSTEM_SUBTREES))


# Each class checks the rules of its `rules`; a subclass for another field (the draft model's source) sets its own
# there and in model_config, so that both the apiserver and pydantic name the field the user wrote.
class PvcSource(SpecModel):
    """The model directory on a PersistentVolumeClaim, mounted read-only."""

    rules: ClassVar[SourceRules] = MODEL_SOURCE_RULES
    model_config = ConfigDict(json_schema_extra=cel(MODEL_SOURCE_RULES.sub_path))
    claim_name: str = Field(min_length=1, max_length=253)
    """Name of the PersistentVolumeClaim in the same namespace."""
    path: str = Field(default="", max_length=4096)
    """Sub-path of the model directory inside the claim ("" for its root)."""

    @model_validator(mode="after")
    def _sub_path(self) -> PvcSource:
        check(not self.path.startswith("/") and clean_path(self.path), self.rules.sub_path)
        return self


class HostPathSource(SpecModel):
    """The model directory on every node (a hostPath volume of type Directory), mounted read-only. The path may
    not be the node's root or a system directory (/etc, /proc, /sys, /dev, /run, /usr, /var/lib/kubelet, ...); it
    is checked as written, so a symlink on the node pointing into one is the node administrator's to avoid."""

    rules: ClassVar[SourceRules] = MODEL_SOURCE_RULES
    model_config = ConfigDict(json_schema_extra=cel(MODEL_SOURCE_RULES.host_path, MODEL_SOURCE_RULES.host_path_system))
    path: str = Field(min_length=1, max_length=4096)
    """Absolute path of the model directory on the node, e.g. /data/models/llama-3-8b."""

    @model_validator(mode="after")
    def _absolute(self) -> HostPathSource:
        check(host_path_is_clean(self.path), self.rules.host_path)
        check(not host_path_is_system(self.path), self.rules.host_path_system)
        return self


class ImageSource(SpecModel):
    """The model directory baked into the agent image."""

    rules: ClassVar[SourceRules] = MODEL_SOURCE_RULES
    model_config = ConfigDict(json_schema_extra=cel(MODEL_SOURCE_RULES.image_path))
    path: str = Field(min_length=1, max_length=4096)
    """Absolute path of the model directory inside the agent image."""

    @model_validator(mode="after")
    def _absolute(self) -> ImageSource:
        check(self.path.startswith("/") and clean_path(self.path), self.rules.image_path)
        return self


class ModelSource(SpecModel):
    """Where the Hugging Face checkpoint directory comes from: exactly one of pvc, hostPath or image."""

    rules: ClassVar[SourceRules] = MODEL_SOURCE_RULES
    model_config = ConfigDict(json_schema_extra=cel(MODEL_SOURCE_RULES.source))
    pvc: PvcSource | None = None
    """A PersistentVolumeClaim holding the checkpoint (the usual choice)."""
    host_path: HostPathSource | None = None
    """A directory present on every GPU node."""
    image: ImageSource | None = None
    """A directory inside the agent image."""

    @model_validator(mode="after")
    def _exactly_one(self) -> ModelSource:
        check(sum(s is not None for s in (self.pvc, self.host_path, self.image)) == 1, self.rules.source)
        return self
