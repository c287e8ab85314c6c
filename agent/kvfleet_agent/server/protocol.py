"""OpenAI request parsing into a GenerateRequest (through the pydantic models of api/), every error naming its field.

Unknown fields are refused with a 400 naming them (not accepted and logged): a client that sends a
sampling parameter kvfleet does not know must learn that it had no effect. Fields vLLM or OpenAI
define that kvfleet does not implement yet are refused by name with the reason (api/common.py REFUSED),
unless set to a value that changes nothing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

from kvfleet_agent.sampling_params import SamplingParams
from kvfleet_agent.server.api.common import (
    DEFAULT_MAX_LOGPROBS,
    MAX_STOP_TOKEN_IDS,
    APIError,
    json_type,
    refuse_unsupported,
    validate,
)
from kvfleet_agent.server.api.inputs import check_text, messages_of, prompts_of, shown
from kvfleet_agent.server.api.render import choice, envelope, new_id, usage
from kvfleet_agent.server.api.requests import ChatCompletionRequest, CompletionRequest
from kvfleet_agent.server.api.structured import structured_of
from kvfleet_agent.server.api.tools import ToolPlan, tools_of
from kvfleet_agent.server.request_defaults import RequestDefaults

__all__ = ["MAX_STOP_TOKEN_IDS", "APIError", "GenerateRequest", "check_text", "choice", "envelope", "new_id",
           "parse", "usage"]


@dataclass
class GenerateRequest:
    """A parsed completion or chat request: prompts, how to sample them, and how many samples of each."""

    prompts: list[str | list[int]]
    params: SamplingParams
    stream: bool
    include_usage: bool
    chat: bool
    created: int = field(default_factory=lambda: int(time.time()))  # one timestamp for every chunk
    # The field that set max_tokens as the client spelled it, None when defaulted: errors name it.
    max_tokens_field: str | None = None
    n: int = 1  # choices returned per prompt
    best_of: int = 1  # samples drawn per prompt (>= n); the n most likely are returned
    logprobs_asked: bool = False  # False when logprobs are computed only to rank best_of samples
    echo: bool = False  # completions: the prompt (and with logprobs, its logprobs) leads each choice
    prompt_only: bool = False  # max_tokens 0 with echo: run for one token (the engine needs one), return none
    continuous_usage: bool = False  # streamed: usage so far in every chunk (vLLM's continuous_usage_stats)
    structured_field: str | None = None  # the field that constrained the output (params.structured_outputs)
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs as asked (params' may be raised by echo's logprobs)
    tools: list[dict[str, Any]] | None = None  # for the chat template
    tool_plan: ToolPlan | None = None  # how the output becomes tool calls

    @property
    def prompt_field(self) -> str:
        """The field that carried the prompt, for error messages."""
        return "messages" if self.chat else "prompt"

    def sample_params(self, i: int) -> SamplingParams:
        """Sample i's parameters: its own seed (seed + i, as vLLM), so samples are distinct and reproducible."""
        if self.best_of == 1 or self.params.seed is None:
            return self.params
        return replace(self.params, seed=(self.params.seed + i) % 2**64)


def parse(body: Any, served_model: str, chat: bool, max_model_len: int, max_prompts: int | None = None, *,
          max_logprobs: int = DEFAULT_MAX_LOGPROBS, vocab_size: int | None = None,
          defaults: RequestDefaults | None = None) -> tuple[GenerateRequest, list[dict[str, Any]] | None]:
    """Validate a /v1/completions or /v1/chat/completions body; returns the request and chat messages.

    max_tokens defaults to 16 for completions (as OpenAI) and, for chat, to the rest of the context.
    Only what the body alone decides is checked here: prompt lengths in tokens are checked once
    tokenized (prompts.py). Sizes are checked before contents, so a huge list is refused in O(1).
    defaults: --generation-config's values for the sampling fields the body omits, and its max_tokens cap.
    """
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise APIError(f"'model' must be a string, got {json_type(model)}", "model")
    if model is not None and model != served_model:
        raise APIError(f"The model {shown(model)} does not exist; this server serves '{served_model}'", "model",
                       status=404, code="model_not_found")
    fields = refuse_unsupported(body)
    for name in ("tools", "tool_choice", "parallel_tool_calls") if not chat else ():
        if name in fields:
            raise APIError(f"'{name}': tool calling needs chat messages, so it applies to /v1/chat/completions "
                           "only: use that endpoint, or remove it", name)
    messages = None
    r: Any
    if chat:
        raw = fields.get("messages")
        if isinstance(raw, list) and len(raw) >= max_model_len:  # every message takes a token of the context
            raise APIError(f"'messages' has {len(raw)} messages; at most {max_model_len - 1} fit in this model's "
                           f"context (max_model_len={max_model_len} tokens)", "messages")
        r = validate(ChatCompletionRequest, fields)
        messages = messages_of(r.messages)
        prompts: list[str | list[int]] = []
    else:
        r = validate(CompletionRequest, fields)
        prompts = prompts_of(r.prompt, max_model_len, max_prompts)
    n = r.n or 1
    best_of = (None if chat else r.best_of) or n
    if best_of < n:
        raise APIError(f"'best_of'={best_of} is below 'n'={n}: best_of samples are drawn to return n", "best_of")
    stream = bool(r.stream)
    if stream and best_of > n:
        raise APIError("'best_of' above 'n' cannot stream: the best samples are known only at the end", "best_of")
    echo = not chat and bool(r.echo)
    if stream and r.prompt_logprobs is not None:  # as vLLM: they would all come before the first token
        raise APIError("'prompt_logprobs' cannot be used with stream: drop one of them", "prompt_logprobs")
    params, max_tokens_field, asked = _sampling(r, chat, max_model_len, max_logprobs, vocab_size, echo,
                                                defaults or RequestDefaults())
    if best_of > n and params.logprobs is None:
        params = replace(params, logprobs=0)  # ranking the samples needs each token's logprob
    wants_usage = r.stream_options.include_usage if r.stream_options is not None else None
    include_usage = bool(wants_usage) if stream else True
    continuous = stream and r.stream_options is not None and bool(r.stream_options.continuous_usage_stats)
    structured, structured_field = structured_of(r)
    tools, plan, forced = tools_of(r) if chat else (None, None, None)
    if forced is not None:
        if structured is not None:
            raise APIError(f"'tool_choice' {r.tool_choice if isinstance(r.tool_choice, str) else 'naming a tool'} "
                           f"forces a tool call, which cannot also follow '{structured_field}': drop one of them",
                           structured_field)
        structured, structured_field = forced, "tool_choice"
    if structured is not None:
        if echo:
            raise APIError(f"'echo' cannot be used with '{structured_field}': the prompt does not follow it", "echo")
        # Both fight the grammar: past a complete value only EOS is allowed, so ignore_eos would leave no token to
        # sample, and min_tokens can forbid the only tokens the grammar still allows.
        if params.ignore_eos:
            raise APIError(f"'ignore_eos' cannot be used with '{structured_field}': the output ends where the "
                           "grammar does; drop ignore_eos", "ignore_eos")
        if params.min_tokens:
            raise APIError(f"'min_tokens' cannot be used with '{structured_field}': the grammar decides the "
                           "length; drop min_tokens", "min_tokens")
        params = replace(params, structured_outputs=structured)
    return GenerateRequest(prompts, params, stream, include_usage, chat, max_tokens_field=max_tokens_field,
                           n=n, best_of=best_of, logprobs_asked=asked, echo=echo,
                           prompt_only=echo and r.max_tokens == 0, continuous_usage=continuous,
                           structured_field=structured_field, tools=tools, tool_plan=plan,
                           prompt_logprobs=r.prompt_logprobs), messages


def _sampling(r: Any, chat: bool, max_model_len: int, max_logprobs: int, vocab_size: int | None, echo: bool,
              defaults: RequestDefaults) -> tuple[SamplingParams, str | None, bool]:
    """SamplingParams, the field (as the client spelled it) that set max_tokens, and whether logprobs were asked."""
    # SamplingParams names its own fields; the client may have used OpenAI's other names for them.
    spelled = {"max_tokens": "max_tokens", "logprobs": "top_logprobs" if chat else "logprobs"}
    max_tokens = r.max_completion_tokens if chat else None
    if max_tokens is not None:
        spelled["max_tokens"] = "max_completion_tokens"
    else:
        max_tokens = r.max_tokens
    max_tokens_field = spelled["max_tokens"] if max_tokens is not None else None
    if max_tokens is None:
        max_tokens = max_model_len if chat else 16
    if max_tokens == 0 and not echo:
        raise APIError("'max_tokens'=0 generates nothing: ask for at least 1 token, or set echo: true to score "
                       "the prompt", "max_tokens")
    max_tokens = max_tokens or 1  # echo with 0: one token is generated and dropped (the engine needs one)
    stop = [r.stop] if isinstance(r.stop, str) else (r.stop or [])
    for s in stop:
        check_text(s, "stop")
    logprobs: int | None
    if chat:
        if r.top_logprobs is not None and not r.logprobs:
            raise APIError("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        logprobs = (r.top_logprobs or 0) if r.logprobs else None
    else:
        logprobs = r.logprobs
    for name, k in ((spelled["logprobs"], logprobs), ("prompt_logprobs", r.prompt_logprobs)):
        if k is not None and k > max_logprobs:
            raise APIError(f"'{name}'={k} is above this server's limit of {max_logprobs} (--max-logprobs): "
                           "ask for fewer", name)
    # Echo with logprobs scores the prompt too: one computation serves both, with the larger k (echo trims).
    asked_prompt = [k for k in (logprobs if echo else None, r.prompt_logprobs) if k is not None]
    given = defaults.omitted({"temperature": r.temperature, "top_p": r.top_p, "top_k": r.top_k, "min_p": r.min_p,
                              "repetition_penalty": r.repetition_penalty})
    try:
        params = SamplingParams(
            max_tokens=max_tokens, temperature=given.get("temperature", 1.0), top_p=given.get("top_p", 1.0),
            top_k=given.get("top_k", 0), seed=r.seed, stop=stop, stop_token_ids=r.stop_token_ids or [],
            ignore_eos=bool(r.ignore_eos), include_stop_str_in_output=bool(r.include_stop_str_in_output),
            logprobs=logprobs, skip_special_tokens=_or(r.skip_special_tokens, True),
            prompt_logprobs=max(asked_prompt) if asked_prompt else None,
            presence_penalty=_or(r.presence_penalty, 0.0), frequency_penalty=_or(r.frequency_penalty, 0.0),
            repetition_penalty=given.get("repetition_penalty", 1.0), min_p=given.get("min_p", 0.0),
            logit_bias=_logit_bias(r.logit_bias, vocab_size), min_tokens=_or(r.min_tokens, 0))
    except ValueError as e:  # SamplingParams names the field as SamplingParams.<name>=<value> is invalid: ...
        internal, rest = str(e).removeprefix("SamplingParams.").split("=", 1)
        name = spelled.get(internal, internal)
        raise APIError(f"'{name}'={rest}", name) from None
    params = defaults.cap(params)
    if params.min_tokens > params.max_tokens:
        raise APIError(f"'min_tokens'={params.min_tokens} is above max_tokens={params.max_tokens}: lower it",
                       "min_tokens")
    return params, max_tokens_field, logprobs is not None


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


def _logit_bias(bias: dict[str, float] | None, vocab_size: int | None) -> dict[int, float]:
    out = {}
    for key, value in (bias or {}).items():
        if not key.isascii() or not key.isdigit() or len(key) > 12 or \
                (vocab_size is not None and int(key) >= vocab_size):
            limit = f" below {vocab_size} (the vocabulary size)" if vocab_size is not None else ""
            raise APIError(f"'logit_bias' key {shown(key)} is not a token id: use token ids as strings, "
                           f"non-negative{limit}", "logit_bias")
        if not -100.0 <= value <= 100.0:
            raise APIError(f"'logit_bias'[{key!r}]={value} is invalid: use a bias from -100 to 100", "logit_bias")
        out[int(key)] = float(value)
    return out
