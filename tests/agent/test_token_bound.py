"""The characters-per-token bound: what each tokenizer's definition allows, and that no text ever beats it."""

from __future__ import annotations

import unicodedata
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from kvfleet_agent.server.token_bound import max_chars_per_token

CORPUS = ["the quick brown fox jumps over the lazy dog " * 3, "naïve café résumé ﬁancé Ångström ệ ᾂ 한국어 ",
          "        indented    code\t\t= {\"key\": [1, 2, 3]} // -----------",
          "Ελληνικά кириллица 中文 日本語 😀👍🏽"] * 20


def _byte_level_bpe(normalizer: normalizers.Normalizer | None = None) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return tok


BYTE_LEVEL = _byte_level_bpe()
NFC = _byte_level_bpe(normalizers.NFC())
# Text that stresses the bound: runs of one character (merged greedily), composing sequences
# (NFC folds up to 4 code points into 1), astral characters (4 bytes), and the corpus's own words.
TEXT = st.lists(st.one_of(st.sampled_from(["a" * 40, " " * 40, "-" * 40, "e\u0301", "\u03b1\u0313\u0300\u0345",
                                           "\u1100\u1161\u11a8", "😀", "quick brown", "ﬁ"]), st.text(max_size=20)),
                max_size=30).map("".join)


@pytest.mark.parametrize("tok", [BYTE_LEVEL, NFC], ids=["byte-level", "byte-level+NFC"])
@settings(max_examples=300, deadline=None)
@given(text=TEXT)
def test_no_text_has_more_characters_per_token_than_the_bound(tok: Tokenizer, text: str) -> None:
    bound = max_chars_per_token(tok)
    assert bound is not None
    tokens = len(tok.encode(text, add_special_tokens=False).ids)
    assert len(text) <= bound * tokens or not text, (text, tokens, bound)


def test_the_bound_is_the_longest_entry_times_what_the_normalizer_may_fold() -> None:
    longest = max(len(t) for t in BYTE_LEVEL.get_vocab())
    assert max_chars_per_token(BYTE_LEVEL) == longest
    assert max_chars_per_token(NFC) == 4 * max(len(t) for t in NFC.get_vocab())
    assert max(len(unicodedata.normalize("NFD", chr(c))) for c in range(0x1F80, 0x1FB0)) == 4  # why 4


def test_the_tiny_checkpoints_tokenizer_has_a_bound(ckpt: Path) -> None:
    tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    assert max_chars_per_token(tok) == max(len(t) for t in tok.get_vocab(with_added_tokens=True))


def _with(model: models.Model, normalizer: normalizers.Normalizer | None = None,
          pre: pre_tokenizers.PreTokenizer | None = None) -> Tokenizer:
    tok = Tokenizer(model)
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre
    return tok


UNBOUNDED: list[tuple[str, Callable[[], Tokenizer]]] = [
    ("bpe-fusing-unknowns", lambda: _with(models.BPE({"<unk>": 0, "a": 1}, [], unk_token="<unk>", fuse_unk=True))),
    ("wordpiece", lambda: _with(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))),
    ("wordlevel", lambda: _with(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))),
    ("strip-normalizer", lambda: _with(models.BPE(), normalizers.Strip())),
    ("strip-accents", lambda: _with(models.BPE(), normalizers.Sequence([normalizers.NFD(),
                                                                         normalizers.StripAccents()]))),
    ("replace-by-nothing", lambda: _with(models.BPE(), normalizers.Replace(" ", ""))),
    ("whitespace-pre-tokenizer", lambda: _with(models.BPE(), pre=pre_tokenizers.Whitespace())),
    ("split-removing", lambda: _with(models.BPE(), pre=pre_tokenizers.Split(" ", "removed"))),
]


@pytest.mark.parametrize("make", [m for _, m in UNBOUNDED], ids=[n for n, _ in UNBOUNDED])
def test_a_tokenizer_that_can_swallow_a_run_of_characters_has_no_bound(make: Callable[[], Tokenizer]) -> None:
    assert max_chars_per_token(make()) is None


def test_sentencepiece_style_normalizers_keep_a_bound() -> None:
    vocab = {"<unk>": 0, "▁": 1, "a": 2, "▁aaaa": 3}
    llama2 = _with(models.BPE(vocab, [], unk_token="<unk>", fuse_unk=True, byte_fallback=True),
                   normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]))
    assert max_chars_per_token(llama2) == 5
    two_for_one = _with(models.BPE(vocab, []), normalizers.Replace("ab", "c"))
    assert max_chars_per_token(two_for_one) == 10
