"""kvfleet.v1 messages to and from the engine's types: a GenerateRequest's prompt and sampling, outputs as responses."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message

from kvfleet_agent.outputs import CompletionOutput, Logprob, RequestOutput
from kvfleet_agent.sampling_params import SamplingParams
from kvfleet_agent.server import kvfleet_pb2 as pb
from kvfleet_agent.server.api.common import MAX_LOGIT_BIAS, MAX_N, MAX_STOP_TOKEN_IDS, APIError
from kvfleet_agent.server.api.structured import MAX_CHOICES, constraint_of
from kvfleet_agent.server.request_defaults import RequestDefaults
from kvfleet_agent.structured_outputs import StructuredOutputs

# GenerateRequest fields declared `optional`: passed to SamplingParams only when set, so that the
# defaults (max_tokens 16, temperature 1, top_p 1, repetition_penalty 1, ...) live in SamplingParams alone.
# Unset sampling fields (temperature, top_p, top_k, min_p, repetition_penalty) take --generation-config's defaults.
_OPTIONAL_SAMPLING = ("max_tokens", "temperature", "top_p", "seed", "logprobs", "skip_special_tokens",
                      "repetition_penalty", "top_k", "min_p")
# Plain proto3 scalars whose zero is SamplingParams' "off" too.
_PLAIN_SAMPLING = ("ignore_eos", "include_stop_str_in_output", "presence_penalty", "frequency_penalty",
                   "min_tokens")


class Status(Exception):
    """Ends an RPC with a status code; raised inside a handler and sent by context.abort at its edge."""

    def __init__(self, code: grpc.StatusCode, details: str,
                 trailers: Sequence[tuple[str, str]] = ()) -> None:
        super().__init__(details)
        self.code = code
        self.details = details
        self.trailers = tuple(trailers)


def invalid(details: str) -> Status:
    """INVALID_ARGUMENT with `details`, which name the field."""
    return Status(grpc.StatusCode.INVALID_ARGUMENT, details)


class Undecodable:
    """What the lenient deserializer hands a handler for bytes that are not the request message."""

    def __init__(self, error: str) -> None:
        self.error = error


def lenient(message: type[Message]) -> Callable[[bytes], Message | Undecodable]:
    """A deserializer that never raises: gRPC would answer a raising one with UNKNOWN, not INVALID_ARGUMENT."""
    def decode(data: bytes) -> Message | Undecodable:
        try:
            return message.FromString(data)
        except DecodeError as e:  # corrupt wire format, or a string field that is not UTF-8
            return Undecodable(f"the request is not a valid {message.DESCRIPTOR.full_name} ({e}): send one "
                                "serialized with the kvfleet.v1 protobuf definitions")
    return decode


def prompt_of(request: pb.GenerateRequest, max_model_len: int) -> str | list[int]:
    """The request's prompt, text or token ids, checked for what the engine cannot see."""
    kind = request.WhichOneof("prompt")
    if kind is None:
        raise invalid("prompt is missing: set `text` or `token_ids`")
    if kind == "text":
        # Checked here because the engine cannot see it: the tokenizer may turn "" into [BOS].
        if not request.text:
            raise invalid("prompt is empty: `text` is the empty string")
        return str(request.text)
    if len(request.token_ids.ids) >= max_model_len:  # before copying them: a huge list is refused in O(1)
        raise invalid(f"prompt is too long: `token_ids` has {len(request.token_ids.ids)} tokens; this model's "
                      f"context is max_model_len={max_model_len} tokens, which must leave room for one generated "
                      "token")
    ids = [int(t) for t in request.token_ids.ids]
    if not ids:
        raise invalid("prompt is empty: `token_ids` has no ids")
    return ids


def samples_of(request: pb.GenerateRequest) -> int:
    """n: how many samples of the prompt to draw."""
    if not request.HasField("n"):
        return 1
    if not 1 <= request.n <= MAX_N:
        raise invalid(f"n={request.n} is invalid: draw from 1 to {MAX_N} samples")
    return int(request.n)


def sampling_params(request: pb.GenerateRequest, max_logprobs: int, vocab_size: int,
                    defaults: RequestDefaults | None = None) -> SamplingParams:
    """SamplingParams from the request, defaults filling the fields it leaves unset; errors name the request's field."""
    options: dict[str, Any] = (defaults or RequestDefaults()).omitted(
        {name: getattr(request, name) if request.HasField(name) else None for name in _OPTIONAL_SAMPLING})
    options |= {name: getattr(request, name) for name in _PLAIN_SAMPLING}
    if options.get("logprobs", 0) > max_logprobs:
        raise invalid(f"logprobs={options['logprobs']} is invalid: this server allows at most {max_logprobs} "
                      "(--max-logprobs)")
    # Sizes before contents: a huge list or map is refused without walking it.
    if len(request.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise invalid(f"stop_token_ids has {len(request.stop_token_ids)} ids: give at most {MAX_STOP_TOKEN_IDS}")
    if len(request.logit_bias) > MAX_LOGIT_BIAS:
        raise invalid(f"logit_bias has {len(request.logit_bias)} entries: give at most {MAX_LOGIT_BIAS}")
    outside = [t for t in request.logit_bias if t >= vocab_size]
    if outside:
        raise invalid(f"logit_bias names token id {min(outside)}, outside the vocabulary: use ids below {vocab_size}")
    try:
        params = SamplingParams(stop=list(request.stop), stop_token_ids=list(request.stop_token_ids),
                                logit_bias=dict(request.logit_bias), **options)
    except ValueError as e:  # its message names the field: "SamplingParams.top_p=0.0 is invalid: ..."
        raise invalid(str(e).removeprefix("SamplingParams.")) from None
    params = (defaults or RequestDefaults()).cap(params)
    if params.min_tokens > params.max_tokens:
        raise invalid(f"min_tokens={params.min_tokens} is above max_tokens={params.max_tokens}: lower it")
    if request.HasField("structured_outputs"):
        params = replace(params, structured_outputs=_constraint(request.structured_outputs, params))
    return params


def _constraint(so: pb.StructuredOutputs, params: SamplingParams) -> StructuredOutputs:
    """The request's StructuredOutputs, checked as HTTP's structured_outputs field is (compiled later, off the loop)."""
    kind = so.WhichOneof("kind")
    if kind is None or (kind == "json_object" and not so.json_object):
        raise invalid("structured_outputs is set but empty: set one of json_schema, regex, choice, grammar or "
                      "json_object: true, or leave it unset")
    field = f"structured_outputs.{kind}"
    # Both fight the grammar, as over HTTP: past a complete value only EOS is allowed.
    for name, conflicting in (("ignore_eos", params.ignore_eos), ("min_tokens", params.min_tokens)):
        if conflicting:
            raise invalid(f"{name} cannot be used with {field}: the grammar decides where the output ends; drop {name}")
    if kind == "choice" and not 1 <= len(so.choice.choices) <= MAX_CHOICES:
        raise invalid(f"{field} has {len(so.choice.choices)} strings: give 1 to {MAX_CHOICES}")
    value: Any = {"json_schema": so.json_schema, "regex": so.regex, "grammar": so.grammar, "json_object": True,
                  "choice": list(so.choice.choices)}[kind]
    try:
        return constraint_of("json" if kind == "json_schema" else kind, value, field, False)
    except APIError as e:
        raise invalid(e.message) from None


def _logprob(lp: Logprob) -> pb.TokenLogprob:
    top = sorted(lp.top.items(), key=lambda kv: -kv[1])  # the proto promises most likely first
    return pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob,
                           top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in top])


def _fields(c: CompletionOutput, text_from: int, tokens_from: int) -> dict[str, Any]:
    """One completion's fields, less the first text_from characters and tokens_from tokens (sent before)."""
    fields: dict[str, Any] = {"text": c.text[text_from:], "token_ids": c.token_ids[tokens_from:],
                              "finish_reason": c.finish_reason or ""}
    if c.logprobs is not None:  # one per token, so the token offset is the logprob offset
        fields["logprobs"] = [_logprob(lp) for lp in c.logprobs[tokens_from:]]
    return fields


def response(out: RequestOutput, text_from: int = 0, tokens_from: int = 0) -> pb.GenerateResponse:
    """The response (n = 1) for `out`, without the text and tokens sent before."""
    resp = pb.GenerateResponse(request_id=out.request_id, **_fields(out.outputs[0], text_from, tokens_from))
    if out.finished:
        resp.usage.prompt_tokens = len(out.prompt_token_ids)
        resp.usage.completion_tokens = len(out.outputs[0].token_ids)
    return resp


def sample(index: int, out: RequestOutput, text_from: int = 0, tokens_from: int = 0) -> pb.Sample:
    """Sample `index` of an n > 1 request, without the text and tokens sent before."""
    return pb.Sample(index=index, **_fields(out.outputs[0], text_from, tokens_from))


def set_usage(resp: pb.GenerateResponse, finals: Sequence[RequestOutput]) -> None:
    """Usage of an n > 1 request: its samples share the prompt, so it counts once."""
    resp.usage.prompt_tokens = len(finals[0].prompt_token_ids)
    resp.usage.completion_tokens = sum(len(out.outputs[0].token_ids) for out in finals)
