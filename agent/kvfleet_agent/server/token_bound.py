"""The most characters one token can cover, read from the tokenizer's own definition: a floor on prompt tokens."""

# A text of C characters has at least C / B tokens when no token covers more than B characters,
# so a text longer than max_model_len * B cannot fit and is refused before any tokenizing. B is
# the longest vocabulary entry (byte-level BPE spells each byte as one character, so an entry's
# length bounds the bytes, hence the characters, it covers; SentencePiece's "▁" stands for one
# space), times what the normalizer may shrink text by. Whatever could map an unbounded run of
# characters to one token (an unknown token swallowing a run, a normalizer or pre-tokenizer that
# deletes characters) gives no bound at all: None, and only the body size limit applies.

from __future__ import annotations

import json
import logging
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

log = logging.getLogger(__name__)

# Canonical composition folds at most 4 code points into one (U+1F82: alpha, psili, varia,
# ypogegrammeni); every other normalizer listed here never shrinks text.
_NORMALIZER_SHRINK = {"NFC": 4, "NFKC": 4, "NFD": 1, "NFKD": 1, "Lowercase": 1, "Prepend": 1, "ByteLevel": 1}
# Pre-tokenizers that only split (or add a prefix space), never delete characters.
_SPLITTING = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "FixedLength"}


def max_chars_per_token(backend: HFTokenizer) -> int | None:
    """An upper bound on the characters of input text that one token covers, or None when there is none."""
    why = _unbounded_model(backend.model)
    shrink: float | None = 1.0
    if why is None:
        shrink = _normalizer_shrink(_state(backend.normalizer))
        if shrink is None:
            why = f"its normalizer ({_kind(backend.normalizer)}) may delete characters"
        elif not _keeps_characters(_state(backend.pre_tokenizer)):
            why = f"its pre-tokenizer ({_kind(backend.pre_tokenizer)}) may delete characters"
    if why is not None or shrink is None:
        log.info("no characters-per-token bound for this tokenizer: %s; prompts are bounded by the body size only", why)
        return None
    longest = max((len(t) for t in backend.get_vocab(with_added_tokens=True)), default=1)
    return max(1, int(longest * shrink + 0.999))


def _state(component: Any) -> dict[str, Any] | None:
    if component is None:
        return None
    state = json.loads(component.__getstate__())
    return state if isinstance(state, dict) else None


def _kind(component: Any) -> str:
    return type(component).__name__


def _unbounded_model(model: Any) -> str | None:
    """Why the model may turn an unbounded run of characters into one token, or None."""
    kind = _kind(model)
    if kind == "BPE":
        if model.unk_token is not None and model.fuse_unk and not model.byte_fallback:
            return "its BPE model fuses runs of unknown characters into one token"
        return None
    if kind == "Unigram":
        state = json.loads(model.__getstate__())
        if state.get("unk_id") is not None and not state.get("byte_fallback", False):
            return "its Unigram model fuses runs of unknown characters into one token"
        return None
    return f"its {kind} model maps a whole unknown word to one token"


def _normalizer_shrink(state: dict[str, Any] | None) -> float | None:
    """How many characters of input may become one normalized character (None: unbounded)."""
    if state is None:
        return 1.0
    kind = state.get("type")
    if kind == "Sequence":
        total = 1.0
        for child in state.get("normalizers", []):
            part = _normalizer_shrink(child)
            if part is None:
                return None
            total *= part
        return total
    if kind == "Replace":
        pattern, content = state.get("pattern", {}), state.get("content", "")
        if "String" not in pattern or not content:
            return None  # a regex, or a deletion: no bound
        return max(1.0, len(pattern["String"]) / len(content))
    return _NORMALIZER_SHRINK.get(str(kind))


def _keeps_characters(state: dict[str, Any] | None) -> bool:
    if state is None:
        return True
    kind = state.get("type")
    if kind == "Sequence":
        return all(_keeps_characters(child) for child in state.get("pretokenizers", []))
    if kind in ("Split", "Punctuation"):
        return str(state.get("behavior", "")).lower() != "removed"
    return kind in _SPLITTING
