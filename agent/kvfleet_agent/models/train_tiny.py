"""`kvfleet-agent model train-tiny`: a small Llama target and a smaller draft, trained here on the stdlib's source.

Random weights make speculative decoding, quantization error and demo answers meaningless; these two
models share one tokenizer, write ordinary Hugging Face checkpoints (transformers' save_pretrained),
report held-out perplexity, and are cached outside the repository under a key of everything that
shapes them (this recipe's version, sizes, steps, seed, Python, torch and transformers versions).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import platform
import shutil
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from kvfleet_agent.models.stdlib_corpus import BOS_ID, EOS_ID, texts, train_tokenizer

log = logging.getLogger(__name__)
RECIPE_VERSION = 3  # bump when the recipe changes what it writes (2: copy_share; 3: the draft distilled)
EVAL_WINDOWS = 256  # held-out windows the agreement is measured on (about 33k positions)
CACHE = Path.home() / ".cache" / "kvfleet" / "trained"


@dataclass(frozen=True)
class ModelShape:
    """One Llama's size."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int


@dataclass(frozen=True)
class Recipe:
    """Everything that shapes the pair. The defaults take a few minutes on two cores."""

    target: ModelShape = ModelShape(256, 4, 8, 4, 704)
    draft: ModelShape = ModelShape(128, 2, 4, 2, 352)
    vocab_size: int = 4096
    corpus_chars: int = 6_000_000
    seq_len: int = 128
    batch_size: int = 16
    steps: int = 600
    lr: float = 1.5e-3
    seed: int = 0
    # Share of training windows whose second half repeats their first: code models copy (an edited function, a
    # repeated call), and a pair that never saw a repeat would not, which is what prompt lookup bets on.
    copy_share: float = 0.25
    # Train the draft to the target's next-token distributions (forward KL) rather than to the text: a draft is
    # worth what it agrees with its target, and distillation is how speculative-decoding drafts are made.
    distill: bool = True

    def key(self) -> str:
        """The cache key: the recipe and the versions of everything that computes it."""
        import transformers

        facts = {"recipe": RECIPE_VERSION, **asdict(self), "python": platform.python_version(),
                 "torch": torch.__version__, "transformers": transformers.__version__}
        return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:16]


FAST = replace(Recipe(), target=ModelShape(64, 2, 4, 2, 176), draft=ModelShape(32, 1, 2, 1, 88), vocab_size=512,
               corpus_chars=300_000, seq_len=64, batch_size=8, steps=80, lr=3e-3)  # tests: seconds, not minutes


def _encode(tok: Any, texts: list[str]) -> list[int]:
    """The texts as one token stream, each followed by EOS."""
    return [t for ids in tok.encode_batch(texts) for t in [*ids.ids, EOS_ID]]


def _windows(ids: list[int], seq_len: int) -> torch.Tensor:
    """The token stream cut into [N, seq_len + 1] windows (inputs and their next tokens)."""
    n = (len(ids) - 1) // seq_len
    return torch.tensor(ids[: n * seq_len + 1]).unfold(0, seq_len + 1, seq_len)


def _with_copies(w: torch.Tensor, share: float, gen: torch.Generator) -> torch.Tensor:
    """The batch with a `share` of its windows made of a span and then that span again (from a random point in the
    first half, so copies start anywhere)."""
    if share <= 0.0:
        return w
    w = w.clone()
    n = w.shape[1]
    for row in torch.nonzero(torch.rand(len(w), generator=gen) < share).flatten().tolist():
        start = int(torch.randint(n // 4, n // 2 + 1, (1,), generator=gen))
        w[row, start:] = w[row, :n - start].clone()  # the two spans overlap
    return w


def _model(shape: ModelShape, recipe: Recipe) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=recipe.vocab_size, hidden_size=shape.hidden_size,
                         intermediate_size=shape.intermediate_size, num_hidden_layers=shape.num_layers,
                         num_attention_heads=shape.num_heads, num_key_value_heads=shape.num_kv_heads,
                         max_position_embeddings=max(2048, recipe.seq_len),
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                         tie_word_embeddings=True, bos_token_id=BOS_ID, eos_token_id=EOS_ID)
    return LlamaForCausalLM(config)


@torch.no_grad()
def perplexity(model: Any, windows: torch.Tensor, batch_size: int) -> float:
    """exp(mean next-token cross-entropy) over the windows."""
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(windows), batch_size):
        w = windows[i:i + batch_size]
        logits = model(input_ids=w[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), w[:, 1:].flatten(), reduction="sum")
        total, count = total + float(loss), count + w[:, 1:].numel()
    return math.exp(total / max(count, 1))


@torch.no_grad()
def agreement(model: Any, teacher: Any, windows: torch.Tensor, batch_size: int) -> float:
    """The share of positions where the model's most likely next token is the teacher's: what a greedy draft's
    proposals are accepted at, one position at a time."""
    model.eval()
    same, count = 0, 0
    for i in range(0, len(windows), batch_size):
        w = windows[i:i + batch_size, :-1]
        same += int((model(input_ids=w).logits.argmax(-1) == teacher(input_ids=w).logits.argmax(-1)).sum())
        count += w.numel()
    return same / max(count, 1)


def _loss(model: Any, w: torch.Tensor, teacher: Any | None) -> torch.Tensor:
    """Next-token cross-entropy on the text, or with a teacher the forward KL from its next-token distributions."""
    if teacher is None:
        loss: torch.Tensor = model(input_ids=w, labels=w).loss  # transformers shifts the labels by one itself
        return loss
    with torch.no_grad():
        want = teacher(input_ids=w).logits.float().log_softmax(-1).flatten(0, 1)
    got = model(input_ids=w).logits.float().log_softmax(-1).flatten(0, 1)
    return torch.nn.functional.kl_div(got, want, log_target=True, reduction="batchmean")


def _train(model: Any, train: torch.Tensor, recipe: Recipe, name: str, teacher: Any | None = None) -> None:
    """AdamW with warm-up and cosine decay over recipe.steps random batches (distilled from `teacher` if given)."""
    gen = torch.Generator().manual_seed(recipe.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=0.1, betas=(0.9, 0.95))
    warmup = max(1, recipe.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min((s + 1) / warmup, 0.5 * (1 + math.cos(
        math.pi * min(1.0, s / recipe.steps)))))
    model.train()
    bar = tqdm(range(recipe.steps), desc=f"train {name}", unit="step", dynamic_ncols=True)
    for _ in bar:
        w = _with_copies(train[torch.randint(len(train), (recipe.batch_size,), generator=gen)], recipe.copy_share,
                         gen)
        loss = _loss(model, w, teacher)
        torch.autograd.backward(loss)  # Tensor.backward is unannotated
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        bar.set_postfix_str(f"loss {loss.item():.3f}", refresh=False)


def _save_tokenizer(tok: Any, out: Path) -> None:
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "pad_token": "<pad>", "model_max_length": 2048, "add_bos_token": False}, indent=2))


def train_pair(out_dir: str, recipe: Recipe = Recipe(), cache: Path = CACHE) -> dict[str, Any]:
    """Write DIR/target and DIR/draft (trained into the cache unless this recipe already is there); returns the
    report: each model's parameters and held-out perplexity, and the unigram baseline's."""
    cached = cache / recipe.key()
    if (cached / "report.json").exists():
        log.info("train-tiny: recipe %s is cached in %s", recipe.key(), cached)
    else:
        _build(recipe, cached)
    shutil.copytree(cached, out_dir, dirs_exist_ok=True)
    report: dict[str, Any] = json.loads((cached / "report.json").read_text())
    return report


def _build(recipe: Recipe, where: Path) -> None:
    """Train both models and write them, their tokenizer and the report into `where` (a cache entry)."""
    torch.manual_seed(recipe.seed)
    train_texts, eval_texts = texts(recipe.corpus_chars)
    tok = train_tokenizer(train_texts, recipe.vocab_size)
    stream, held = _encode(tok, train_texts), _encode(tok, eval_texts)
    train_w, eval_w = _windows(stream, recipe.seq_len), _windows(held, recipe.seq_len)
    counts = torch.bincount(torch.tensor(stream), minlength=recipe.vocab_size).float() + 1
    unigram = math.exp(float(-(counts / counts.sum()).log()[eval_w[:, 1:].flatten()].mean()))
    report: dict[str, Any] = {"recipe": asdict(recipe), "key": recipe.key(), "train_tokens": len(stream),
                              "eval_tokens": int(eval_w[:, 1:].numel()), "unigram_perplexity": unigram}
    tmp = where.with_name(where.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    target = None
    for name, shape in (("target", recipe.target), ("draft", recipe.draft)):
        model = _model(shape, recipe)
        _train(model, train_w, recipe, name, target if recipe.distill else None)
        ppl = perplexity(model, eval_w, recipe.batch_size)
        report[name] = {"parameters": sum(p.numel() for p in model.parameters()), "eval_perplexity": ppl}
        if target is not None:
            report[name]["target_agreement"] = agreement(model, target, eval_w[:EVAL_WINDOWS], recipe.batch_size)
        log.info("train-tiny: %s, %d parameters, held-out perplexity %.2f (unigram %.2f)%s", name,
                 report[name]["parameters"], ppl, unigram,
                 f", top-1 agreement with the target {report[name]['target_agreement']:.3f}" if target else "")
        model.save_pretrained(tmp / name)
        _save_tokenizer(tok, tmp / name)
        target = model
    (tmp / "report.json").write_text(json.dumps(report, indent=2))
    shutil.rmtree(where, ignore_errors=True)
    tmp.rename(where)  # whole or not at all: an interrupted run leaves no half-written cache entry
