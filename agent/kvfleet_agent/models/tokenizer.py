"""Text <-> token ids for a Hugging Face model directory: `tokenizers` plus a jinja2 chat template."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

import jinja2
import jinja2.sandbox
from tokenizers import Tokenizer as HFTokenizer

__all__ = ["Tokenizer"]

# transformers' slow/fast Llama-family tokenizers prepend BOS by default even when
# tokenizer_config.json does not say add_bos_token; generic fast tokenizers rely on the post-processor.
_BOS_BY_DEFAULT_CLASSES = frozenset(
    {
        "LlamaTokenizer",
        "LlamaTokenizerFast",
        "CodeLlamaTokenizer",
        "CodeLlamaTokenizerFast",
        "GemmaTokenizer",
        "GemmaTokenizerFast",
    }
)


def _read_json(path: str) -> dict[str, Any] | None:
    """Parse a JSON object file; None when absent, ValueError naming the file when malformed."""
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: malformed JSON ({e}); fix or remove the file") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object at the top level, got {type(data).__name__}")
    return data


def _token_content(value: Any, path: str, field: str) -> str | None:
    """Special tokens are stored either as plain strings or as AddedToken dicts with a "content" key."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    raise ValueError(
        f"{path}: field {field} must be a string or an object with a string 'content', got {value!r}"
    )


def _int_list(value: Any, path: str, field: str) -> list[int]:
    if value is None:
        return []
    items = value if isinstance(value, list) else [value]
    # bool is an int subclass; a true/false here is a typo, not token id 0/1.
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in items):
        raise ValueError(f"{path}: field {field} must be an integer or a list of integers, got {value!r}")
    return [int(v) for v in items]


def _raise_exception(message: str) -> NoReturn:
    # Templates call raise_exception() to reject conversations they cannot render (HF convention).
    raise ValueError(f"chat template rejected the messages: {message}")


def _load_chat_template(path: str, config: dict[str, Any] | None, config_path: str) -> str | None:
    # Newer checkpoints keep the template in its own file, which takes precedence (as in transformers).
    jinja_path = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja_path):
        with open(jinja_path, encoding="utf-8") as f:
            return f.read()
    if config is None:
        return None
    template = config.get("chat_template")
    if template is None or isinstance(template, str):
        return template
    # Older multi-template form: [{"name": "default", "template": "..."}, ...].
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        chosen = named.get("default")
        if isinstance(chosen, str):
            return chosen
    raise ValueError(
        f"{config_path}: field chat_template must be a string or a list with a 'default' entry, "
        f"got {template!r}"
    )


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the special-token and chat-template metadata from a model directory."""

    def __init__(
        self,
        backend: HFTokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        eos_token_ids: Sequence[int] = (),
        bos_token_id: int | None = None,
        add_bos_token: bool = False,
        chat_template: str | None = None,
    ) -> None:
        self.backend = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id: int | None = bos_token_id
        self.eos_token_ids: list[int] = list(dict.fromkeys(eos_token_ids))
        self.add_bos_token = add_bos_token
        self.chat_template: str | None = chat_template
        self._compiled_template: jinja2.Template | None = None
        self.all_special_ids: frozenset[int] = frozenset(
            i for i, tok in backend.get_added_tokens_decoder().items() if tok.special
        )
        # Probe once whether the post-processor already inserts BOS, so encode() knows whether it
        # must prepend it itself (and never does both).
        self._post_processor_adds_bos = False
        if bos_token_id is not None:
            with_special = backend.encode("a", add_special_tokens=True).ids
            without = backend.encode("a", add_special_tokens=False).ids
            added = with_special[:1] == [bos_token_id] and without[:1] != [bos_token_id]
            self._post_processor_adds_bos = added

    @classmethod
    def from_dir(cls, path: str) -> Tokenizer | None:
        """Load from a Hugging Face model directory; None when it has no tokenizer.json."""
        if not os.path.isdir(path):
            raise FileNotFoundError(f"model directory {path} does not exist (or is not a directory)")
        tok_path = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tok_path):
            return None
        try:
            backend = HFTokenizer.from_file(tok_path)
        except Exception as e:  # tokenizers raises a bare Exception for malformed files
            raise ValueError(
                f"{tok_path}: cannot be parsed by the tokenizers library ({e}); re-export it"
            ) from e

        cfg_path = os.path.join(path, "tokenizer_config.json")
        gen_path = os.path.join(path, "generation_config.json")
        cfg = _read_json(cfg_path)
        gen = _read_json(gen_path)

        def token_id(token: str | None, field: str) -> int | None:
            if token is None:
                return None
            tid = backend.token_to_id(token)
            if tid is None:
                raise ValueError(
                    f"{cfg_path}: {field} {token!r} is not in {tok_path}'s vocabulary; fix the field"
                )
            return int(tid)

        bos_token = _token_content(cfg.get("bos_token"), cfg_path, "bos_token") if cfg else None
        eos_token = _token_content(cfg.get("eos_token"), cfg_path, "eos_token") if cfg else None
        bos_id = token_id(bos_token, "bos_token")
        cfg_eos = token_id(eos_token, "eos_token")

        gen_eos = _int_list(gen.get("eos_token_id"), gen_path, "eos_token_id") if gen else []
        gen_bos = _int_list(gen.get("bos_token_id"), gen_path, "bos_token_id") if gen else []
        if bos_id is None and gen_bos:
            bos_id = gen_bos[0]
        # Token strings (the chat template's bos_token/eos_token) come from tokenizer_config.json; an
        # explicit null there (Qwen2 has no BOS) must stay null, so only a missing file falls back.
        if cfg is None:
            if bos_id is not None:
                bos_token = backend.id_to_token(bos_id)
            if gen_eos:
                eos_token = backend.id_to_token(gen_eos[0])
        eos_ids = gen_eos + ([cfg_eos] if cfg_eos is not None else [])

        add_bos: bool
        raw_add_bos = cfg.get("add_bos_token") if cfg else None
        if raw_add_bos is None:
            tok_class = cfg.get("tokenizer_class") if cfg else None
            add_bos = bos_id is not None and tok_class in _BOS_BY_DEFAULT_CLASSES
        elif isinstance(raw_add_bos, bool):
            add_bos = raw_add_bos
        else:
            raise ValueError(f"{cfg_path}: field add_bos_token must be true or false, got {raw_add_bos!r}")

        return cls(
            backend,
            bos_token=bos_token,
            eos_token=eos_token,
            bos_token_id=bos_id,
            eos_token_ids=eos_ids,
            add_bos_token=add_bos,
            chat_template=_load_chat_template(path, cfg, cfg_path),
        )

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (HF's len(tokenizer))."""
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids for `text`; with add_special_tokens, exactly one BOS leads when the model uses one."""
        # encode_batch, not encode: it releases the GIL while Rust works, so a long prompt tokenized on a
        # server thread does not stall the event loop (encode holds the GIL for the whole call).
        ids: list[int] = list(self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)
        bos = self.bos_token_id
        if not add_special_tokens or bos is None:
            return ids
        if self.add_bos_token and not self._post_processor_adds_bos:
            ids.insert(0, bos)
        # Text that already starts with the BOS token (e.g. a rendered chat template with
        # {{ bos_token }}) would otherwise get a second one, which degrades Llama-style models.
        if len(ids) >= 2 and ids[0] == bos and ids[1] == bos:
            del ids[0]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text for `ids`; byte sequences that are not yet complete UTF-8 decode to U+FFFD."""
        return str(self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        """Vocabulary strings (e.g. byte-level 'Ġthe') for `ids`."""
        out: list[str] = []
        for i in ids:
            tok = self.backend.id_to_token(i)
            if tok is None:
                raise ValueError(f"token id {i} is outside the vocabulary (size {self.vocab_size})")
            out.append(str(tok))
        return out

    def token_to_id(self, token: str) -> int | None:
        """Id of a vocabulary string, or None when it is not in the vocabulary."""
        tid = self.backend.token_to_id(token)
        return None if tid is None else int(tid)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> str:
        """Render a conversation to prompt text with the model's chat template (or a plain fallback).

        tools (OpenAI's shape) reach the template as `tools`, as transformers passes them; messages may
        carry tool_calls and tool_call_id for the templates that render tool turns.
        """
        for i, message in enumerate(messages):
            if not isinstance(message, dict):
                raise ValueError(
                    f"messages[{i}] must be an object with 'role' and 'content', got {message!r}"
                )
            for key in ("role", "content"):
                if key not in message:
                    raise ValueError(
                        f"messages[{i}].{key} is missing; every message needs 'role' and 'content'"
                    )
                if not isinstance(message[key], str):
                    raise ValueError(
                        f"messages[{i}].{key} must be a string, got {type(message[key]).__name__}"
                    )
        if self.chat_template is None:
            # No template: a neutral role-tagged layout so chat requests still work on base models.
            text = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages)
            return text + "<|assistant|>\n" if add_generation_prompt else text
        template = self._template()
        try:
            return str(
                template.render(
                    messages=messages,
                    add_generation_prompt=add_generation_prompt,
                    bos_token=self.bos_token or "",
                    eos_token=self.eos_token or "",
                    **({"tools": tools} if tools else {}),
                )
            )
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template failed to render: {e}") from e

    def _template(self) -> jinja2.Template:
        if self._compiled_template is None:
            assert self.chat_template is not None
            # Same environment settings as transformers, so templates written for HF render identically;
            # sandboxed because templates ship with downloaded checkpoints.
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
            )
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise_exception
            try:
                self._compiled_template = env.from_string(self.chat_template)
            except jinja2.TemplateSyntaxError as e:
                raise ValueError(
                    f"chat_template has a jinja syntax error at line {e.lineno}: {e.message}"
                ) from e
        return self._compiled_template


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, sort_keys: bool = False
) -> str:
    # HF's tojson keeps non-ASCII as-is, unlike jinja2's built-in (which HTML-escapes too).
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, sort_keys=sort_keys)
