"""bench vllm_online's pieces that run without vLLM: the tokenizer it gives a random checkpoint, and its table."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer

from kvfleet_agent.bench.vllm_online import GENERATORS, METRICS, load_seeds, table, write_tokenizer
from kvfleet_agent.bench.workload import LengthDist, synthetic_requests


def test_every_id_of_the_model_decodes_to_text(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 5000}))
    write_tokenizer(str(tmp_path))
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert tok.get_vocab_size() == 5000
    assert tok.decode([4999]) == "<t4999>" and tok.token_to_id("<t4500>") == 4500
    assert tok.decode(tok.encode("def f(x): return x").ids) == "def f(x): return x"  # the BPE itself is kept


def test_the_table_puts_the_servers_side_by_side_with_vllms_over_kvfleets() -> None:
    fig = {m: 10.0 for m in (*METRICS, "output_tps", "completed")}
    results = {"kvfleet": {f"{g}@2.0": dict(fig) for g in GENERATORS},
               "vllm": {f"{g}@2.0": {**fig, "itl_p50": 15.0} for g in GENERATORS}}
    lines = table(results, [2.0]).splitlines()
    itl = [ln for ln in lines if "itl_p50" in ln]
    assert len(itl) == len(GENERATORS) and all(ln.rstrip().endswith("1.50x") for ln in itl)


def test_every_load_sends_prompts_of_its_own() -> None:
    """One seed for every load re-sent the first load's prompts, and the servers' prefix caches answered the later
    rates: each load (and the warm-up) has its own seed, so its own prompts."""
    seeds = load_seeds(1, [1.0, 2.0, 4.0])
    assert len(seeds) == 1 + 3 * len(GENERATORS) == len(set(seeds.values()))
    assert load_seeds(1, [1.0, 2.0, 4.0]) == seeds  # the same for both servers
    first = {s: next(synthetic_requests(s, LengthDist(128, 128, 128), LengthDist(64, 64, 64))).prompt
             for s in seeds.values()}
    assert len(set(first.values())) == len(seeds)
