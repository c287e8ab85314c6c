"""spec_from_config on config.json quantization_config snippets as the Hub has them, and --quantization."""

from __future__ import annotations

from typing import Any

import pytest

from kvfleet_agent.layers.quant.formats import is_ignored, quant_suffixes, split_name
from kvfleet_agent.layers.quant.spec import QuantSpec, spec_from_config

# as AutoGPTQ / TheBloke wrote them
GPTQ_V1: dict[str, Any] = {
    "bits": 4, "group_size": 128, "damp_percent": 0.1, "desc_act": True, "sym": True, "true_sequential": True,
    "model_name_or_path": None, "model_file_base_name": "model", "quant_method": "gptq"}
# as GPTQModel writes them
GPTQ_MODEL: dict[str, Any] = {
    "bits": 8, "checkpoint_format": "gptq_v2", "desc_act": False, "dynamic": {"-:.*mlp\\.gate$": {}},
    "group_size": -1, "lm_head": False, "pack_dtype": "int32", "quant_method": "gptq", "sym": False,
    "meta": {"quantizer": ["gptqmodel:2.2.0"], "static_groups": False, "damp_percent": 0.01}}
AWQ: dict[str, Any] = {
    "bits": 4, "group_size": 128, "modules_to_not_convert": ["visual"], "quant_method": "awq", "version": "gemm",
    "zero_point": True}
AWQ_LEGACY: dict[str, Any] = {
    "quant_method": "awq", "zero_point": True, "q_group_size": 64, "w_bit": 4, "version": "GEMM"}
W4A16: dict[str, Any] = {
    "config_groups": {"group_0": {
        "input_activations": None, "output_activations": None, "targets": ["Linear"],
        "weights": {"actorder": "group", "block_structure": None, "dynamic": False, "group_size": 128, "num_bits": 4,
                    "observer": "minmax", "observer_kwargs": {}, "strategy": "group", "symmetric": False,
                    "type": "int"}}},
    "format": "pack-quantized", "global_compression_ratio": 1.89, "ignore": ["lm_head"], "kv_cache_scheme": None,
    "quant_method": "compressed-tensors", "quantization_status": "compressed", "sparsity_config": {}}
FP8_DYNAMIC: dict[str, Any] = {
    "config_groups": {"group_0": {
        "input_activations": {"dynamic": True, "num_bits": 8, "strategy": "token", "symmetric": True, "type": "float"},
        "targets": ["Linear"],
        "weights": {"dynamic": False, "num_bits": 8, "strategy": "channel", "symmetric": True, "type": "float"}}},
    "format": "float-quantized", "ignore": ["re:.*lm_head", "re:.*mlp.gate$"], "quant_method": "compressed-tensors",
    "quantization_status": "compressed", "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor"}}
FP8_BLOCK: dict[str, Any] = {
    "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}


def parse(q: Any, cli: str | None = None) -> QuantSpec | None:
    """spec_from_config on a config.json holding this quantization_config."""
    return spec_from_config({"model_type": "llama", "hidden_size": 4096, "quantization_config": q}, cli)


def with_(base: dict[str, Any], **changes: Any) -> dict[str, Any]:
    """A copy of a snippet with some keys changed."""
    return {**base, **changes}


def ct_weights(**changes: Any) -> dict[str, Any]:
    """The W4A16 snippet with its weight args changed."""
    group = W4A16["config_groups"]["group_0"]
    return with_(W4A16, config_groups={"group_0": {**group, "weights": {**group["weights"], **changes}}})


def test_fp_checkpoint_and_on_load_methods() -> None:
    assert spec_from_config({"model_type": "llama"}, None) is None
    assert parse({}) is None and parse(None) is None
    int8 = spec_from_config({}, "int8")
    assert int8 == QuantSpec(method="int8", bits=8, group_size=-1, symmetric=True) and int8.on_load
    int4 = spec_from_config({}, "int4")
    assert int4 is not None and (int4.bits, int4.group_size, int4.symmetric, int4.on_load) == (4, 128, False, True)
    assert quant_suffixes(int4) == () and split_name("model.layers.0.mlp.up_proj.weight", int4) is None


def test_gptq_configs() -> None:
    s = parse(GPTQ_V1)
    assert s == QuantSpec(method="gptq", bits=4, group_size=128, symmetric=True, act_order=True, format="gptq",
                          weight_strategy="group")
    assert not s.on_load
    m = parse(GPTQ_MODEL)
    assert m is not None and (m.bits, m.group_size, m.symmetric, m.format) == (8, -1, False, "gptq_v2")
    assert is_ignored("model.layers.3.mlp.gate", m) and not is_ignored("model.layers.3.mlp.gate_proj", m)


def test_awq_configs() -> None:
    s = parse(AWQ)
    assert s is not None and (s.method, s.bits, s.group_size, s.symmetric, s.format) == ("awq", 4, 128, False, "gemm")
    assert is_ignored("visual.blocks.0.attn.qkv", s) and not is_ignored("model.layers.0.self_attn.q_proj", s)
    legacy = parse(AWQ_LEGACY)
    assert legacy is not None and (legacy.group_size, legacy.ignore) == (64, ())
    assert quant_suffixes(legacy) == ("qweight", "qzeros", "scales")


def test_compressed_tensors_configs() -> None:
    s = parse(W4A16)
    assert s == QuantSpec(method="compressed-tensors", bits=4, group_size=128, symmetric=False, act_order=True,
                          ignore=("lm_head",), format="pack-quantized", weight_strategy="group")
    assert split_name("model.layers.0.mlp.down_proj.weight_packed", s) == ("model.layers.0.mlp.down_proj",
                                                                           "weight_packed")
    assert split_name("lm_head.weight", s) is None and split_name("model.embed_tokens.weight", s) is None
    f = parse(FP8_DYNAMIC)
    assert f is not None and (f.bits, f.fp8, f.weight_strategy, f.activation_scheme) == (8, True, "channel", "dynamic")
    assert f.kv_cache_scales and is_ignored("lm_head", f) and is_ignored("model.layers.1.mlp.gate", f)
    assert not is_ignored("model.layers.1.mlp.gate_proj", f)
    assert parse(W4A16, "compressed-tensors") == s and parse(W4A16, "compressed_tensors") == s


def test_fp8_configs() -> None:
    s = parse(FP8_BLOCK)
    assert s is not None and (s.method, s.fp8, s.weight_strategy, s.block_size) == ("fp8", True, "block", (128, 128))
    t = parse({"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]})
    assert t is not None and (t.weight_strategy, t.activation_scheme, t.block_size) == ("tensor", "static", None)
    assert is_ignored("lm_head", t) and not is_ignored("model.lm_head_x", t)
    assert "weight_scale_inv" in quant_suffixes(s) and "input_scale" in quant_suffixes(t)


def test_cli_naming_the_checkpoint_method_is_accepted() -> None:
    assert parse(GPTQ_V1, "gptq") == parse(GPTQ_V1)
    assert parse(GPTQ_V1, "gptq_marlin") == parse(GPTQ_V1)  # vLLM's kernel-specific name for the same checkpoint
    assert parse(AWQ, "awq_marlin") == parse(AWQ)
    assert parse(FP8_BLOCK, "fp8") == parse(FP8_BLOCK)


@pytest.mark.parametrize(("q", "cli"), [(GPTQ_V1, "int8"), (AWQ, "int4"), (W4A16, "gptq"), (FP8_BLOCK, "awq")])
def test_cli_on_a_checkpoint_quantized_otherwise_is_refused(q: dict[str, Any], cli: str) -> None:
    with pytest.raises(ValueError, match=f"already quantized with {q['quant_method']}") as e:
        parse(q, cli)
    assert f"drop --quantization {cli}" in str(e.value) and "fp checkpoint" in str(e.value)


def test_fp8_on_an_fp_checkpoint_quantizes_on_load_as_vllm_does() -> None:
    spec = spec_from_config({}, "fp8")
    assert spec is not None and spec.on_load and spec.fp8 and spec.weight_strategy == "channel"
    assert spec.activation_scheme == "dynamic"
    checkpoint = parse(FP8_BLOCK, "fp8")
    assert checkpoint is not None and not checkpoint.on_load  # an FP8 checkpoint is read, not quantized again


def test_cli_refusals_on_an_fp_checkpoint() -> None:
    with pytest.raises(ValueError, match=r"--quantization gptq .*no quantization_config.*int8, int4 or fp8"):
        spec_from_config({}, "gptq")
    with pytest.raises(ValueError, match=r"--quantization 'bitsandbytes' is not supported"):
        spec_from_config({}, "bitsandbytes")


REFUSED: dict[str, tuple[Any, str]] = {
    "bitsandbytes": ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quantization_config.quant_method"),
    "gptq-3bit": (with_(GPTQ_V1, bits=3), "quantization_config.bits"),
    "gptq-marlin": (with_(GPTQ_V1, checkpoint_format="marlin"), "quantization_config.checkpoint_format"),
    "gptq-pack16": (with_(GPTQ_MODEL, pack_dtype="int16"), "quantization_config.pack_dtype"),
    "gptq-dynamic": (with_(GPTQ_MODEL, dynamic={r"+:.*down": {"bits": 8}}), "quantization_config.dynamic"),
    "gptq-group0": (with_(GPTQ_V1, group_size=0), "quantization_config.group_size"),
    "gptq-bits-str": (with_(GPTQ_V1, bits="4"), "quantization_config.bits"),
    "awq-gemv": (with_(AWQ, version="gemv"), "quantization_config.version"),
    "awq-marlin": (with_(AWQ, version="marlin"), "quantization_config.version"),
    "awq-no-zero": (with_(AWQ, zero_point=False), "quantization_config.zero_point"),
    "awq-8bit": (with_(AWQ_LEGACY, w_bit=8), "quantization_config.w_bit"),
    "awq-llm-awq": (with_(AWQ, backend="llm-awq"), "quantization_config.backend"),
    "ct-nvfp4": (with_(W4A16, format="nvfp4-pack-quantized"), "quantization_config.format"),
    "ct-2of4": (with_(W4A16, sparsity_config={"format": "sparse-24-bitmask"}), "quantization_config.sparsity_config"),
    "ct-rotated": (with_(W4A16, transform_config={"config_groups": {"u": {}}}), "quantization_config.transform_config"),
    "ct-frozen": (with_(W4A16, quantization_status="frozen"), "quantization_config.quantization_status"),
    "ct-two-schemes": (with_(W4A16, config_groups={"group_0": FP8_DYNAMIC["config_groups"]["group_0"],
                                                   "group_1": W4A16["config_groups"]["group_0"]}),
                       "quantization_config.config_groups"),
    "ct-2bit": (ct_weights(num_bits=2), "quantization_config.config_groups.group_0.weights.num_bits"),
    "ct-token": (ct_weights(strategy="token"), "quantization_config.config_groups.group_0.weights.strategy"),
    "ct-dynamic-w": (ct_weights(dynamic=True), "quantization_config.config_groups.group_0.weights.dynamic"),
    "fp8-e5m2": (with_(FP8_BLOCK, fmt="e5m2"), "quantization_config.fmt"),
    "fp8-scheme": (with_(FP8_BLOCK, activation_scheme="per-token"), "quantization_config.activation_scheme"),
    "fp8-block": (with_(FP8_BLOCK, weight_block_size=[128]), "quantization_config.weight_block_size"),
    "not-an-object": ("gptq", "quantization_config must be an object"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_refusals_name_the_field(case: str) -> None:
    q, field = REFUSED[case]
    with pytest.raises(ValueError) as e:
        parse(q)
    assert field in str(e.value) and "\n" not in str(e.value)
