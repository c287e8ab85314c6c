"""The cost report's workload: the seed's class mix, prompts cut from held-out stdlib source, the tiers serving it."""

from __future__ import annotations

import hashlib
import json
import math
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvfleet_router.classifier import classify, features
from kvfleet_router.tier_config import UNMATCHED, TieredModel

SMALL, LARGE, TIERED = "code-small", "code-large", "code"
MIX = {"simple": 0.60, "medium": 0.20, "complex": 0.15, "expert": 0.05}  # the seed's workload mix
EXPECTED = {"simple": "simple", "medium": "medium", "complex": UNMATCHED, "expert": UNMATCHED}  # generated → assigned
# Per class at length scale 1: prompt characters (low, high) and max_tokens (low, high). The class limits below
# (prompt tokens estimated as characters / 4) put each shape in its own class.
SHAPES = {"simple": (60, 240, 8, 32), "medium": (300, 1000, 33, 64), "complex": (1100, 2400, 65, 128),
          "expert": (200, 1200, 65, 128)}
SIMPLE_PROMPT_TOKENS, MEDIUM_PROMPT_TOKENS = 64, 256
MARKER = "step by step"  # the only marker: stdlib code is full of the default ones ("def ", "class ")
EXPERT_ASK = "# Explain step by step what the code below does, then continue it.\n"
EVAL_SHARE = 0.05  # stdlib_corpus.EVAL_SHARE


@dataclass(frozen=True)
class Request:
    """One request of the workload: its generated class, its prompt and its output limit (always greedy)."""

    cls: str
    prompt: str
    max_tokens: int


def held_out_files(root: str | None = None) -> list[Path]:
    """The standard-library files train-tiny holds out of training: kvfleet_agent.models.stdlib_corpus's rule
    restated, since the router may not import the agent (tests/router/test_cost_report.py checks that they agree)."""
    base = Path(root or sysconfig.get_paths()["stdlib"])
    skip = ("site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__")
    files = sorted(p for p in base.rglob("*.py") if not any(part in skip for part in p.relative_to(base).parts))
    return [p for p in files if int.from_bytes(hashlib.blake2b(p.name.encode() + p.parent.name.encode(),
                                                               digest_size=8).digest(), "big") / 2**64 < EVAL_SHARE]


def tiers_config(large_cost: float, scale: float, quality: dict[str, Any]) -> list[dict[str, Any]]:
    """--tiers for the router: `code` is code-small then code-large; simple and medium requests go to code-small,
    the rest (complex: a long prompt or max_tokens > 64; expert: the marker) is unmatched, on code-large."""
    classes = [{"name": "simple", "tier": 0, "maxPromptTokens": round(SIMPLE_PROMPT_TOKENS * scale),
                "maxOutputTokens": 32, "markers": False},
               {"name": "medium", "tier": 0, "maxPromptTokens": round(MEDIUM_PROMPT_TOKENS * scale),
                "maxOutputTokens": 64, "markers": False}]
    return [{"name": TIERED, "tiers": [{"model": SMALL, "cost": 1}, {"model": LARGE, "cost": large_cost}],
             "classifier": {"classes": classes, "markers": [MARKER]}, "quality": quality}]


def parameters(model_dir: str) -> int:
    """A checkpoint's parameters, counted from its safetensors headers (the router loads no torch)."""
    total = 0
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with f.open("rb") as fh:
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        total += sum(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__")
    if not total:
        raise ValueError(f"{model_dir}: no safetensors weights found")
    return total


def quotas(n: int) -> dict[str, int]:
    """The mix as whole requests: floors, then one more for the largest remainders."""
    out = {c: math.floor(n * share) for c, share in MIX.items()}
    for c in sorted(MIX, key=lambda c: n * MIX[c] - out[c], reverse=True)[:n - sum(out.values())]:
        out[c] += 1
    return out


def workload(n: int, seed: int, scale: float, tm: TieredModel) -> list[Request]:
    """n requests in the mix, shuffled; prompts cut from a line start in held-out stdlib source. Each is checked
    with the router's own classifier to land in its class (a cut that does not is drawn again)."""
    rng = random.Random(seed)
    texts = [t for t in (p.read_text(encoding="utf-8", errors="replace") for p in held_out_files()) if len(t) > 4000]
    kinds = [c for c, k in quotas(n).items() for _ in range(k)]
    rng.shuffle(kinds)
    out = []
    for kind in kinds:
        lo, hi, out_lo, out_hi = SHAPES[kind]
        for _ in range(1000):
            text, length = rng.choice(texts), max(1, round(rng.uniform(lo, hi) * scale))
            start = text.rfind("\n", 0, rng.randrange(len(text) - length)) + 1
            cut = text[start:start + length]
            if (end := cut.rfind("\n")) >= lo * scale:
                cut = cut[:end + 1]  # end on a whole line where that keeps the class's length
            req = Request(kind, EXPERT_ASK + cut if kind == "expert" else cut, rng.randint(out_lo, out_hi))
            got = classify(features({"prompt": req.prompt, "max_tokens": req.max_tokens}, tm.classifier.markers),
                           tm.classifier, tm.top).name
            if len(cut) >= lo * scale and cut.strip() and got == EXPECTED[kind]:
                out.append(req)
                break
        else:
            raise RuntimeError(f"no {kind} prompt found that the classifier assigns {EXPECTED[kind]}")
    return out
