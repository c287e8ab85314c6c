"""The byte-level BPE tokenizer shared by all tiny checkpoints, trained here on a synthetic corpus."""

from __future__ import annotations

import functools
import random

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

# Llama-2 numbering: special tokens take the lowest ids so every arch shares one tokenizer.
TINY_UNK_ID = 0
TINY_BOS_ID = 1
TINY_EOS_ID = 2
TINY_PAD_ID = 3
_SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>"]
_TOKENIZER_VOCAB_TARGET = 768

# Vocabulary of the synthetic corpus. Mixed-case, punctuation, digits and a few non-ASCII words
# give the BPE merges some multi-byte tokens; emoji are left rare so they stay split into
# byte tokens, which is what exercises partial-UTF-8 handling in the detokenizer.
_WORD_TEXT = (
    "the of and to in a is that for it as was with be by on not he this are or his from at which "
    "but have an they you were her she there one all we their has been if more when will would who "
    "so no time people year way day man thing woman life child world school state family student "
    "group country problem hand part place case week company system program question work government "
    "number night point home water room mother area money story fact month lot right study book eye "
    "job word business issue side kind head house service friend father power hour game line end "
    "member law car city community name president team minute idea kid body information back parent "
    "face others level office door health person art war history party result change morning reason "
    "research girl guy moment air teacher force education good new first last long great little own "
    "other old big high different small large next early young important few public bad same able "
    "say get make go know take see come think look want give use find tell ask seem feel try leave "
    "call run walk read write open close begin help talk turn start show hear play move live believe "
    "quickly slowly always never often today tomorrow yesterday here where why how because while "
    "model token kernel cache block batch request engine server cluster latency memory tensor"
)
_WORDS = tuple(_WORD_TEXT.split())
_UNICODE_WORDS = ("café", "naïve", "Straße", "façade", "über", "日本語", "中文", "Ελλάδα", "привет", "—", "…")
_RARE = ("🙂", "🚀", "€", "ñ")
_PUNCT = (".", ".", ".", "!", "?", ",", ";", ":")


def _synthetic_corpus(num_lines: int = 2500, seed: int = 1234) -> list[str]:
    """Deterministic English-like sentences; the seed is fixed so every checkpoint shares one tokenizer."""
    rng = random.Random(seed)
    lines: list[str] = []
    for _ in range(num_lines):
        words: list[str] = []
        for _ in range(rng.randint(5, 16)):
            r = rng.random()
            if r < 0.04:
                word = _UNICODE_WORDS[rng.randrange(len(_UNICODE_WORDS))]
            elif r < 0.05:
                word = _RARE[rng.randrange(len(_RARE))]
            elif r < 0.08:
                word = str(rng.randint(0, 2025))
            else:
                word = _WORDS[rng.randrange(len(_WORDS))]
            if rng.random() < 0.06:
                word += _PUNCT[rng.randrange(3, len(_PUNCT))]
            words.append(word)
        words[0] = words[0][:1].upper() + words[0][1:]
        lines.append(" ".join(words) + _PUNCT[rng.randrange(3)])
    return lines


@functools.lru_cache(maxsize=1)
def tiny_tokenizer_json() -> str:
    """Train (once per process) the byte-level BPE shared by all tiny checkpoints; returns tokenizer.json."""
    tok = HFTokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_TOKENIZER_VOCAB_TARGET,
        min_frequency=2,
        special_tokens=_SPECIAL_TOKENS,
        # Every byte must be in the vocab or arbitrary text (emoji, CJK) could not be encoded.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_synthetic_corpus(), trainer=trainer)
    # The post-processor adds BOS itself so tokenizers, transformers and kvfleet agree on ids
    # without depending on how each library interprets tokenizer_config's add_bos_token.
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A",
        pair="<s> $A <s> $B",
        special_tokens=[("<s>", TINY_BOS_ID)],
    )
    for i, name in enumerate(_SPECIAL_TOKENS):
        if tok.token_to_id(name) != i:
            raise RuntimeError(f"tiny tokenizer: expected {name} to have id {i}, got {tok.token_to_id(name)}")
    return str(tok.to_str())
