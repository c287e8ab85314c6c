"""Training text every machine has: this Python's standard-library sources, split by file, and a BPE tokenizer on it."""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>"]
BOS_ID, EOS_ID = 1, 2
EVAL_SHARE = 0.05  # of the files, chosen by a hash of their path: stable across runs and machines


def source_files(root: str | None = None) -> list[Path]:
    """The standard library's .py files (tests and site-packages left out), sorted."""
    base = Path(root or sysconfig.get_paths()["stdlib"])
    skip = ("site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__")
    return sorted(p for p in base.rglob("*.py") if not any(part in skip for part in p.relative_to(base).parts))


def is_eval(path: Path) -> bool:
    """Whether a file is held back for evaluation."""
    digest = hashlib.blake2b(path.name.encode() + str(path.parent.name).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 < EVAL_SHARE


def texts(max_chars: int, root: str | None = None) -> tuple[list[str], list[str]]:
    """(training texts, evaluation texts), each at most max_chars characters in total."""
    train: list[str] = []
    held: list[str] = []
    for path in source_files(root):
        bucket = held if is_eval(path) else train
        if sum(map(len, bucket)) >= max_chars * (EVAL_SHARE if bucket is held else 1):
            continue
        try:
            bucket.append(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):  # a few files are latin-1 or unreadable: skip them
            continue
    return train, held


def train_tokenizer(corpus: list[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE (as Llama 3 and Qwen use) trained on the corpus, with <s> prepended to every text."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", BOS_ID)])
    return tok
