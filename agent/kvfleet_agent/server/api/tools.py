"""Tool-calling request fields: tools, tool_choice, parallel_tool_calls → a ToolPlan and, when forced, a grammar."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field

from kvfleet_agent.server.api.common import APIError, Strict
from kvfleet_agent.structured_outputs import StructuredOutputs

MAX_TOOLS = 128  # OpenAI's limit
_OBJECT = {"type": "object"}


class FunctionDef(Strict):
    """A tool's function: its name, what it does, and the JSON schema of its arguments."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="JSON schema of the arguments object")
    strict: bool | None = Field(None, description="forced calls (required, named) always follow the schema")


class Tool(Strict):
    """One entry of tools."""

    type: Literal["function"]
    function: FunctionDef


class NamedFunction(Strict):
    """tool_choice.function."""

    name: str


class NamedToolChoice(Strict):
    """tool_choice naming the function to call."""

    type: Literal["function"]
    function: NamedFunction


class ToolFields(Strict):
    """The tool-calling fields of a chat request."""

    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="default: auto with tools, none without")
    parallel_tool_calls: bool | None = Field(None, description="default true: required may return several calls")


Family = Literal["hermes", "llama3_json"]  # the tool-call syntaxes parsed in auto mode


@dataclass
class ToolPlan:
    """How a chat request's output becomes tool calls: parsed from the model's syntax (auto), or forced."""

    mode: Literal["auto", "required", "named"]
    named: str | None = None  # mode named: the function; the output is its arguments object
    family: Family = "hermes"  # set from the model's chat template by the server


def tools_of(r: ToolFields) -> tuple[list[dict[str, Any]] | None, ToolPlan | None, StructuredOutputs | None]:
    """Tools for the chat template (OpenAI's shape), the plan for the output, and the grammar that forces a call."""
    choice = r.tool_choice
    if not r.tools:
        if choice is not None and choice != "none":
            raise APIError("'tool_choice' needs 'tools': add the tools the model may call, or remove tool_choice",
                           "tool_choice")
        return None, None, None
    tools = [t.model_dump(exclude_none=True) for t in r.tools]
    names = [t.function.name for t in r.tools]
    if len(set(names)) != len(names):
        raise APIError("'tools' names a function twice: give each function once", "tools")
    params = {t.function.name: t.function.parameters or _OBJECT for t in r.tools}
    if choice is None or choice == "auto":
        return tools, ToolPlan("auto"), None
    if choice == "none":
        return tools, None, None
    if choice == "required":
        variants = [{"type": "object", "properties": {"name": {"const": n}, "parameters": p},
                     "required": ["name", "parameters"], "additionalProperties": False} for n, p in params.items()]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": variants}}
        if r.parallel_tool_calls is False:
            schema["maxItems"] = 1
        return tools, ToolPlan("required"), StructuredOutputs(json=schema)
    assert isinstance(choice, NamedToolChoice)
    name = choice.function.name
    if name not in params:
        raise APIError(f"'tool_choice.function.name' is {name!r}, which names no function in 'tools' (they are "
                       f"{', '.join(names)}): name one of them", "tool_choice.function.name")
    return tools, ToolPlan("named", name), StructuredOutputs(json=params[name])
