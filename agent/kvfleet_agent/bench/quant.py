"""`python -m kvfleet_agent.bench.quant`: each weight format's held-out perplexity, greedy agreement and memory.

Every format runs in its own process (so RSS is that engine's alone) on the same checkpoint, the same
held-out windows (the standard-library files the trained pair never saw) and the same prompts:
- perplexity: exp of the mean negative log-likelihood of each window's tokens after the first, read from
  the engine's own prompt logprobs (what the engine computes, not a separate reference forward);
- greedy agreement with the fp32 run: the share of generated tokens equal up to the first difference,
  and the share of prompts whose whole continuation is identical;
- memory: the bytes the weights hold on the device and the process's RSS (current and peak).
Pre-quantized formats (a `NAME=DIR` entry) name a checkpoint directory written in that format beforehand.
A `+kv-int8` or `+kv-fp8` suffix (or `kv-int8` alone: fp32 weights) runs the engine with that KV cache dtype.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

DEFAULT_FORMATS = ("fp32", "int8", "int4")
SEQ_LEN = 128  # as the pair was trained
PROMPT_TOKENS = 32


def heldout(model_dir: str, windows: int, prompts: int) -> tuple[list[list[int]], list[list[int]]]:
    """(perplexity windows of SEQ_LEN + 1 tokens, greedy prompts of PROMPT_TOKENS) from held-out source files."""
    from tokenizers import Tokenizer

    from kvfleet_agent.models.stdlib_corpus import EOS_ID, texts
    from kvfleet_agent.models.train_tiny import Recipe

    tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    _, held = texts(Recipe().corpus_chars)
    stream = [t for enc in tok.encode_batch(held) for t in [*enc.ids, EOS_ID]]
    cut = [stream[i:i + SEQ_LEN + 1] for i in range(0, len(stream) - SEQ_LEN, SEQ_LEN)]
    if len(cut) < windows + prompts:
        raise SystemExit(f"the held-out text has {len(cut)} windows, fewer than --windows + --prompts")
    # Prompts come from windows after the perplexity ones, so no text is both scored and continued.
    return cut[:windows], [w[:PROMPT_TOKENS] for w in cut[windows:windows + prompts]]


def rss_mb() -> tuple[float, float]:
    """(current, peak) resident set of this process, MB, from /proc."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def run_one(model: str, quantization: str | None, windows: list[list[int]], prompts: list[list[int]],
            max_tokens: int, kv_cache_dtype: str = "auto") -> dict[str, Any]:
    """One engine on one format: perplexity, greedy continuations and memory."""
    from kvfleet_agent import LLM, SamplingParams
    from kvfleet_agent.llm import TokensPrompt

    start = time.perf_counter()
    # A fixed KV pool (the default is a share of RAM), so RSS differs by the weights alone.
    llm = LLM(model=model, quantization=quantization, dtype="float32", max_model_len=SEQ_LEN + max_tokens + 8,
              enable_prefix_caching=False, seed=0, kv_cache_memory_bytes=64 << 20, kv_cache_dtype=kv_cache_dtype)
    load_s = time.perf_counter() - start
    scored = llm.generate([TokensPrompt(prompt_token_ids=w) for w in windows],
                          SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    nll = [-lp.logprob for out in scored for lp in (out.prompt_logprobs or [])[1:] if lp is not None]
    greedy = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                          SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    rss, peak = rss_mb()
    runner = llm.engine.runner
    return {"quantization": quantization, "perplexity": math.exp(sum(nll) / len(nll)), "tokens_scored": len(nll),
            "weight_bytes": runner.param_bytes(), "kv_bytes_per_token": runner.bytes_per_block() / runner.block_size,
            "kv_cache_dtype": kv_cache_dtype, "rss_mb": rss, "peak_rss_mb": peak, "load_s": load_s,
            "greedy": [list(o.outputs[0].token_ids) for o in greedy]}


def agreement(ref: list[list[int]], got: list[list[int]]) -> tuple[float, float]:
    """(share of tokens equal up to each prompt's first difference, share of prompts equal throughout)."""
    prefix = 0
    for a, b in zip(ref, got, strict=True):
        n = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
        prefix += n
    total = sum(len(a) for a in ref)
    return prefix / total, sum(a == b for a, b in zip(ref, got, strict=True)) / len(ref)


def parse_format(entry: str, model: str) -> tuple[str, str, str | None, str]:
    """'int8' → (name, the model, its --quantization, 'auto'); 'gptq=DIR' → (name, DIR, None: the checkpoint says,
    'auto'); 'int8+kv-fp8' → (…, 'fp8'); 'kv-int8' → (name, the model, None: fp32 weights, 'int8')."""
    name, _, where = entry.partition("=")
    weights, _, kv = name.partition("+")
    if weights.startswith("kv-"):
        weights, kv = "fp32", weights
    kv_dtype = kv.removeprefix("kv-") if kv else "auto"
    if where:
        return name, where, None, kv_dtype
    return name, model, None if weights == "fp32" else weights, kv_dtype


def main(argv: Sequence[str] | None = None) -> int:
    """Run every format in a child process, then print the table (and write --json)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="the fp checkpoint (the trained pair's target)")
    p.add_argument("--formats", nargs="+", default=list(DEFAULT_FORMATS),
                   help="fp32, int8, int4, fp8 (on load), NAME=DIR for a checkpoint written in a format; a +kv-int8 "
                        "or +kv-fp8 suffix (kv-int8 alone: fp32 weights) quantizes the KV cache too")
    p.add_argument("--windows", type=int, default=64, help="held-out windows of 128 tokens for perplexity")
    p.add_argument("--prompts", type=int, default=64, help="prompts for greedy agreement")
    p.add_argument("--max-tokens", type=int, default=32, help="greedy tokens per prompt")
    p.add_argument("--json", metavar="OUT", help="also write the figures here")
    p.add_argument("--one", help=argparse.SUPPRESS)  # the child: DIR:QUANT:KV_DTYPE, prints its JSON
    a = p.parse_args(argv)
    windows, prompts = heldout(a.model, a.windows, a.prompts)
    if a.one:
        model, quant, kv_dtype = a.one.rsplit(":", 2)
        print(json.dumps(run_one(model, quant or None, windows, prompts, a.max_tokens, kv_dtype)))
        return 0
    results: dict[str, dict[str, Any]] = {}
    for entry in tqdm(a.formats, desc="formats", unit="format"):
        name, model, quant, kv_dtype = parse_format(entry, a.model)
        child = [sys.executable, "-m", "kvfleet_agent.bench.quant", "--model", a.model, "--windows", str(a.windows),
                 "--prompts", str(a.prompts), "--max-tokens", str(a.max_tokens), "--one",
                 f"{model}:{quant or ''}:{kv_dtype}"]
        done = subprocess.run(child, capture_output=True, text=True, check=False)
        if done.returncode:
            raise SystemExit(f"format {name} failed:\n{done.stderr[-3000:]}")
        results[name] = json.loads(done.stdout.strip().splitlines()[-1])
    base = results.get("fp32") or next(iter(results.values()))
    print(f"held-out: {a.windows} windows x {SEQ_LEN} tokens; greedy: {a.prompts} prompts x {a.max_tokens} tokens")
    print(f"{'format':<12} {'perplexity':>10} {'vs fp32':>8} {'agree tok':>9} {'agree seq':>9} "
          f"{'weights MB':>10} {'KV B/tok':>8} {'RSS MB':>7} {'peak MB':>7}")
    for name, r in results.items():
        tok, seq = agreement(base["greedy"], r["greedy"])
        r["agreement_tokens"], r["agreement_sequences"] = tok, seq
        r["perplexity_vs_fp32"] = r["perplexity"] / base["perplexity"] - 1
        print(f"{name:<12} {r['perplexity']:>10.3f} {r['perplexity_vs_fp32'] * 100:>+7.2f}% {tok * 100:>8.1f}% "
              f"{seq * 100:>8.1f}% {r['weight_bytes'] / 1e6:>10.2f} {r['kv_bytes_per_token']:>8.0f} "
              f"{r['rss_mb']:>7.0f} {r['peak_rss_mb']:>7.0f}")
    if a.json:
        Path(a.json).write_text(json.dumps({"formats": results, "argv": list(argv or sys.argv[1:])}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
