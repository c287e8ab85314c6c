"""Structured-output request fields (response_format, vLLM's structured_outputs and guided_*) → StructuredOutputs."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field

from kvfleet_agent.server.api.common import APIError, Strict
from kvfleet_agent.structured_outputs import StructuredOutputs

MAX_CHOICES = 1024


class JSONSchemaFormat(Strict):
    """response_format.json_schema (OpenAI)."""

    name: str = Field(max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="the JSON schema the output follows")
    strict: bool | None = Field(None, description="always enforced: the output is masked to the schema")


class ResponseFormat(Strict):
    """response_format: text (no constraint), json_object, or json_schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputsField(Strict):
    """vLLM's structured_outputs: exactly one of json, regex, choice, grammar, json_object."""

    json_: dict[str, Any] | str | None = Field(None, alias="json", description="a JSON schema (object or text)")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1, max_length=MAX_CHOICES)
    grammar: str | None = Field(None, description="a Lark grammar (llguidance's dialect)")
    json_object: bool | None = None
    whitespace_pattern: None = Field(None, description="not supported: JSON is compact unless the schema says")
    disable_any_whitespace: bool | None = Field(None, description="default true here: compact JSON")


class StructuredFields(Strict):
    """The structured-output fields completions and chat share."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, min_length=1, max_length=MAX_CHOICES)
    guided_grammar: str | None = None


def structured_of(r: StructuredFields) -> tuple[StructuredOutputs | None, str | None]:
    """The request's constraint and the field that set it (for errors); at most one field may set one."""
    found: list[tuple[str, StructuredOutputs]] = []
    rf = r.response_format
    if rf is not None and rf.type == "json_object":
        found.append(("response_format", StructuredOutputs(json_object=True)))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise APIError("'response_format.json_schema.schema' is required with type json_schema: give the JSON "
                           "schema the output must follow", "response_format.json_schema.schema")
        found.append(("response_format", StructuredOutputs(json=rf.json_schema.schema_)))
    so = r.structured_outputs
    if so is not None:
        kinds = {k: v for k, v in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                                   ("grammar", so.grammar), ("json_object", so.json_object or None)) if v is not None}
        if len(kinds) != 1:
            raise APIError(f"'structured_outputs' needs exactly one of json, regex, choice, grammar, json_object; got "
                           f"{sorted(kinds) or 'none'}", "structured_outputs")
        (kind, value), = kinds.items()
        flexible = so.disable_any_whitespace is False
        found.append(("structured_outputs", constraint_of(kind, value, f"structured_outputs.{kind}", flexible)))
    for kind, name in (("json", "guided_json"), ("regex", "guided_regex"), ("choice", "guided_choice"),
                       ("grammar", "guided_grammar")):
        value = getattr(r, name)
        if value is not None:
            found.append((name, constraint_of(kind, value, name, False)))
    if len(found) > 1:
        names = [n for n, _ in found]
        raise APIError(f"{' and '.join(repr(n) for n in names)} both constrain the output: give only one", names[1])
    return (found[0][1], found[0][0]) if found else (None, None)


def constraint_of(kind: str, value: Any, name: str, flexible: bool) -> StructuredOutputs:
    """One constraint's StructuredOutputs (a schema as JSON text parsed), checked; errors name the field `name`."""
    if kind == "json" and isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise APIError(f"'{name}' is not valid JSON ({e}): give the schema as an object or JSON text",
                           name) from None
        if not isinstance(value, dict):
            raise APIError(f"'{name}' must be a JSON schema object", name)
    if kind == "choice" and "" in value:
        raise APIError(f"'{name}' holds an empty string: every choice needs at least one character", name)
    if kind in ("regex", "grammar") and not value:
        raise APIError(f"'{name}' is empty: give a {kind}", name)
    if kind == "json_object":
        return StructuredOutputs(json_object=True, whitespace_flexible=flexible)
    return StructuredOutputs(**{kind: value}, whitespace_flexible=flexible)
