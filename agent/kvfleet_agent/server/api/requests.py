"""The request bodies of /v1/completions and /v1/chat/completions, as pydantic models."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, WithJsonSchema

from kvfleet_agent.server.api.common import MAX_N, SamplingFields, Strict
from kvfleet_agent.server.api.structured import StructuredFields
from kvfleet_agent.server.api.tools import ToolFields

# The prompt and the messages are checked by hand after validation (prompts.py-style bounds: sizes before
# contents, lone surrogates, token-id ranges); the models only carry their documented shape.
_TEXT = {"type": "string", "minLength": 1}
_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
Prompt = Annotated[Any, WithJsonSchema({
    "oneOf": [_TEXT, _TOKEN_IDS, {"type": "array", "items": _TEXT, "minItems": 1},
              {"type": "array", "items": _TOKEN_IDS, "minItems": 1}],
    "description": "text or token ids, or a list of either (one choice per prompt, times n)"})]
Messages = Annotated[Any, WithJsonSchema({
    "type": "array", "minItems": 1, "items": {"type": "object", "required": ["role"], "properties": {
        "role": {"type": "string"}, "name": {"type": "string"}, "tool_call_id": {"type": "string"},
        "tool_calls": {"type": "array", "items": {"type": "object"}},
        "content": {"oneOf": [{"type": "string"}, {"type": "null"}, {"type": "array", "items": {
            "type": "object", "required": ["type", "text"], "properties": {
                "type": {"const": "text"}, "text": {"type": "string"}}}}]}}}})]


class CompletionRequest(SamplingFields, StructuredFields):
    """POST /v1/completions."""

    prompt: Prompt
    max_tokens: int | None = Field(None, ge=0, description="default 16; 0 (only with echo) scores the prompt")
    logprobs: int | None = Field(None, ge=0, description="top alternatives per token; at most --max-logprobs")
    echo: bool | None = Field(None, description="prepend the prompt (and with logprobs, its logprobs)")
    best_of: int | None = Field(None, ge=1, le=MAX_N,
                                description="samples drawn; the n most likely (by cumulative logprob) return")


class ChatCompletionRequest(SamplingFields, StructuredFields, ToolFields):
    """POST /v1/chat/completions."""

    messages: Messages
    max_tokens: int | None = Field(None, ge=1, description="deprecated spelling of max_completion_tokens")
    max_completion_tokens: int | None = Field(None, ge=1, description="default: the rest of the context")
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, description="needs logprobs: true; at most --max-logprobs")


class TokenizeRequest(Strict):
    """POST /tokenize (vLLM): a prompt, or chat messages rendered through the chat template first."""

    model: str | None = None
    prompt: str | None = Field(None, description="text to tokenize; or give messages")
    messages: Messages | None = None
    add_special_tokens: bool | None = Field(None, description="default true: the ids generation would use (a BOS "
                                                              "the chat template already wrote is not doubled)")
    add_generation_prompt: bool | None = Field(None, description="messages only; default true")
    return_token_strs: bool | None = Field(None, description="also return each token as text")


class DetokenizeRequest(Strict):
    """POST /detokenize (vLLM)."""

    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]] = Field(max_length=1 << 20)
