"""Offline throughput (`kvfleet-agent bench offline`): N random-token prompts through LLM.generate, tokens/s."""

from __future__ import annotations

import argparse
import json
import random
import time
from typing import Any


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The workload options of `kvfleet-agent bench offline` (the engine's come from the CLI)."""
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=64, help="prompt tokens (random ids)")
    p.add_argument("--output-len", type=int, default=64, help="generated tokens per request (EOS ignored)")
    p.add_argument("--prompt-seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text lines")


def run(a: argparse.Namespace, engine_options: dict[str, Any]) -> dict[str, float]:
    """Load the model, generate once to warm up, then time one generate() call over every prompt."""
    from kvfleet_agent import LLM, SamplingParams

    start = time.perf_counter()
    with LLM(model=a.model, **engine_options) as llm:
        load_s = time.perf_counter() - start
        vocab = llm.engine.model_config.vocab_size
        rng = random.Random(a.prompt_seed)
        prompts: list[Any] = [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(a.input_len)]}
                              for _ in range(a.num_prompts)]
        params = SamplingParams(max_tokens=a.output_len, temperature=0.0, ignore_eos=True)
        llm.generate(prompts[:2], params, use_tqdm=False)  # first-call costs out of the timing
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"tensor_parallel_size": float(engine_options.get("tensor_parallel_size", 1)), "load_s": load_s,
            "requests": float(len(outs)), "seconds": seconds, "output_tokens_per_s": generated / seconds,
            "total_tokens_per_s": (generated + a.num_prompts * a.input_len) / seconds}


def main(a: argparse.Namespace, engine_options: dict[str, Any]) -> int:
    """Run the benchmark and print its figures."""
    r = run(a, engine_options)
    if a.json:
        print(json.dumps(r))
    else:
        print(f"tp={r['tensor_parallel_size']:.0f} requests={r['requests']:.0f} in={a.input_len} out={a.output_len} "
              f"load={r['load_s']:.1f}s time={r['seconds']:.2f}s output_tok/s={r['output_tokens_per_s']:.1f} "
              f"total_tok/s={r['total_tokens_per_s']:.1f}")
    return 0
