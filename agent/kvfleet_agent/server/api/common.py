"""Shared request fields, the refused-field table, and pydantic errors turned into field-named API errors."""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvfleet_agent.sampling_params import MAX_STOP_STRINGS

MAX_STOP_TOKEN_IDS = 1024  # a list this long is a mistake; a far longer one would only cost time to check
MAX_LOGIT_BIAS = 1024  # entries of logit_bias: OpenAI allows 300; vLLM no limit; each costs a scatter
DEFAULT_MAX_LOGPROBS = 20  # vLLM's default --max-logprobs
MAX_N = 64  # samples per prompt (n, best_of); admission also counts every sample against the queue


_StopText = Annotated[str, Field(min_length=1)]
_TokenKey = Annotated[str, Field(pattern=r"^[0-9]{1,12}$")]
_Bias = Annotated[float, Field(ge=-100, le=100)]


class APIError(Exception):
    """An error the client caused (or a refusal), rendered as an OpenAI-style error body."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type_: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type_, code

    def body(self) -> dict[str, Any]:
        """The JSON error object."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class Strict(BaseModel):
    """JSON types as sent (no "8" for 8, no true for 1) and no field this API does not define."""

    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(Strict):
    """OpenAI's stream_options."""

    include_usage: bool | None = None
    continuous_usage_stats: bool | None = Field(None, description="vLLM: usage so far in every chunk")


class SamplingFields(Strict):
    """The fields completions and chat share: sampling, stopping, streaming (null always means the default)."""

    model: str | None = None
    temperature: float | None = Field(None, ge=0, le=100, description="0 is greedy")
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, description="0 or -1 disables")
    min_p: float | None = Field(None, ge=0, le=1, description="drop tokens below min_p times the top probability")
    seed: int | None = Field(None, ge=-(2**63), lt=2**64, description="sample i of n uses seed + i")
    n: int | None = Field(None, ge=1, le=MAX_N, description="samples per prompt, sharing its KV blocks")
    stop: _StopText | Annotated[list[_StopText], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    include_stop_str_in_output: bool | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = Field(None, ge=0, description="EOS and stop tokens are masked until this many")
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=100, description="1 disables; over prompt and output")
    logit_bias: dict[_TokenKey, _Bias] | None = Field(None, max_length=MAX_LOGIT_BIAS,
                                                description="token id (as a string) → bias in [-100, 100]")
    skip_special_tokens: bool | None = None
    prompt_logprobs: int | None = Field(None, ge=0, description="vLLM: the prompt tokens' logprobs with this many "
                                        "alternatives; at most --max-logprobs; not with stream")
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, description="an end-user id, as in OpenAI's API: not used")


# Fields vLLM's or OpenAI's servers accept that kvfleet does not implement (yet): accepted only at a value
# that changes nothing, refused by name otherwise. Anything else unknown is refused by the models.
REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {
    "guided_decoding_backend": (("auto", "guidance", "llguidance"),
                                "the grammar backend is always llguidance: remove guided_decoding_backend"),
    "guided_whitespace_pattern": ((), "guided_whitespace_pattern is not supported: JSON is compact"),
    "functions": (([],), "the deprecated 'functions' is not supported: use 'tools'"),
    "function_call": (("none",), "the deprecated 'function_call' is not supported: use 'tool_choice'"),
    "suffix": (("",), "suffix (insertion) is not supported: remove it"),
    "use_beam_search": ((False,), "beam search is not supported: use n or best_of"),
    "length_penalty": ((1, 1.0), "length_penalty only applies to beam search, which is not supported"),
    "truncate_prompt_tokens": ((), "prompts are never truncated: shorten the prompt instead"),
    "allowed_token_ids": ((), "allowed_token_ids is not supported: use logit_bias"),
    "bad_words": (([],), "bad_words is not supported: use logit_bias with -100"),
    "logits_processors": ((), "custom logits processors are not supported"),
    "return_tokens_as_token_ids": ((False,), "return_tokens_as_token_ids is not supported"),
    "return_token_ids": ((False,), "return_token_ids is not supported"),
    "spaces_between_special_tokens": ((True,), "special tokens are always decoded with spaces between them"),
    "add_special_tokens": ((), "add_special_tokens is not supported: send token ids for full control"),
    "priority": ((0,), "request priorities are not supported: the queue is first come, first served"),
    "request_id": ((), "request_id is not supported: the server names requests"),
    "cache_salt": ((), "cache_salt is not supported"), "kv_transfer_params": ((), "KV transfer is not supported"),
    "vllm_xargs": ((), "vllm_xargs is not supported"), "prompt_embeds": ((), "prompt_embeds is not supported"),
    "mm_processor_kwargs": ((), "multimodal input is not supported"),
    "chat_template": ((), "a per-request chat template is not supported: the model's template is used"),
    "chat_template_kwargs": (({},), "chat_template_kwargs is not supported"),
    "documents": (([],), "documents (RAG templates) are not supported"),
    "add_generation_prompt": ((True,), "add_generation_prompt is always true"),
    "continue_final_message": ((False,), "continue_final_message is not supported"),
    "reasoning_effort": ((), "reasoning_effort is not supported"),
    "include_reasoning": ((True,), "reasoning output is not separated"),
    "modalities": ((["text"],), "only text output is supported"),
    "audio": ((), "audio output is not supported"), "prediction": ((), "predicted outputs are not supported"),
    "web_search_options": ((), "web search is not supported"),
    "store": ((False,), "stored completions are not supported"), "metadata": ((), "metadata needs store"),
    "service_tier": (("auto", "default"), "service tiers are not supported"),
}


def refuse_unsupported(body: dict[str, Any]) -> dict[str, Any]:
    """Refuse a known-but-unimplemented field set to anything that would change the result; drop no-ops."""
    out = dict(body)
    for name, (no_ops, why) in REFUSED.items():
        if name not in out:
            continue
        value = out.pop(name)
        if value is not None and not any(value == v and type(value) is type(v) for v in no_ops):
            raise APIError(f"'{name}': {why}", name)
    return out


def validate(model: type[Strict], body: dict[str, Any]) -> Any:
    """model.model_validate(body), its first problem turned into a 400 naming the field and the fix."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise _api_error(e) from None


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}
# pydantic's strict type errors, said as JSON types, with what the client sent instead.
_WANTED = {"int_type": "an integer", "float_type": "a number", "bool_type": "a boolean", "string_type": "a string",
           "list_type": "a list", "dict_type": "an object", "model_type": "an object"}
_MAPS = {"logit_bias"}


def _param(loc: tuple[int | str, ...]) -> str:
    """A pydantic location as the client spells the field: messages[0].role (union members' tags dropped)."""
    out = str(loc[0])
    if out in _MAPS:  # the rest is a key the client chose, not a field
        return out
    for part in loc[1:]:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in _TYPE_TAGS or "[" in part or "-" in part:
            break  # "list[str]", "function-after[...]": which member of a union failed, not a field
        else:
            out += f".{part}"
    # An index names a field only when a field of that item follows: stop_token_ids[3] is stop_token_ids.
    return re.sub(r"(\[\d+\])+$", "", out)


def _api_error(e: ValidationError) -> APIError:
    errors = e.errors(include_url=False)
    first = errors[0]
    param = _param(first["loc"])
    if first["type"] == "missing":
        return APIError(f"'{param}' is required", param)
    if first["type"] == "extra_forbidden":
        return APIError(f"'{param}' is not a field of this API (kvfleet implements OpenAI's and vLLM's fields, and "
                        "refuses the others rather than ignore them): remove it or check its spelling", param)
    same = [err for err in errors if _param(err["loc"]) == param]
    if all(err["type"] in _WANTED for err in same):
        wanted = " or ".join(dict.fromkeys(_WANTED[err["type"]] for err in same))
        return APIError(f"'{param}' must be {wanted}, got {json_type(first['input'])}", param)
    if any(err["type"] == "string_unicode" for err in same):  # JSON allows "\ud800"; no tokenizer encodes it
        return APIError(f"'{param}' holds a lone UTF-16 surrogate, which is not valid Unicode: send well-formed "
                        "text (surrogates only in pairs)", param)
    if len(same) > 1:  # a union: say what each accepted form wanted
        wanted = "; or ".join(dict.fromkeys(str(err["msg"]) for err in same))
        return APIError(f"'{param}' has no accepted form: {wanted} (got {_shown(first['input'])})", param)
    where = "".join(f"[{part!r}]" for part in first["loc"][1:] if part != "[key]") if param in _MAPS else ""
    return APIError(f"'{param}'{where}={_shown(first['input'])} is invalid: {first['msg']}", param)


def json_type(value: Any) -> str:
    """A JSON value's type in words, for error messages."""
    return {str: "a string", int: "an integer", float: "a number", bool: "a boolean", list: "a list",
            dict: "an object", type(None): "null"}.get(type(value), type(value).__name__)


def _shown(value: Any, limit: int = 64) -> str:
    try:
        text = repr(value)
    except ValueError:  # an integer over Python's 4300-digit str() limit
        return "<a number too long to show>"
    return text if len(text) <= limit else text[:limit] + "..."
