"""The OpenAPI 3.1 description of the agent's HTTP API, served at /openapi.json, generated from the pydantic models."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from kvfleet_agent.server.api import requests, responses

_POST_ERRORS = {
    "400": "invalid request: the message says what is wrong and how to fix it",
    "401": "missing or incorrect API key (when the server has one)",
    "404": "unknown model",
    "408": "the body did not arrive within the body timeout",
    "413": "the body is over the size limit",
    "415": "the body is not JSON (or is compressed)",
    "429": "the queue is full: retry after the Retry-After delay",
    "503": "draining or failed: retry on another replica",
}
_REF = "#/components/schemas/{model}"
# Request models are validated as sent (validation mode); responses as the server writes them.
_MODELS: list[tuple[type[BaseModel], Literal["validation", "serialization"]]] = [
    (requests.CompletionRequest, "validation"), (requests.ChatCompletionRequest, "validation"),
    (responses.CompletionResponse, "serialization"), (responses.ChatCompletionResponse, "serialization"),
    (responses.ChatCompletionChunk, "serialization"), (responses.ModelList, "serialization"),
    (responses.ModelCard, "serialization"), (responses.ErrorResponse, "serialization"),
    (requests.TokenizeRequest, "validation"), (requests.DetokenizeRequest, "validation"),
    (responses.TokenizeResponse, "serialization"), (responses.DetokenizeResponse, "serialization"),
    (responses.VersionResponse, "serialization"), (responses.TokenizerInfoResponse, "serialization"),
]


def _json(schema: str, description: str) -> dict[str, Any]:
    ref = {"$ref": _REF.format(model=schema)}
    return {"description": description, "content": {"application/json": {"schema": ref}}}


def _error(description: str) -> dict[str, Any]:
    return _json("ErrorResponse", description)


def _post(summary: str, request: str, response: str, secured: bool) -> dict[str, Any]:
    ok = _json(response, "The result; with stream true, a text/event-stream of chunks ending in `data: [DONE]`")
    # For an event stream, OpenAPI 3.1's `schema` describes one event: its data is a JSON chunk, or [DONE] last.
    ok["content"]["text/event-stream"] = {"schema": {"type": "object", "required": ["data"], "properties": {
        "data": {"type": "string", "minLength": 1, "contentMediaType": "application/json"},
        "event": {"type": "string"}, "id": {"type": "string"}}}}
    op: dict[str, Any] = {"summary": summary, "requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": _REF.format(model=request)}}}},
        "responses": {"200": ok, **{code: _error(why) for code, why in _POST_ERRORS.items()}}}
    return {"post": _secure(op, secured)}


def _get(summary: str, ok: dict[str, Any], fail: dict[str, Any] | None = None, secured: bool = False,
         not_found: str | None = None) -> dict[str, Any]:
    responses_: dict[str, Any] = {"200": ok}
    if fail is not None:
        responses_["503"] = fail
    if not_found is not None:
        responses_["404"] = _error(not_found)
    if secured:
        responses_["401"] = _error(_POST_ERRORS["401"])
    return {"get": _secure({"summary": summary, "responses": responses_}, secured)}


def _secure(op: dict[str, Any], secured: bool) -> dict[str, Any]:
    if secured:
        op["security"] = [{"bearer": []}]
    return op


def _status(*values: str) -> dict[str, Any]:
    return {"type": "object", "required": ["status"], "properties": {"status": {"enum": list(values)},
                                                                     "reason": {"type": "string"}}}


_HEALTH_OK = {"description": "alive", "content": {"application/json": {"schema": _status("ok")}}}
_HEALTH_FAIL = {"description": "failed or stalled", "content": {"application/json": {"schema": _status("unhealthy")}}}


def _simple_post(summary: str, request: str, response: str) -> dict[str, Any]:
    """A JSON-in, JSON-out POST outside /v1 (so without the API key, as in vLLM)."""
    return {"post": {"summary": summary, "requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": _REF.format(model=request)}}}}, "responses": {
        "200": _json(response, "The result"), "400": _error(_POST_ERRORS["400"]), "404": _error("unknown model"),
        "413": _error(_POST_ERRORS["413"]), "415": _error(_POST_ERRORS["415"])}}}


def schemas(model: str, max_logprobs: int = 20) -> dict[str, Any]:
    """Every component schema, from the models; the served model's name and the logprobs limit filled in."""
    _, top = models_json_schema(_MODELS, ref_template=_REF)
    out: dict[str, Any] = top["$defs"]
    named = {"anyOf": [{"const": model}, {"type": "null"}]}
    for request in ("CompletionRequest", "ChatCompletionRequest"):
        out[request]["properties"]["model"] = {**out[request]["properties"]["model"], **named}
        # top_logprobs (not null) needs logprobs: true, as in OpenAI's API.
    out["CompletionRequest"]["properties"]["logprobs"]["anyOf"][0]["maximum"] = max_logprobs
    chat = out["ChatCompletionRequest"]
    chat["properties"]["top_logprobs"]["anyOf"][0]["maximum"] = max_logprobs
    chat["if"] = {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer"}}}
    chat["then"] = {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}
    for response in ("CompletionResponse", "ChatCompletionResponse", "ChatCompletionChunk", "ModelCard"):
        key = "id" if response == "ModelCard" else "model"
        out[response]["properties"][key] = {**out[response]["properties"][key], "const": model}
    return out


def openapi_document(model: str, secured: bool = False, max_logprobs: int = 20) -> dict[str, Any]:
    """The API description, naming the served model; `secured` when /v1 routes need the API key."""
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "kvfleet agent", "version": "v1",
                 "description": f"OpenAI-compatible inference for the model '{model}'."},
        "paths": {
            "/v1/completions": _post("Complete a prompt (text or token ids, or a list of them)", "CompletionRequest",
                                     "CompletionResponse", secured),
            "/v1/chat/completions": _post("Answer a conversation, rendered with the model's chat template",
                                          "ChatCompletionRequest", "ChatCompletionResponse", secured),
            "/v1/models": _get("The served model", _json("ModelList", "A list with one model"), secured=secured),
            "/v1/models/{model_id}": {"get": {**_get("One model, by id", _json("ModelCard", "The model"),
                                                     secured=secured, not_found="no such model")["get"],
                                              "parameters": [
                {"name": "model_id", "in": "path", "required": True, "schema": {"type": "string"}}]}},
            "/tokenize": _simple_post("A prompt's or a conversation's token ids (vLLM)", "TokenizeRequest",
                                      "TokenizeResponse"),
            "/detokenize": _simple_post("Token ids to text (vLLM)", "DetokenizeRequest", "DetokenizeResponse"),
            "/tokenizer_info": _get("The tokenizer's special tokens and chat template (vLLM)",
                                    _json("TokenizerInfoResponse", "The tokenizer"),
                                    not_found="the model has no tokenizer"),
            "/version": _get("The agent's version", _json("VersionResponse", "The version")),
            "/ping": {**_get("Liveness, as /health (vLLM, SageMaker)", _HEALTH_OK, _HEALTH_FAIL),
                      "post": _get("Liveness, as /health", _HEALTH_OK, _HEALTH_FAIL)["get"]},
            "/health": _get("Liveness: the engine loop is alive and making progress", _HEALTH_OK, _HEALTH_FAIL),
            "/ready": _get("Readiness: loaded, warmed up and not draining",
                           {"description": "ready", "content": {"application/json": {"schema": _status("ready")}}},
                           {"description": "draining or failed", "content": {"application/json": {
                               "schema": _status("draining", "failed")}}}),
            "/metrics": _get("Prometheus metrics", {"description": "text exposition format", "content": {
                "text/plain": {"schema": {"type": "string"}}}}),
            "/openapi.json": _get("This document", {"description": "OpenAPI 3.1", "content": {
                "application/json": {"schema": {"type": "object"}}}}),
        },
        "components": {"schemas": schemas(model, max_logprobs)},
    }
    if secured:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return doc
