"""GrammarCompiler: a StructuredOutputs → a compiled llguidance grammar, checked and cached (LRU by constraint).

Compiling happens on the caller's thread: the HTTP server calls it from a worker thread (never the
event loop, never the engine thread), the offline LLM from its own. llguidance was chosen over
xgrammar (both measured, see docs/architecture.md): strings it allows are always valid JSON, grammars
compile lazily (a schema costs about a millisecond up front), and its errors name what is unsupported.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence

import llguidance

from kvfleet_agent.structured_outputs import StructuredOutputs

DEFAULT_CACHE_SIZE = 256  # compiled grammars kept; each holds a parser (KBs to a few MBs for big schemas)
_JSON_OBJECT = {"type": "object"}


class CompiledGrammar:
    """A checked grammar and a matcher at its start; each request gets its own copy of the matcher."""

    def __init__(self, template: llguidance.LLMatcher) -> None:
        self._template = template

    def new_matcher(self) -> llguidance.LLMatcher:
        """A fresh matcher at the grammar's start (a copy: the lexer built so far is shared work)."""
        return self._template.deep_copy()


class GrammarCompiler:
    """Compiles constraints against one tokenizer; thread-safe; the tokenizer is built on first use."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int],
                 cache_size: int = DEFAULT_CACHE_SIZE) -> None:
        self._tokenizer_json, self.vocab_size, self._eos = tokenizer_json, vocab_size, list(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self.cache_size = cache_size
        self.compiles = 0  # cache misses, for tests and metrics

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:  # about 0.2 s for a 32k vocabulary: once per process
                self._tokenizer = llguidance.LLTokenizer(self._tokenizer_json, n_vocab=self.vocab_size,
                                                         eos_token=self._eos)
            return self._tokenizer

    def compile(self, spec: StructuredOutputs) -> CompiledGrammar:
        """The constraint compiled (cached), also stored in spec.compiled; ValueError says what is wrong with it."""
        key = spec.key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
        if hit is None:
            hit = self._compile(spec)
            with self._lock:
                self._cache[key] = hit
                self.compiles += 1
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
        spec.compiled = hit
        return hit

    def _compile(self, spec: StructuredOutputs) -> CompiledGrammar:
        tokenizer = self._llg_tokenizer()
        grammar = grammar_text(spec)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
        if is_error:
            raise ValueError(_first_line(messages))
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(_first_line([matcher.get_error()]))
        return CompiledGrammar(matcher)


def grammar_text(spec: StructuredOutputs) -> str:
    """The constraint as an llguidance grammar (its JSON-schema, regex and Lark front ends)."""
    ws = {"whitespace_flexible": spec.whitespace_flexible}
    if spec.json is not None or spec.json_object:
        schema = spec.json if spec.json is not None else _JSON_OBJECT
        try:
            return str(llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=ws))  # type: ignore[arg-type]
        except ValueError as e:
            raise ValueError(f"the JSON schema is not valid: {_first_line([str(e)])}") from None
    if spec.regex is not None:
        return str(llguidance.LLMatcher.grammar_from_regex(spec.regex))
    if spec.choice is not None:  # JSON string literals are valid Lark string literals
        return "start: " + " | ".join(json.dumps(c) for c in spec.choice) + "\n"
    assert spec.grammar is not None
    return str(llguidance.LLMatcher.grammar_from_lark(spec.grammar))


def _first_line(messages: Sequence[str]) -> str:
    text = "; ".join(m.strip() for m in messages if m.strip()) or "the grammar is invalid"
    return text if len(text) <= 400 else text[:400] + "..."
