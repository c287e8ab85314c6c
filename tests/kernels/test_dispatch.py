"""The dispatch layer: reference (or the C++ decode kernel) on CPU unless forced, Triton on CUDA, the same answers."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from types import ModuleType

import pytest
import torch
from kernel_helpers import assert_matches, device_gen, paged_pool, randn, small_case_runner

from kvfleet_agent.layers import attention, norm, rotary
from kvfleet_agent.layers.attention import AttentionMetadata, DecodeGroup, PagedAttention, PrefillSpan
from kvfleet_agent.layers.norm import RMSNorm
from kvfleet_agent.layers.rotary import RotaryEmbedding
from kvfleet_kernels import dispatch, reference

pytest.importorskip("triton")

Run = Callable[..., None]
INTERPRET_AT_START = os.environ.get("TRITON_INTERPRET")


@pytest.fixture(scope="module")
def small() -> Run:
    """Runs a check on the small cases: in-process on a GPU, else in Triton's interpreter (a worker process)."""
    return small_case_runner()


# ---------------------------------------------------------------------------------------------
# In this process: choosing the backend


def test_cpu_tensors_take_the_reference_unless_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(3, 4)
    monkeypatch.delenv(dispatch.FORCE_ENV, raising=False)
    assert dispatch.backend(x) == "reference"
    monkeypatch.setenv(dispatch.FORCE_ENV, "0")
    assert dispatch.backend(x) == "reference"
    monkeypatch.setenv(dispatch.FORCE_ENV, "1")
    assert dispatch.backend(x.double()) == "reference"  # no Triton kernel for float64
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):  # forced, but this process compiles Triton
        dispatch.backend(x)


def test_unforced_ops_on_cpu_match_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(dispatch.FORCE_ENV, raising=False)
    g = device_gen(torch.device("cpu"), 0)
    x, res, w = randn((4, 32), g, torch.float32), randn((4, 32), g, torch.float32), randn((32,), g, torch.float32)
    # On CPU the C++ ops (cpu_fused, cpu_attention) may run instead: the same contract, fp32 rounding apart.
    assert_matches(dispatch.rms_norm(x, w, 1e-5), reference.rms_norm(x, w, 1e-5), torch.float32)
    for a, b in zip(dispatch.add_rms_norm(x, res, w, 1e-5), reference.add_rms_norm(x, res, w, 1e-5), strict=True):
        assert_matches(a, b, torch.float32)
    qk = randn((4, 3, 16), g, torch.float32)
    cos, sin = randn((4, 16), g, torch.float32), randn((4, 16), g, torch.float32)
    assert_matches(dispatch.rotary(qk, cos, sin), reference.rotary(qk, cos, sin), torch.float32)
    assert_matches(dispatch.silu_and_mul(x.clone()), reference.silu_and_mul(x.clone()), torch.float32)
    k_cache, v_cache, tables = paged_pool([5, 20], 16, 2, 16, torch.float32, g)
    q, lens = randn((2, 4, 16), g, torch.float32), torch.tensor([5, 20])
    assert_matches(dispatch.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.25),
                   reference.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.25), torch.float32)


def test_interpreter_worker_leaves_this_process_alone(small: Run) -> None:
    small(check_dispatch_runs_triton_when_forced)  # the worker has run (or the GPU is here)
    assert os.environ.get("TRITON_INTERPRET") == INTERPRET_AT_START
    child = subprocess.run([sys.executable, "-c", "import os; print(os.environ.get('TRITON_INTERPRET'))"],
                           capture_output=True, text=True, check=True, timeout=60)
    assert child.stdout.strip() == str(INTERPRET_AT_START)
    if "triton" in sys.modules and INTERPRET_AT_START is None:  # this process's Triton still compiles
        import triton.language as tl  # type: ignore[import-untyped]
        from triton.runtime.jit import JITFunction  # type: ignore[import-untyped]

        assert isinstance(tl.zeros, JITFunction)


# ---------------------------------------------------------------------------------------------
# Through Triton (interpreter worker on CPU, compiled on a GPU)


def check_dispatch_runs_triton_when_forced(device: torch.device) -> None:
    saved_env, saved_loader = os.environ.get(dispatch.FORCE_ENV), dispatch.kernel_module
    loaded: list[str] = []

    def spy(name: str) -> ModuleType:
        loaded.append(name)
        return saved_loader(name)

    os.environ[dispatch.FORCE_ENV] = "1"
    dispatch.kernel_module = spy
    try:
        g = device_gen(device, 1)
        x, w = randn((3, 64), g, torch.float32), randn((64,), g, torch.float32)
        assert dispatch.backend(x) == ("triton" if device.type == "cuda" else "interpreter")
        assert_matches(dispatch.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6), torch.float32)
        assert loaded == ["fused"]
    finally:
        dispatch.kernel_module = saved_loader
        restore_env(dispatch.FORCE_ENV, saved_env)


def restore_env(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def check_layers_wired_to_dispatch(device: torch.device) -> None:
    """The wiring change: the layers' `reference` module swapped for dispatch gives the reference's results."""
    g = device_gen(device, 42)
    h, kvh, d, bs, dtype = 8, 2, 64, 16, torch.float32
    lengths = [9, 22, 6, 17]  # context after this step
    new = [1, 1, 6, 5]  # tokens this step: decode, decode, a whole prompt, a chunk after 12 cached tokens
    k_pool, v_pool, tables = paged_pool(lengths, bs, kvh, d, dtype, g)
    positions = torch.cat([torch.arange(n - m, n, device=device) for n, m in zip(lengths, new, strict=True)])
    seq = torch.cat([torch.full((m,), i, device=device) for i, m in enumerate(new)])
    slots = tables[seq, positions // bs] * bs + positions % bs
    decode_lens = torch.tensor(lengths[:2], device=device)
    meta = AttentionMetadata(
        slot_mapping=slots,
        decode_groups=[DecodeGroup(0, 2, tables[:2], decode_lens, max(lengths[:2]), bs)],
        prefills=[PrefillSpan(2, 6, 0, tables[2]), PrefillSpan(8, 5, 12, tables[3])],
    )
    t = sum(new)
    q, k, v = randn((t, h, d), g, dtype), randn((t, kvh, d), g, dtype), randn((t, kvh, d), g, dtype)
    hidden, residual = randn((t, 256), g, dtype), randn((t, 256), g, dtype)
    layer, rms = PagedAttention(h, kvh, d), RMSNorm(256, 1e-5).to(device)
    rms.weight.data = randn((256,), g, dtype, 0.3) + 1
    rope = RotaryEmbedding(d, 64, 1e4, None, dtype).to(device)

    def step() -> list[torch.Tensor]:
        layer.k_cache, layer.v_cache = k_pool.clone(), v_pool.clone()
        out = layer(q, k, v, meta)
        return [out, layer.k_cache, layer.v_cache, *rms(hidden), *rms(hidden, residual),
                rope(positions, torch.cat([q, k], dim=1))]

    want = step()
    saved_env = os.environ.get(dispatch.FORCE_ENV)
    os.environ[dispatch.FORCE_ENV] = "1"
    modules: list[ModuleType] = [attention, norm, rotary]
    for m in modules:
        m.reference = dispatch  # type: ignore[attr-defined]
    try:
        got = step()
    finally:
        for m in modules:
            m.reference = reference  # type: ignore[attr-defined]
        restore_env(dispatch.FORCE_ENV, saved_env)
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])  # the caches, written exactly
    for a, b in zip(got, want, strict=True):
        assert_matches(a, b, dtype)


def check_generation_through_triton(device: torch.device) -> None:
    """The tiny model's greedy tokens with the layers wired to dispatch (forced) equal the reference's."""
    import tempfile

    from llm_helpers import ENGINE_OPTIONS, PROMPTS, greedy

    from kvfleet_agent.llm import LLM
    from kvfleet_agent.models.tiny import init_tiny

    with tempfile.TemporaryDirectory() as tmp:
        llm = LLM(model=init_tiny(tmp, "llama", seed=3), **ENGINE_OPTIONS, device=device.type)
        want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy(6), use_tqdm=False)]
        saved_env = os.environ.get(dispatch.FORCE_ENV)
        os.environ[dispatch.FORCE_ENV] = "1"
        modules: list[ModuleType] = [attention, norm, rotary]
        for m in modules:
            m.reference = dispatch  # type: ignore[attr-defined]
        try:
            got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy(6), use_tqdm=False)]
        finally:
            for m in modules:
                m.reference = reference  # type: ignore[attr-defined]
            restore_env(dispatch.FORCE_ENV, saved_env)
    assert got == want


def test_generation_through_triton_matches_reference(small: Run) -> None:
    small(check_generation_through_triton)


def test_dispatch_runs_triton_when_forced(small: Run) -> None:
    small(check_dispatch_runs_triton_when_forced)


def test_layers_wired_to_dispatch_match_the_reference(small: Run) -> None:
    small(check_layers_wired_to_dispatch)
