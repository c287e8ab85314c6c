"""StructuredOutputs: the constraint a request's output must match (a JSON schema, any JSON object, a regex, a
choice of strings, or a Lark grammar), as plain data."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


@dataclass
class StructuredOutputs:
    """Exactly one kind of constraint, in vLLM's vocabulary (its StructuredOutputsParams).

    `compiled` is filled in by the grammar compiler (worker/grammar_compiler.py) before the request
    reaches the engine thread, so that no step ever waits on a compile; samples of one request share it.
    """

    json: dict[str, Any] | None = None  # a JSON schema
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # llguidance's Lark dialect (vLLM's guided_grammar with the guidance backend)
    json_object: bool = False  # any JSON object (response_format json_object)
    whitespace_flexible: bool = False  # JSON: allow any whitespace between tokens (default: compact separators)
    compiled: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        kinds = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        kinds += ["json_object"] if self.json_object else []
        if len(kinds) != 1:
            raise ValueError(f"StructuredOutputs needs exactly one of json, regex, choice, grammar, json_object; "
                             f"got {kinds or 'none'}")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError("StructuredOutputs.choice must be a non-empty list of strings")

    @property
    def kind(self) -> str:
        """Which constraint this is: json, regex, choice, grammar or json_object."""
        for k in ("json", "regex", "choice", "grammar"):
            if getattr(self, k) is not None:
                return k
        return "json_object"

    def key(self) -> str:
        """A canonical text of the constraint: the grammar cache's key (with the tokenizer's)."""
        value: Any = True if self.json_object else getattr(self, self.kind)
        return json.dumps([self.kind, value, self.whitespace_flexible], sort_keys=True, separators=(",", ":"))
