"""`kvfleet-agent bench spec`: speculative decoding against none, in one run: decode tokens/s and ITL p50/p99 per
workload (edit code, free code, long generations), batch size and configuration, on the trained pair."""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from tqdm import tqdm

from kvfleet_agent.engine.llm_engine import LLMEngine
from kvfleet_agent.llm import LLM
from kvfleet_agent.models.stdlib_corpus import is_eval, source_files
from kvfleet_agent.sampling_params import SamplingParams

WORKLOADS = ("edit", "code", "long")
MAX_TOKENS = {"edit": 64, "code": 64, "long": 384}


@dataclass(frozen=True)
class Cell:
    """One workload x batch x configuration, over the rounds: medians of decode tokens/s and ITL percentiles, and
    the median over rounds of its tokens/s as a ratio to `off` in the same round (None without `off`)."""

    workload: str
    batch: int
    config: str
    decode_tps: float
    vs_off: float | None
    itl_p50_ms: float
    itl_p99_ms: float
    mean_accepted_length: float | None


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The bench's flags."""
    p.add_argument("--model", help="target checkpoint (default: the train-tiny target, trained once and cached)")
    p.add_argument("--draft", help="draft checkpoint sharing the target's vocabulary (default: the train-tiny draft)")
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    p.add_argument("--batch", nargs="+", type=int, default=[1, 4, 16, 64])
    p.add_argument("--configs", nargs="+", default=["off", "ngram", "draft"],
                   help="off, ngram, suffix, draft (adaptive; off, ngram and draft are the default) and ngram-fixed, "
                        "suffix-fixed, draft-fixed (adaptive off)")
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup-rounds", type=int, default=1,
                   help="rounds run first and not counted: the engines warm up and the adaptive switch learns each "
                        "batch size once, as a long-lived server does once")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--json", help="write every cell here")


class Prompts:
    """The prompts of a run, round by round: runs of consecutive non-blank lines from the held-out standard-library
    files, 6 for `edit` (the snippet, a blank line and its first line again: the answer may repeat the prompt, prompt
    lookup's case), 3 for `code` and `long`. Within a round no source line serves two prompts, whatever their
    workload, and no text repeats.

    Suffix decoding keeps earlier outputs, which the bench clears at each round's start: a prompt served before, or
    one sharing most of its lines (overlapping windows, or `code` and `long` alike), would find its own greedy answer
    there. The held-out files' 64 paragraphs, the prompts' source until session 19, repeated within every round."""

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)
        self._windows = {n: _windows(n) for n in (6, 3)}
        self.new_round()

    def new_round(self) -> None:
        """Every window available again, in a new order."""
        self._order = {n: self._rng.sample(ws, len(ws)) for n, ws in self._windows.items()}
        self._used_lines: set[tuple[int, int]] = set()
        self._used_texts: set[str] = set()

    def take(self, workload: str, n: int) -> list[str]:
        """The round's next n prompts of a workload."""
        size = 6 if workload == "edit" else 3
        order, out = self._order[size], list[str]()
        while len(out) < n and order:
            text, where, first = order.pop()
            lines = {(where, first + i) for i in range(size)}
            if text in self._used_texts or lines & self._used_lines:
                continue
            self._used_texts.add(text)
            self._used_lines |= lines
            out.append(f"{text}\n\n{text.splitlines()[0]}" if workload == "edit" else f"{text}\n")
        if len(out) < n:
            raise RuntimeError(f"bench spec: the held-out files give no more distinct {workload!r} prompts this round; "
                               "use smaller --batch sizes")
        return out


def _windows(lines: int) -> list[tuple[str, int, int]]:
    """Every run of `lines` consecutive non-blank lines (under 600 characters) in the held-out files but the
    generated `encodings` charmap tables (data, not code), with its file's index and first line. No newline follows
    an edit prompt's repeated line: the tokenizer merges a newline with the next line's indent, so the copy
    continues from where the snippet's own tokens did."""
    out = []
    held = [p for p in source_files() if is_eval(p) and "encodings" not in p.parts]
    for where, path in enumerate(held):
        try:
            text = path.read_text(encoding="utf-8").splitlines()
        except (UnicodeDecodeError, OSError):
            continue
        for i in range(len(text) - lines + 1):
            window = text[i:i + lines]
            if all(line.strip() for line in window) and sum(map(len, window)) < 600:
                out.append(("\n".join(window), where, i))
    return out


def spec_config(name: str, draft: str, k: int) -> dict[str, Any] | None:
    """The --speculative-config of a configuration name."""
    if name == "off":
        return None
    method, _, fixed = name.partition("-")
    base: dict[str, Any] = {"num_speculative_tokens": k, "adaptive": fixed != "fixed"}
    if method == "ngram":
        return {**base, "method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 4}
    if method == "suffix":
        return {**base, "method": "suffix"}
    return {**base, "method": "draft_model", "model": draft}


@dataclass
class Run:
    """What one or more batches of a cell delivered in a round: decode tokens and their seconds (from the step where
    every request of a batch has its first token to its last step), every token's ITL, the tokens generated (equal
    across configurations: greedy), and the verifications and accepted drafts."""

    decoded: int = 0
    seconds: float = 0.0
    itl: list[float] = field(default_factory=list)
    tokens: int = 0
    drafts: int = 0
    accepted: int = 0

    @property
    def tps(self) -> float:
        """Decode tokens per second."""
        return self.decoded / max(self.seconds, 1e-9)

    def add(self, other: Run) -> None:
        """Pool another batch's run into this one."""
        self.decoded += other.decoded
        self.seconds += other.seconds
        self.itl += other.itl
        self.tokens += other.tokens
        self.drafts += other.drafts
        self.accepted += other.accepted


def measure(engines: dict[str, LLM], batch: list[str], max_tokens: int, turn: int = 0) -> dict[str, Run]:
    """Run one batch to the end on every configuration's engine, their steps interleaved: one step of each engine in
    turn, the order rotated every step (`turn` offsets it), so that all meet the machine's drift alike (its speed
    swings by tens of percent within seconds: batch by batch, a cell's rounds still disagreed by +-15%). Each engine
    keeps its own clock, the sum of its steps' times: decode tokens are those delivered once every request has its
    first, over the clock from then to its last step; a token's ITL is its engine's clock since the request's last
    token, spread over the tokens the step delivered (3 tokens in 30 ms count 10 ms each)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    names = list(engines)
    runs = {c: _Progress(engines[c].engine, batch, params) for c in names}
    step = turn
    while any(p.engine.has_unfinished() for p in runs.values()):
        k = step % len(names)
        for c in names[k:] + names[:k]:
            runs[c].step()
        step += 1
    return {c: p.result() for c, p in runs.items()}


class _Progress:
    """One engine's run of a batch in `measure`: its clock, each request's tokens so far and the time of its last."""

    def __init__(self, engine: LLMEngine, batch: list[str], params: SamplingParams) -> None:
        self.engine = engine
        self.before = engine.stats().spec
        self.ids = [f"b{i}-{time.monotonic_ns()}" for i in range(len(batch))]
        for rid, prompt in zip(self.ids, batch, strict=True):
            engine.add_request(rid, prompt, params)
        self.clock = 0.0
        self.first_all: float | None = None
        self.last: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self.run = Run()

    def step(self) -> None:
        """One engine step, timed, and what it delivered."""
        if not self.engine.has_unfinished():
            return
        start = time.perf_counter()
        outs = self.engine.step()
        self.clock += time.perf_counter() - start
        for out in outs:
            n = len(out.outputs[0].token_ids) - self.counts.get(out.request_id, 0)
            if n <= 0:
                continue
            if out.request_id in self.last:
                self.run.itl += [(self.clock - self.last[out.request_id]) / n] * n
            if self.first_all is not None:
                self.run.decoded += n
            self.counts[out.request_id] = len(out.outputs[0].token_ids)
            self.last[out.request_id] = self.clock
        if self.first_all is None and len(self.last) == len(self.ids):
            self.first_all = self.clock

    def result(self) -> Run:
        """The run, with the verifications and accepted drafts the engine counted meanwhile."""
        spec = self.engine.stats().spec
        if spec is not None and self.before is not None:
            self.run.drafts = spec.num_drafts - self.before.num_drafts
            self.run.accepted = spec.num_accepted_tokens - self.before.num_accepted_tokens
        self.run.seconds = self.clock - (self.first_all or self.clock)
        self.run.tokens = sum(self.counts.values())
        return self.run


def repeats(batch: int) -> int:
    """Batches per cell and round, one after another: a step's time jitters by tens of percent here, so what a cell
    measures is its number of steps, not tokens. One batch of 16 or 64 is a few dozen steps: an engine whose
    speculation was held off read 0.94-1.04x of `off` over five such rounds; batch 1 runs eight (a single 64-token
    request is too short), larger batches four."""
    return max(4, 8 // batch)


def run(a: argparse.Namespace) -> list[Cell]:
    """Every cell, the configurations interleaved step by step within each batch (`measure`; the order rotated per
    batch and round); one engine per configuration, kept across workloads and batch sizes."""
    model, draft = a.model, a.draft
    if model is None or draft is None:
        from kvfleet_agent.models.train_tiny import train_pair

        where = tempfile.mkdtemp(prefix="kvfleet-pair-")
        train_pair(where)
        model, draft = model or f"{where}/target", draft or f"{where}/draft"
    engines = {c: LLM(model=model, speculative_config=spec_config(c, draft, a.k), max_num_seqs=max(a.batch),
                      max_model_len=1024, num_threads=a.num_threads) for c in a.configs}
    samples: dict[tuple[str, int, str], list[Run]] = {}
    tokens: dict[tuple[str, int], set[int]] = {}
    # Smallest batches first, as the adaptive switch meets them (run largest first, a draft model's batch-1 bucket
    # took the batch-4 verdict, off, and never explored its way back: `code`/1 read 0.97x for 1.61x). So a round's
    # first cell meets an empty suffix cache, the round's later ones a cache of its earlier prompts' answers.
    cells = [(w, b) for w in a.workloads for b in a.batch]
    pool = Prompts(a.seed)
    bar = tqdm(total=(a.warmup_rounds + a.rounds) * len(cells) * len(engines), desc="bench spec", unit="cell")
    for r in range(-a.warmup_rounds, a.rounds):
        pool.new_round()
        for llm in engines.values():
            if llm.engine.speculator is not None:
                llm.engine.speculator.reset_shared_outputs()  # no round finds an earlier round's answers
        for w, b in cells:
            ps = pool.take(w, b * repeats(b))
            pooled = {c: Run() for c in engines}
            for n, i in enumerate(range(0, len(ps), b)):
                for c, got in measure(engines, ps[i:i + b], MAX_TOKENS[w], turn=n + r).items():
                    pooled[c].add(got)
            for c in engines:
                if r >= 0:
                    samples.setdefault((w, b, c), []).append(pooled[c])
                    tokens.setdefault((w, b), set()).add(pooled[c].tokens)
                bar.update()
    bar.close()
    # Greedy: every configuration must have generated the very same number of tokens in each cell.
    assert all(len(n) == 1 for n in tokens.values()), tokens
    return summarize(samples)


def summarize(samples: dict[tuple[str, int, str], list[Run]]) -> list[Cell]:
    """Each (workload, batch, configuration)'s rounds as a Cell."""
    out = []
    for (w, b, c), runs in samples.items():
        itl_all = sorted(x for run in runs for x in run.itl)
        drafts, accepted = sum(r.drafts for r in runs), sum(r.accepted for r in runs)
        # Paired by round: the machine's speed drifts between rounds far more than between the configurations of
        # one round, which run back to back on the same prompts.
        off = samples.get((w, b, "off"))
        vs_off = statistics.median(r.tps / o.tps for r, o in zip(runs, off, strict=True)) if off else None
        out.append(Cell(w, b, c, statistics.median(r.tps for r in runs), vs_off, 1000 * _pct(itl_all, 0.5),
                        1000 * _pct(itl_all, 0.99), 1 + accepted / drafts if drafts else None))
    return out


def _pct(xs: Sequence[float], q: float) -> float:
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def table(cells: list[Cell]) -> str:
    """The cells as a table, with each configuration's decode tokens/s as a ratio to `off` in the same cell (the
    median of the rounds' paired ratios)."""
    lines = [f"{'workload':8} {'batch':>5} {'config':12} {'decode tok/s':>12} {'vs off':>7} {'ITL p50 ms':>10} "
             f"{'ITL p99 ms':>10} {'acc. len':>8}"]
    for c in sorted(cells, key=lambda c: (WORKLOADS.index(c.workload), c.batch, c.config)):
        ratio = c.vs_off if c.vs_off is not None else float("nan")
        acc = f"{c.mean_accepted_length:.2f}" if c.mean_accepted_length else "-"
        lines.append(f"{c.workload:8} {c.batch:5d} {c.config:12} {c.decode_tps:12.1f} {ratio:6.2f}x "
                     f"{c.itl_p50_ms:10.2f} {c.itl_p99_ms:10.2f} {acc:>8}")
    return "\n".join(lines)


def main(a: argparse.Namespace) -> int:
    """Run, print the table, write the JSON."""
    cells = run(a)
    print(f"{platform.processor() or platform.machine()}, rounds {a.rounds} after {a.warmup_rounds} not counted, "
          f"k {a.k}; decode tokens/s medians, 'vs off' the median of per-round ratios")
    print(table(cells))
    if a.json:
        with open(a.json, "w") as f:
            json.dump([asdict(c) for c in cells], f, indent=2)
    return 0
