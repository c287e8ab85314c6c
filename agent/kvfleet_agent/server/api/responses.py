"""The response bodies, as pydantic models: the handlers' JSON is checked against them in tests and by schemathesis."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

FinishReason = Literal["stop", "length", "abort"] | None


class Response(BaseModel):
    """Responses carry exactly the fields declared."""

    model_config = ConfigDict(extra="forbid")


class Usage(Response):
    """Token counts of a response: every prompt once, every sample's completion."""

    prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(ge=0)
    total_tokens: int = Field(ge=0)


class CompletionLogprobs(Response):
    """Legacy completions logprobs: one entry per token (the first echoed prompt token's logprob is null)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(Response):
    """vLLM's prompt_logprobs entry for one token id."""

    logprob: float
    rank: int = Field(ge=1, description="1 + the vocabulary entries with a higher logprob")
    decoded_token: str


PromptLogprobs = list[dict[str, PromptLogprob] | None] | None  # per prompt token: token id → entry; null first


class CompletionChoice(Response):
    """One choice of a completion (or, streamed, its next piece)."""

    index: int = Field(ge=0)
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason = None
    prompt_logprobs: PromptLogprobs = Field(None, description="with prompt_logprobs (vLLM's shape)")


class CompletionResponse(Response):
    """/v1/completions: whole, or one streamed chunk (then usage only on the last chunk, if asked)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(Response):
    """One alternative at a chat token."""

    token: str
    logprob: float


class ChatTokenLogprob(Response):
    """A chat token's logprob and its top alternatives."""

    token: str
    logprob: float
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Response):
    """Chat logprobs: one entry per generated token."""

    content: list[ChatTokenLogprob]


class ChatMessage(Response):
    """The assistant's answer."""

    role: Literal["assistant"]
    content: str


class ChatChoice(Response):
    """One choice of a chat completion."""

    index: int = Field(ge=0)
    message: ChatMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason = None


class ChatCompletionResponse(Response):
    """/v1/chat/completions, not streamed."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    prompt_logprobs: PromptLogprobs = Field(None, description="with prompt_logprobs (vLLM's shape)")


class ChatDelta(Response):
    """A streamed piece of a choice: the role once, first, then content."""

    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(Response):
    """One choice's piece in a chat chunk."""

    index: int = Field(ge=0)
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason = None


class ChatCompletionChunk(Response):
    """One streamed chat event; the last (if include_usage) has no choices and the usage."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(Response):
    """One served model, with vLLM's extra fields."""

    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str = Field(description="the checkpoint directory the model was loaded from")
    parent: str | None = None
    max_model_len: int = Field(ge=1)


class ModelList(Response):
    """/v1/models."""

    object: Literal["list"]
    data: list[ModelCard]


class ErrorDetail(Response):
    """What went wrong, and which field (param) caused it."""

    message: str = Field(min_length=1)
    type: str
    param: str | None
    code: str | None


class ErrorResponse(Response):
    """Every error, OpenAI-style."""

    error: ErrorDetail


class TokenizeResponse(Response):
    """POST /tokenize (vLLM's shape)."""

    count: int = Field(ge=0)
    max_model_len: int = Field(ge=1)
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(Response):
    """POST /detokenize (vLLM's shape)."""

    prompt: str


class TokenizerInfoResponse(Response):
    """GET /tokenizer_info (vLLM's shape)."""

    tokenizer_class: str
    bos_token: str | None
    eos_token: str | None
    pad_token: str | None
    chat_template: str | None
    model_max_length: int = Field(ge=1)


class VersionResponse(Response):
    """GET /version."""

    version: str
