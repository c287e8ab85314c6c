"""Structured-output overhead: throughput and inter-token latency of a 50% constrained / 50% free batch against
an all-free one, on the same engine in the same run (`python -m kvfleet_agent.bench.structured`)."""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Sequence

from kvfleet_agent.llm import LLM
from kvfleet_agent.sampling_params import SamplingParams
from kvfleet_agent.structured_outputs import StructuredOutputs

# A constraint that never completes within the run (every row generates max_tokens), masked at every step.
_REGEX = "[a-z ,.]{4000}"
_SCHEMA_ARRAY = {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 500}


def _run(llm: LLM, params: Sequence[SamplingParams], prompt: list[int]) -> tuple[float, float, int]:
    """(tokens/s, median decode step ms, tokens) of one batch run to completion through the engine's steps."""
    engine = llm.engine
    for i, p in enumerate(params):
        engine.add_request(f"bench-{time.monotonic_ns()}-{i}", prompt, p)
    steps, tokens = [], 0
    start = time.perf_counter()
    while engine.has_unfinished():
        t = time.perf_counter()
        outs = engine.step()
        steps.append(time.perf_counter() - t)
        tokens += sum(1 for o in outs for _ in o.outputs[:1])
    wall = time.perf_counter() - start
    decode = steps[2:] or steps  # after the prefill steps: one token per row per step
    return tokens / wall, 1e3 * statistics.median(decode), tokens


def main(argv: Sequence[str] | None = None) -> None:
    """Print both runs' figures and the overhead."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", help="checkpoint directory (default: a tiny random one)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kind", choices=("regex", "json"), default="json")
    a = ap.parse_args(argv)
    model = a.model
    if model is None:
        from kvfleet_agent.models.tiny import init_tiny

        model = init_tiny(tempfile.mkdtemp(prefix="kvfleet-bench-"), arch="llama", seed=0)
    llm = LLM(model=model, max_num_seqs=max(a.batch, 1))
    spec = StructuredOutputs(regex=_REGEX) if a.kind == "regex" else StructuredOutputs(json=_SCHEMA_ARRAY)
    assert llm.engine.grammars is not None
    llm.engine.grammars.compile(spec)
    free = SamplingParams(max_tokens=a.max_tokens, ignore_eos=True, temperature=1.0)
    constrained = SamplingParams(max_tokens=a.max_tokens, temperature=1.0, structured_outputs=spec)
    prompt = [5 + i % 500 for i in range(32)]
    mixes = {"all free": [free] * a.batch,
             "50% structured": [constrained if i % 2 else free for i in range(a.batch)]}
    results: dict[str, list[tuple[float, float, int]]] = {k: [] for k in mixes}
    _run(llm, [free] * a.batch, prompt)  # warm-up
    for _ in range(a.rounds):  # interleaved, so drift in the machine's load hits both alike
        for name, params in mixes.items():
            results[name].append(_run(llm, params, prompt))
    print(f"batch {a.batch}, {a.max_tokens} tokens per request, constraint {a.kind}, {a.rounds} rounds (median)")
    base = None
    for name, runs in results.items():
        tps = statistics.median(r[0] for r in runs)
        itl = statistics.median(r[1] for r in runs)
        base = base or (tps, itl)
        print(f"{name:>15}: {tps:8.0f} tok/s   ITL {itl:6.2f} ms   "
              f"({100 * (base[0] / tps - 1):+.1f}% time per token, {100 * (itl / base[1] - 1):+.1f}% ITL)")
    llm.shutdown()


if __name__ == "__main__":
    main()
