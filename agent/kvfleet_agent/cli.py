"""kvfleet-agent command line: `serve`, `model init-tiny | train-tiny`, `generate`, `bench`, and `demo`."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from kvfleet_agent import cli_serve
from kvfleet_agent.config import KV_CACHE_DTYPES, QUANTIZATIONS

DEMO_DIR = os.path.join(os.path.expanduser("~"), ".cache", "kvfleet", "tiny-llama")
DEMO_PROMPTS = [
    "The fleet of inference servers",
    "Paged attention keeps the cache",
    "Once upon a time, a small model",
    "Kubernetes schedules every pod",
]


def _engine_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=128)
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens per step (default: 1024 on CPU, 8192 on GPU)")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--kv-cache-memory-bytes", type=int, default=None, help="KV pool budget on CPU")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    # vLLM's spellings (--[no-]enable-prefix-caching) beside kvfleet's first ones, which the operator still writes.
    for feature in ("prefix-caching", "chunked-prefill"):
        dest = "enable_" + feature.replace("-", "_")
        g.add_argument(f"--enable-{feature}", dest=dest, action=argparse.BooleanOptionalAction, default=True,
                       help="on by default")
        g.add_argument(f"--no-{feature}", dest=dest, action="store_false", help=f"same as --no-enable-{feature}")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--num-threads", type=int, default=None,
                   help="torch threads per rank (default on CPU: the usable cores, at most the pod's CPU "
                        "limit, divided among the ranks)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split the model over this many devices (one worker process per extra rank)")
    g.add_argument("--enforce-eager", action="store_true",
                   help="never capture CUDA graphs for decode steps (they cost start-up time and some memory)")
    g.add_argument("--quantization", "-q", default=None, choices=list(QUANTIZATIONS),
                   help="int8 or int4: quantize an unquantized checkpoint's linear weights on load (weight-only); "
                        "gptq, awq, compressed-tensors, fp8: a checkpoint's own format (read from its config.json)")
    g.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                   help="auto: K/V in the model's dtype; int8 or fp8 (E4M3): one byte an element with a scale per "
                        "token and head, about twice the sequences of bf16 in the same memory")
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, as vLLM: e.g. \'{"method": "ngram", "num_speculative_tokens": 3, '
                        '"prompt_lookup_max": 4}\' (or "suffix", or "draft_model" with "model": DIR); "adaptive": '
                        'false fixes k')


def _env_defaults(p: argparse.ArgumentParser) -> None:
    """Let KVFLEET_<FLAG> environment variables (for pod specs) set any flag's default."""
    for action in p._actions:
        env = "KVFLEET_" + action.dest.upper()
        if action.dest == "help" or env not in os.environ:
            continue
        raw = os.environ[env]
        if isinstance(action, argparse._StoreFalseAction | argparse._StoreTrueAction | argparse.BooleanOptionalAction):
            truthy = raw.strip().lower() in ("1", "true", "yes", "on")
            # store_false flags are "--no-X": KVFLEET_ENABLE_X=false turns the feature off
            p.set_defaults(**{action.dest: truthy})
        else:
            try:
                p.set_defaults(**{action.dest: action.type(raw) if callable(action.type) else raw})
            except ValueError:
                p.error(f"environment variable {env}={raw!r} is not a valid {action.dest}")


def _engine_options(a: argparse.Namespace) -> dict[str, object]:
    keys = ("dtype", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size",
            "kv_cache_memory_bytes", "gpu_memory_utilization", "enable_prefix_caching", "enable_chunked_prefill",
            "seed", "num_threads", "tensor_parallel_size", "enforce_eager", "speculative_config", "quantization",
            "kv_cache_dtype")
    return {k: getattr(a, k) for k in keys}


def _generate(model: str, prompts: list[str], a: argparse.Namespace) -> None:
    from kvfleet_agent import LLM, SamplingParams

    llm = LLM(model=model, **_engine_options(a))
    params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                            seed=a.sampling_seed, ignore_eos=a.ignore_eos)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=sys.stderr.isatty())
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    for o in outs:
        print(f"\n>>> {o.prompt}\n{o.outputs[0].text!r}  [{len(o.outputs[0].token_ids)} tokens, "
              f"{o.outputs[0].finish_reason}]")
    print(f"\n{len(outs)} requests, {tokens} tokens in {seconds:.2f} s: {tokens / seconds:.1f} tokens/s")


def _train_tiny(a: argparse.Namespace) -> int:
    """`model train-tiny`: needs transformers (the dev extra), which trains and writes the checkpoints."""
    import dataclasses
    import importlib.util
    import json

    if importlib.util.find_spec("transformers") is None:
        print("kvfleet-agent model train-tiny needs transformers: pip install 'kvfleet[dev]'", file=sys.stderr)
        return 2
    from kvfleet_agent.models.train_tiny import FAST, Recipe, train_pair

    recipe = FAST if a.fast else Recipe()
    if a.steps is not None:
        if a.steps < 1:
            print(f"--steps={a.steps} must be at least 1", file=sys.stderr)
            return 2
        recipe = dataclasses.replace(recipe, steps=a.steps)
    print(json.dumps(train_pair(a.dir, recipe), indent=2))
    return 0


class _Parser(argparse.ArgumentParser):
    """No abbreviated flags (`--api-k` for `--api-key`): a flag is matched whole or refused, so a rule that looks
    for one (the operator refuses `--api-key` in extraArgs) cannot be slipped past. Subcommands inherit it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **{**kwargs, "allow_abbrev": False})


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `kvfleet-agent` command."""
    # "@FILE" reads arguments from FILE, one per line: the operator mounts extraArgs too long for a pod spec that way.
    ap = _Parser(prog="kvfleet-agent", description=__doc__, fromfile_prefix_chars="@")
    ap.add_argument("--log-level", default="INFO")
    sub = ap.add_subparsers(dest="command", required=True)

    model = sub.add_parser("model", help="checkpoint utilities").add_subparsers(dest="action", required=True)
    tiny = model.add_parser("init-tiny", help="write a small random checkpoint and a locally trained tokenizer")
    tiny.add_argument("dir")
    tiny.add_argument("--arch", default="llama", choices=["llama", "llama3", "qwen2", "mistral"])
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--shards", type=int, default=1)
    trained = model.add_parser("train-tiny", help="train a small Llama target and draft on the stdlib's source "
                               "(minutes; cached in ~/.cache/kvfleet/trained) and write DIR/target, DIR/draft")
    trained.add_argument("dir")
    trained.add_argument("--fast", action="store_true", help="a much smaller pair in seconds (for tests)")
    trained.add_argument("--steps", type=int, default=None, help="training steps of each model")

    for name, help_text in (("generate", "generate from prompts through the offline API"),
                            ("demo", "make a tiny checkpoint (once) and generate from it")):
        p = sub.add_parser(name, help=help_text)
        if name == "generate":
            p.add_argument("--model", required=True, help="Hugging Face model directory")
            p.add_argument("--prompt", action="append", required=True, help="repeat for several prompts")
        else:
            p.add_argument("--dir", default=DEMO_DIR, help="where the tiny checkpoint lives")
        p.add_argument("--max-tokens", type=int, default=32)
        p.add_argument("--temperature", type=float, default=0.0)
        p.add_argument("--top-p", type=float, default=1.0)
        p.add_argument("--top-k", type=int, default=0)
        p.add_argument("--sampling-seed", type=int, default=None)
        p.add_argument("--ignore-eos", action="store_true")
        _engine_flags(p)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="action", required=True)
    from kvfleet_agent.bench import loadgen

    loadgen.add_arguments(bench.add_parser("serve", help="drive a running OpenAI-compatible server with load"))
    from kvfleet_agent.bench import offline

    offline_parser = bench.add_parser("offline", help="offline throughput of LLM.generate on random prompts")
    offline.add_arguments(offline_parser)
    _engine_flags(offline_parser)

    from kvfleet_agent.bench import spec as spec_bench

    spec_bench.add_arguments(bench.add_parser("spec", help="speculative decoding against none: decode tokens/s "
                                              "and ITL by workload, batch size and configuration"))

    serve = sub.add_parser("serve", help="serve a model over OpenAI-compatible HTTP and gRPC")
    cli_serve.add_serve_arguments(serve)
    _engine_flags(serve)
    _env_defaults(serve)

    _env_defaults(ap)  # KVFLEET_LOG_LEVEL
    a = ap.parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if a.command == "model" and a.action == "train-tiny":
            return _train_tiny(a)
        if a.command == "model":
            from kvfleet_agent.models.tiny import init_tiny

            print(init_tiny(a.dir, arch=a.arch, seed=a.seed, num_shards=a.shards))
        elif a.command == "generate":
            _generate(a.model, a.prompt, a)
        elif a.command == "serve":
            return cli_serve.run_serve(a, _engine_options(a))
        elif a.command == "bench":
            if a.action == "spec":
                return spec_bench.main(a)
            return offline.main(a, _engine_options(a)) if a.action == "offline" else loadgen.main(a)
        else:
            from kvfleet_agent.models.tiny import init_tiny

            if not os.path.exists(os.path.join(a.dir, "config.json")):
                print(f"writing a tiny random checkpoint to {a.dir}")
                init_tiny(a.dir, arch="llama", hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                          num_attention_heads=8, num_key_value_heads=4)
            a.ignore_eos = True
            print("(the checkpoint has random weights: expect fluent-looking noise, not sense)")
            _generate(a.dir, DEMO_PROMPTS, a)
    except (ValueError, FileNotFoundError, TypeError) as e:
        print(f"kvfleet-agent: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
