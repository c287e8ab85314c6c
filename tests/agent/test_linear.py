"""The CPU GEMM fast path (oneDNN-prepacked weights, fp32 results, used after loading) and rank shards of linears."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable

import pytest
import torch

from kvfleet_agent import LLM, SamplingParams
from kvfleet_agent.layers import gemm_crossover
from kvfleet_agent.layers import linear as linear_module
from kvfleet_agent.layers.gemm_crossover import KEEP_DENSE_MAX, NEVER
from kvfleet_agent.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    RowParallelLinear,
    can_pack,
    linear,
    native_bf16,
    pack,
)
from kvfleet_agent.layers.tp_group import TPGroup
from kvfleet_agent.models.config import ModelConfig
from kvfleet_agent.models.llama import LlamaForCausalLM
from kvfleet_agent.models.loader import load_weights
from kvfleet_kernels import cpu_f32

pytestmark = pytest.mark.skipif(not can_pack(torch.empty(1, 1)), reason="this torch build has no oneDNN")


@pytest.mark.parametrize("rows", [1, 3, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_is_fp32_accurate(rows: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 96, generator=g), torch.randn(200, 96, generator=g)
    b = torch.randn(200, generator=g) if bias else None
    want = x.double() @ w.double().t() + (b.double() if b is not None else 0)
    got = linear(x, w, b, packed=pack(w))
    assert got.dtype == torch.float32 and got.shape == (rows, 200)
    # fp32 accuracy (a bf16 shortcut would be off by ~1e-2 here)
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-5)


def test_packed_linear_takes_a_strided_input() -> None:
    g = torch.Generator().manual_seed(7)
    wide, w = torch.randn(8, 160, generator=g), torch.randn(40, 96, generator=g)
    x = wide[:, 32:128]  # rows not contiguous, as for a q/k/v slice of a packed projection
    torch.testing.assert_close(linear(x, w, packed=pack(w)), x @ w.t(), atol=1e-4, rtol=1e-5)


def test_loaded_fp32_model_uses_packed_weights_and_bf16_only_where_native(tiny_checkpoint: Callable[..., str]) -> None:
    path = tiny_checkpoint("qwen2")
    model = LLM(model=path, dtype="float32").engine.runner.model
    linears = [m for m in model.modules() if hasattr(m, "pack_weights")]
    assert linears and all(getattr(m, "packed", None) is not None for m in linears)
    model16 = LLM(model=path, dtype="bfloat16").engine.runner.model
    packed16 = [getattr(m, "packed", None) is not None for m in model16.modules() if hasattr(m, "pack_weights")]
    assert packed16 and all(p == native_bf16() for p in packed16)


@pytest.mark.skipif(not native_bf16(), reason="this CPU has no native bfloat16 matmul (AMX or AVX512-BF16)")
@pytest.mark.parametrize("rows", [1, 5, 64, 300])
def test_packed_bf16_linear_equals_f_linear_bit_for_bit(rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 256, generator=g).bfloat16(), torch.randn(200, 256, generator=g).bfloat16()
    b = torch.randn(200, generator=g).bfloat16()
    got = linear(x, w, b, packed=pack(w))
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, torch.nn.functional.linear(x, w, b))


@pytest.mark.skipif(not native_bf16(), reason="this CPU has no native bfloat16 matmul (AMX or AVX512-BF16)")
def test_a_bf16_model_generates_the_same_tokens_packed_and_unpacked(tiny_checkpoint: Callable[..., str],
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    path = tiny_checkpoint("llama")
    prompts = [{"prompt_token_ids": [3 + i, 17, 40 + 2 * i, 9]} for i in range(4)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    packed = [o.outputs[0].token_ids for o in LLM(model=path, dtype="bfloat16").generate(prompts, params)]
    monkeypatch.setattr(linear_module, "native_bf16", lambda: False)
    plain_llm = LLM(model=path, dtype="bfloat16")
    assert all(getattr(m, "packed", None) is None for m in plain_llm.engine.runner.model.modules())
    assert packed == [o.outputs[0].token_ids for o in plain_llm.generate(prompts, params)]


def _rank_model(path: str, rank: int, size: int) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """A rank's model, prepacked, and its parameters as loaded (packing leaves the linears' weights on meta)."""
    cfg = ModelConfig.from_dir(path)
    model = LlamaForCausalLM(cfg, 64, torch.float32, TPGroup(rank, size))
    load_weights(model, path)
    loaded = {name: p.detach().clone() for name, p in model.named_parameters()}
    for m in model.modules():
        if hasattr(m, "pack_weights"):
            m.pack_weights()
    return model, loaded


def test_rank_shards_reassemble_the_full_weights_and_each_is_prepacked(tiny_checkpoint: Callable[..., str]) -> None:
    """Column shards stack along outputs (per packed part), row shards along inputs, vocab shards along rows."""
    path = tiny_checkpoint("qwen2", vocab_size=771)  # q/k/v biases, tied embeddings, an odd vocabulary
    full = _rank_model(path, 0, 1)[1]
    built = [_rank_model(path, r, 2) for r in range(2)]
    ranks, shards = [m for m, _ in built], [loaded for _, loaded in built]
    assert shards[0].keys() == full.keys()
    for name, want in full.items():
        parts = [s[name] for s in shards]
        if "qkv_proj" in name or "gate_up_proj" in name:  # each rank holds [q_r; k_r; v_r] (or [gate_r; up_r])
            sizes = ranks[0].get_submodule(name.rpartition(".")[0]).out_sizes
            pieces = [p.split(sizes) for p in parts]
            got = torch.cat([torch.cat([pieces[r][i] for r in range(2)]) for i in range(len(sizes))])
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            got = torch.cat(parts, dim=1)
        elif "embed_tokens" in name or "lm_head" in name:
            assert [p.shape[0] for p in parts] == [386, 385]
            got = torch.cat(parts)
        else:  # norms: replicated
            assert torch.equal(parts[0], parts[1])
            got = parts[0]
        assert torch.equal(got, want), name
    x = torch.randn(5, 256)  # wide enough for every layer's inputs; a column slice of it is strided, as in the model
    for name, m in ranks[1].named_modules():
        if isinstance(m, ColumnParallelLinear | MergedColumnParallelLinear | RowParallelLinear):
            assert m.packed is not None
            # The packed weight, and a small one's few-row copy: the tiles (the dense weight then goes) or, without
            # the cpu_f32 kernel, the dense weight for F.linear.
            assert m.weight.is_meta == (m.few_below == NEVER or m.tiles is not None)
            w = shards[1][f"{name}.weight"]
            for rows in (1, 5):  # the few-row path if there is one (and the packed one where its crossover is low)
                y = m.matmul(x[:rows, :w.shape[1]], m.bias)
                torch.testing.assert_close(y, torch.nn.functional.linear(x[:rows, :w.shape[1]], w, m.bias),
                                           atol=1e-4, rtol=1e-5)


def require_tiles_kernel() -> None:
    """The cpu_f32 kernel: skipped without a compiler or where it is switched off, else it must have built."""
    if shutil.which(os.environ.get("CXX", "c++")) is None or os.environ.get(cpu_f32.ENABLE_ENV) == "0":
        pytest.skip("no cpu_f32 kernel here: the F.linear case covers the few-row path")
    assert cpu_f32.available(), "a compiler is present but the cpu_f32 kernel did not build: see the log"


@pytest.mark.parametrize("tiles", [True, False], ids=["cpu_f32-tiles", "f-linear"])
def test_a_small_weight_runs_its_few_row_path_below_its_crossover_and_a_large_one_keeps_one_copy(
        monkeypatch: pytest.MonkeyPatch, tiles: bool) -> None:
    # The crossover is a timing (which path wins depends on the machine): fixed here at 4 rows, so that both paths
    # are taken and checked against the reference whatever this machine measures.
    if tiles:
        require_tiles_kernel()
    else:
        monkeypatch.setattr(cpu_f32, "available", lambda: False)
    monkeypatch.setattr(gemm_crossover, "_measured", {})
    monkeypatch.setattr(gemm_crossover, "_measure", lambda *_: 4)
    small, large = ColumnParallelLinear(128, 256, bias=True), ColumnParallelLinear(1024, KEEP_DENSE_MAX // 1024 + 1)
    for m in (small, large):
        torch.nn.init.normal_(m.weight)
        if m.bias is not None:
            torch.nn.init.normal_(m.bias)
    dense = small.weight.detach().clone()
    small.pack_weights()
    large.pack_weights()
    assert large.few_below == NEVER and large.weight.is_meta, "a large weight must not be held twice"
    assert large.tiles is None
    assert small.few_below == 4 and (small.tiles is not None) == tiles
    assert small.weight.is_meta == tiles, "the tiles replace the dense copy; F.linear needs it"
    for shape in [(1,), (3,), (4,), (100,), (2, 1), (1, 3)]:  # a leading batch dimension reaches it too
        x = torch.randn(*shape, 128)
        torch.testing.assert_close(small(x), torch.nn.functional.linear(x, dense, small.bias), atol=1e-4, rtol=1e-5)


def test_the_measured_crossover_is_a_row_count_and_is_measured_once_per_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gemm_crossover, "_measured", {})
    w = torch.randn(96, 64)
    packed = pack(w)
    first = gemm_crossover.crossover(w, lambda x: linear(x, w, None, packed), lambda x: x @ w.T, "matmul")
    assert first in (*gemm_crossover.ROWS, 2 * gemm_crossover.ROWS[-1])
    monkeypatch.setattr(gemm_crossover, "_measure", lambda *_: pytest.fail("measured twice"))
    assert gemm_crossover.crossover(w, lambda x: linear(x, w, None, packed), lambda x: x @ w.T, "matmul") == first


def test_a_pinned_crossover_is_not_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    """KVFLEET_GEMM_CROSSOVER fixes the rows (reproducible kernels whatever the load); a bad value names the fix."""
    monkeypatch.setattr(gemm_crossover, "_measure", lambda *_: pytest.fail("measured though pinned"))
    w = torch.randn(96, 64)
    monkeypatch.setenv(gemm_crossover.PIN_ENV, "12")
    assert gemm_crossover.crossover(w, lambda x: x, lambda x: x, "matmul") == 12
    assert gemm_crossover.crossover(torch.randn(KEEP_DENSE_MAX + 1, 1), lambda x: x, lambda x: x, "m") == NEVER
    monkeypatch.setenv(gemm_crossover.PIN_ENV, "eight")
    with pytest.raises(ValueError, match="KVFLEET_GEMM_CROSSOVER='eight'"):
        gemm_crossover.crossover(w, lambda x: x, lambda x: x, "matmul")
