"""The small endpoints beside generation: /v1/models/{id}, /tokenize, /detokenize, /tokenizer_info, /version
(vLLM's shapes; lm-eval's remote tokenizer uses the three tokenizer routes, so it needs no tokenizer download)."""

from __future__ import annotations

from collections.abc import Callable
from importlib import metadata
from typing import Any

from aiohttp import web

from kvfleet_agent.server.api.common import APIError, validate
from kvfleet_agent.server.api.inputs import check_text, messages_of, shown
from kvfleet_agent.server.api.requests import DetokenizeRequest, TokenizeRequest
from kvfleet_agent.server.json_body import read_json
from kvfleet_agent.server.prompts import PromptEncoder
from kvfleet_agent.server.protocol import parse

try:
    VERSION = metadata.version("kvfleet")
except metadata.PackageNotFoundError:  # run from a source tree that was never installed
    VERSION = "0+unknown"


class SmallRoutes:
    """Handlers that need the served model's name, its card, the prompt encoder and the vocabulary size."""

    def __init__(self, model: str, card: Callable[[], dict[str, Any]], prompts: PromptEncoder, vocab_size: int,
                 body_timeout_s: float) -> None:
        self.model, self.card, self.prompts = model, card, prompts
        self.vocab_size, self.body_timeout_s = vocab_size, body_timeout_s

    def add_to(self, app: web.Application) -> None:
        """Register the routes."""
        app.router.add_get("/v1/models/{model_id:.+}", self.model_card)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/tokenizer_info", self.tokenizer_info)
        app.router.add_get("/version", self.version)

    async def model_card(self, request: web.Request) -> web.Response:
        """GET /v1/models/{id}: the served model's card, or OpenAI's 404."""
        model_id = request.match_info["model_id"]
        if model_id != self.model:
            raise APIError(f"The model {shown(model_id)} does not exist; this server serves '{self.model}'",
                           "model", status=404, code="model_not_found")
        return web.json_response(self.card())

    async def tokenize(self, request: web.Request) -> web.Response:
        """POST /tokenize: a prompt's (or a rendered conversation's) token ids, as generation would use them."""
        r: Any = validate(TokenizeRequest, self._body(await read_json(request, self.body_timeout_s)))
        if (r.prompt is None) == (r.messages is None):
            raise APIError("give exactly one of 'prompt' (text) or 'messages' (a conversation)", "prompt")
        if r.messages is not None:
            text = await self.prompts.render_chat(messages_of(r.messages), _or(r.add_generation_prompt, True))
            name = "messages"
        else:
            text, name = check_text(r.prompt, "prompt"), "prompt"
        self.prompts.check_chars(len(text), name)
        # Not encode(): that refuses prompts that leave no room to generate; counting them is this route's use.
        tok = self.prompts.tokenizer
        if tok is None:
            raise APIError("this model has no tokenizer.json, so there is nothing to tokenize with", name)
        ids = tok.encode(text, _or(r.add_special_tokens, True))
        strs = [tok.decode([t], skip_special_tokens=False) for t in ids] if r.return_token_strs else None
        return web.json_response({"count": len(ids), "max_model_len": self.prompts.max_model_len, "tokens": ids,
                                  "token_strs": strs})

    async def detokenize(self, request: web.Request) -> web.Response:
        """POST /detokenize: token ids back to text (special tokens kept)."""
        r: Any = validate(DetokenizeRequest, self._body(await read_json(request, self.body_timeout_s)))
        bad = [t for t in r.tokens if t >= self.vocab_size]
        if bad:
            raise APIError(f"'tokens' holds {bad[0]}, outside the vocabulary [0, {self.vocab_size})", "tokens")
        tok = self.prompts.tokenizer
        if tok is None:
            raise APIError("this model has no tokenizer.json, so there is nothing to detokenize with", "tokens")
        return web.json_response({"prompt": tok.decode(r.tokens, skip_special_tokens=False)})

    async def tokenizer_info(self, request: web.Request) -> web.Response:
        """GET /tokenizer_info: the special tokens and the chat template, as vLLM's endpoint of that name."""
        tok = self.prompts.tokenizer
        if tok is None:
            raise APIError("this model has no tokenizer.json", status=404, type_="not_found_error")
        return web.json_response({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tok.bos_token,
                                  "eos_token": tok.eos_token, "pad_token": None, "chat_template": tok.chat_template,
                                  "model_max_length": self.prompts.max_model_len})

    async def version(self, request: web.Request) -> web.Response:
        """GET /version."""
        return web.json_response({"version": VERSION})

    def _body(self, body: Any) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise APIError("the request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.model:
            parse({"model": model}, self.model, chat=False, max_model_len=2)  # the same 404 as generation
        return body


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value
