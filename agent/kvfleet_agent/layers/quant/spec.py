"""QuantSpec: how a checkpoint's linears are quantized, from config.json's quantization_config or --quantization."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

ON_LOAD = ("int8", "int4")
CHECKPOINT_METHODS = ("gptq", "awq", "compressed-tensors", "fp8")
# vLLM's names for the same checkpoints (it picks a kernel by name; kvfleet picks its own)
CLI_ALIASES = {"gptq_marlin": "gptq", "awq_marlin": "awq", "compressed_tensors": "compressed-tensors"}
CT_FORMATS = ("pack-quantized", "int-quantized", "float-quantized", "naive-quantized")
QC = "quantization_config"
ON_LOAD_FORMAT = "on-load"  # the format of a spec whose weights kvfleet quantizes as they load


@dataclass(frozen=True)
class QuantSpec:
    """One checkpoint's quantization: the method, its integer grid, and what stays unquantized."""

    method: str  # int8 | int4 (quantize an fp checkpoint on load) | gptq | awq | compressed-tensors | fp8
    bits: int  # 8 or 4
    group_size: int = -1  # columns per scale; -1: one scale per output channel (or per tensor, see weight_strategy)
    symmetric: bool = True
    act_order: bool = False  # GPTQ desc_act / compressed-tensors actorder "group": columns carry a g_idx
    ignore: tuple[str, ...] = ()  # module names left unquantized: exact, or "re:" + a regex matched from the start
    format: str | None = None  # storage layout: gptq | gptq_v2 (GPTQ), gemm (AWQ), compressed-tensors' format name
    fp8: bool = False  # weights stored as float8_e4m3fn (fp8, compressed-tensors float-quantized)
    weight_strategy: str = "channel"  # scale granularity: tensor | channel | group | block
    block_size: tuple[int, int] | None = None  # [rows, cols] per scale, for weight_strategy "block"
    activation_scheme: str | None = None  # dynamic | static where the checkpoint quantized activations; None: W*A16
    kv_cache_scales: bool = False  # the checkpoint carries KV-cache scales (k_scale, v_scale) besides the linears

    @property
    def on_load(self) -> bool:
        """Whether the checkpoint is fp and kvfleet quantizes it while loading (int8, int4, and fp8 as vLLM does)."""
        return self.method in ON_LOAD or self.format == ON_LOAD_FORMAT


def spec_from_config(config: dict[str, Any], cli: str | None) -> QuantSpec | None:
    """The QuantSpec for a parsed config.json and --quantization (None: serve the fp checkpoint as it is)."""
    wanted = None if cli is None else _cli_method(cli)
    raw = config.get(QC)
    if not raw:  # absent, null or {}: an fp checkpoint
        if wanted is None:
            return None
        if wanted == "int8":
            return QuantSpec(method="int8", bits=8, group_size=-1, symmetric=True, weight_strategy="channel")
        if wanted == "int4":  # min/max per group of 128 (onload.quantize_int4 picks a smaller group where needed)
            return QuantSpec(method="int4", bits=4, group_size=128, symmetric=False, weight_strategy="group")
        if wanted == "fp8":  # as vLLM: an fp checkpoint's weights to E4M3 on load, a scale per row, dynamic activations
            return QuantSpec(method="fp8", bits=8, fp8=True, weight_strategy="channel", activation_scheme="dynamic",
                             format=ON_LOAD_FORMAT)
        raise ValueError(f"--quantization {cli} names a pre-quantized checkpoint format, but config.json has no "
                         "quantization_config (an fp checkpoint): pass --quantization int8, int4 or fp8 to quantize "
                         f"it on load, or serve a {wanted} checkpoint")
    if not isinstance(raw, dict):
        raise ValueError(f"config.json {QC} must be an object, not {type(raw).__name__}")
    spec = _parse(raw)
    if wanted is not None and wanted != spec.method:
        raise ValueError(f"this checkpoint is already quantized with {spec.method} ({QC}.quant_method): drop "
                         f"--quantization {cli} (or pass --quantization {spec.method}), or serve an fp checkpoint "
                         f"to quantize it with {cli}")
    return spec


def _cli_method(cli: str) -> str:
    """The method --quantization names, aliases resolved."""
    name = CLI_ALIASES.get(cli.strip().lower(), cli.strip().lower())
    if name not in ON_LOAD + CHECKPOINT_METHODS:
        raise ValueError(f"--quantization {cli!r} is not supported: use int8 or int4 to quantize an fp checkpoint "
                         "on load, or gptq, awq, compressed-tensors, fp8 to name a quantized checkpoint's own method")
    return name


def _parse(q: dict[str, Any]) -> QuantSpec:
    """Dispatch on quant_method."""
    method = q.get("quant_method")
    if isinstance(method, str):
        method = method.lower()
    if method == "gptq":
        return _gptq(q)
    if method == "awq":
        return _awq(q)
    if method == "compressed-tensors":
        return _compressed_tensors(q)
    if method == "fp8":
        return _fp8(q)
    raise ValueError(f"{QC}.quant_method {method!r} is not supported; kvfleet reads gptq, awq, compressed-tensors, "
                     "fp8 (or pass --quantization int8|int4 with an unquantized checkpoint)")


def _get(q: dict[str, Any], keys: tuple[str, ...], default: Any) -> tuple[str, Any]:
    """The first of `keys` present in q (with its name, for messages), else the default under keys[0]."""
    for k in keys:
        if k in q and q[k] is not None:
            return k, q[k]
    return keys[0], default


def _int(q: dict[str, Any], keys: tuple[str, ...], default: int, where: str = QC) -> int:
    """An integer field; a bool or a string there is an error naming the field."""
    k, v = _get(q, keys, default)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{where}.{k} must be an integer, not {v!r}")
    return v


def _bool(q: dict[str, Any], key: str, default: bool, where: str = QC) -> bool:
    """A boolean field."""
    v = q.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ValueError(f"{where}.{key} must be true or false, not {v!r}")
    return v


def _group(q: dict[str, Any], keys: tuple[str, ...], default: int, where: str = QC) -> int:
    """A group size: positive, or -1 for one scale per output channel."""
    k, _ = _get(q, keys, default)
    g = _int(q, keys, default, where)
    if g != -1 and g <= 0:
        raise ValueError(f"{where}.{k} {g} is not supported: a positive group size, or -1 for per-channel scales")
    return g


def _names(q: dict[str, Any], key: str, substring: bool = False) -> tuple[str, ...]:
    """A list of module names; `substring` turns each into a regex matching names that contain it (transformers)."""
    v = q.get(key) or []
    if not isinstance(v, list) or not all(isinstance(n, str) for n in v):
        raise ValueError(f"{QC}.{key} must be a list of module names, not {v!r}")
    return tuple(f"re:.*{re.escape(n)}" if substring else n for n in v)


def _gptq(q: dict[str, Any]) -> QuantSpec:
    """AutoGPTQ / GPTQModel / optimum: bits, group_size, desc_act, sym, checkpoint_format."""
    bits = _int(q, ("bits",), 4)
    if bits not in (4, 8):
        raise ValueError(f"{QC}.bits {bits} is not supported for gptq; kvfleet reads 4- and 8-bit GPTQ checkpoints")
    group = _group(q, ("group_size",), 128)
    key, fmt = _get(q, ("checkpoint_format", "format"), "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"{QC}.{key} {fmt!r} is not supported; kvfleet reads gptq and gptq_v2 (re-save the "
                         "checkpoint in gptq format, e.g. with GPTQModel)")
    pack_dtype = q.get("pack_dtype", "int32")
    if pack_dtype not in (None, "int32"):  # GPTQModel can pack into int8/16/64 words: another layout
        raise ValueError(f"{QC}.pack_dtype {pack_dtype!r} is not supported: kvfleet reads GPTQ packed in int32")
    ignore: list[str] = []
    dynamic = q.get("dynamic") or {}
    if not isinstance(dynamic, dict):
        raise ValueError(f"{QC}.dynamic must be an object of module-name regexes, not {dynamic!r}")
    for pattern, override in dynamic.items():
        # GPTQModel's per-module rules: "-:regex" leaves modules unquantized; anything else changes their grid
        if pattern.startswith("-:"):
            ignore.append("re:" + pattern[2:])
        else:
            raise ValueError(f"{QC}.dynamic overrides {pattern!r} with {override!r}: per-module bits or group sizes "
                             "are not supported; kvfleet reads one grid per GPTQ checkpoint")
    return QuantSpec(method="gptq", bits=bits, group_size=group, symmetric=_bool(q, "sym", True),
                     act_order=_bool(q, "desc_act", False), ignore=tuple(ignore), format=fmt,
                     weight_strategy="group" if group > 0 else "channel")


def _awq(q: dict[str, Any]) -> QuantSpec:
    """AutoAWQ (transformers' AwqConfig, or the older w_bit/q_group_size names): GEMM layout only."""
    key, version = _get(q, ("version",), "gemm")
    if not isinstance(version, str) or version.lower() != "gemm":
        raise ValueError(f"{QC}.{key} {version!r} is not supported: kvfleet reads AWQ's GEMM layout only (gemv, "
                         "gemv_fast and marlin pack the integers differently); use a GEMM checkpoint")
    backend = q.get("backend", "autoawq")
    if backend not in (None, "autoawq"):
        raise ValueError(f"{QC}.backend {backend!r} is not supported: kvfleet reads AutoAWQ (autoawq) checkpoints")
    k, bits = _get(q, ("bits", "w_bit"), 4)
    if bits != 4:
        raise ValueError(f"{QC}.{k} {bits!r} is not supported for awq: the GEMM layout holds 4-bit weights")
    if not _bool(q, "zero_point", True):
        raise ValueError(f"{QC}.zero_point false is not supported: AWQ GEMM checkpoints carry zero points (qzeros)")
    group = _group(q, ("group_size", "q_group_size"), 128)
    return QuantSpec(method="awq", bits=4, group_size=group, symmetric=False, format="gemm",
                     ignore=_names(q, "modules_to_not_convert", substring=True),
                     weight_strategy="group" if group > 0 else "channel")


def _compressed_tensors(q: dict[str, Any]) -> QuantSpec:
    """llm-compressor's compressed-tensors: one weight scheme in config_groups, in a format kvfleet unpacks."""
    status = q.get("quantization_status", "compressed")
    if status != "compressed":
        raise ValueError(f"{QC}.quantization_status {status!r} is not supported: kvfleet reads compressed "
                         "checkpoints (saved with save_compressed=True)")
    sparsity = q.get("sparsity_config") or {}
    if isinstance(sparsity, dict) and sparsity.get("format") not in (None, "dense"):
        raise ValueError(f"{QC}.sparsity_config (format {sparsity.get('format')!r}) is not supported: kvfleet reads "
                         "dense quantized weights only")
    if q.get("transform_config"):
        raise ValueError(f"{QC}.transform_config is not supported: rotated checkpoints (SpinQuant, QuIP) need "
                         "online transforms kvfleet does not apply")
    groups = q.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ValueError(f"{QC}.config_groups must name at least one quantization scheme")
    schemes = {}
    for name, g in groups.items():
        if not isinstance(g, dict):
            raise ValueError(f"{QC}.config_groups.{name} must be an object")
        if g.get("output_activations"):
            raise ValueError(f"{QC}.config_groups.{name}.output_activations is not supported")
        if g.get("weights") is None:
            continue  # activation-only groups change no weight
        if not isinstance(g["weights"], dict):
            raise ValueError(f"{QC}.config_groups.{name}.weights must be an object")
        fmt = g.get("format") or q.get("format")
        key = repr((fmt, sorted(g["weights"].items()), sorted((g.get("input_activations") or {}).items())))
        schemes[key] = (name, g, fmt)
    if len(schemes) != 1:
        raise ValueError(f"{QC}.config_groups: {len(schemes)} different weight schemes; kvfleet reads checkpoints "
                         "whose quantized linears all share one scheme")
    name, g, fmt = next(iter(schemes.values()))
    where = f"{QC}.config_groups.{name}.weights"
    w = g["weights"]
    if fmt not in CT_FORMATS:
        raise ValueError(f"{QC}.format {fmt!r} is not supported; kvfleet reads {', '.join(CT_FORMATS)}")
    wtype = w.get("type", "int")
    bits = _int(w, ("num_bits",), 8, where)
    if wtype == "float":
        if bits != 8 or fmt == "pack-quantized":
            raise ValueError(f"{where}: float weights of {bits} bits in {fmt!r} are not supported; kvfleet reads "
                             "FP8 (E4M3) weights, float-quantized")
    elif wtype != "int":
        raise ValueError(f"{where}.type {wtype!r} is not supported: int or float")
    elif bits not in (4, 8) or fmt == "float-quantized":
        raise ValueError(f"{where}.num_bits {bits} in {fmt!r} is not supported: kvfleet reads 4- and 8-bit integers")
    if w.get("dynamic", False) is not False:
        raise ValueError(f"{where}.dynamic {w.get('dynamic')!r} is not supported: weights need stored scales")
    strategy = w.get("strategy") or ("group" if (w.get("group_size") or 0) > 0 else "tensor")
    allowed = ("tensor", "channel", "group", "block") if wtype == "float" else ("tensor", "channel", "group")
    if strategy not in allowed:
        raise ValueError(f"{where}.strategy {strategy!r} is not supported for {wtype} weights: {', '.join(allowed)}")
    group = _group(w, ("group_size",), -1, where) if strategy == "group" else -1
    if strategy == "group" and group <= 0:
        raise ValueError(f"{where}.group_size must be positive for strategy 'group'")
    block = None
    if strategy == "block":
        b = w.get("block_structure")
        if not (isinstance(b, list) and len(b) == 2 and all(isinstance(x, int) and x > 0 for x in b)):
            raise ValueError(f"{where}.block_structure {b!r} must be [rows, cols]")
        block = (b[0], b[1])
    actorder = w.get("actorder")
    if actorder not in (None, False, True, "group", "dynamic", "weight", "static"):
        raise ValueError(f"{where}.actorder {actorder!r} is not supported")
    return QuantSpec(method="compressed-tensors", bits=bits, group_size=group, symmetric=_bool(w, "symmetric", True,
                     where), act_order=actorder in (True, "group", "dynamic"), ignore=_names(q, "ignore"), format=fmt,
                     fp8=wtype == "float", weight_strategy=strategy, block_size=block,
                     activation_scheme=_ct_activations(g.get("input_activations"), f"{QC}.config_groups.{name}"),
                     kv_cache_scales=bool(q.get("kv_cache_scheme")))


def _ct_activations(a: Any, where: str) -> str | None:
    """How a compressed-tensors scheme quantized activations: dynamic, static, or None (weight-only)."""
    if not a:
        return None
    dynamic = a.get("dynamic", False) if isinstance(a, dict) else None
    if dynamic is True:
        return "dynamic"
    if dynamic is False:
        return "static"
    raise ValueError(f"{where}.input_activations.dynamic {dynamic!r} is not supported: true or false")


def _fp8(q: dict[str, Any]) -> QuantSpec:
    """vLLM / transformers FP8: E4M3 weights, a scale per tensor (or per block with weight_block_size)."""
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"{QC}.fmt {fmt!r} is not supported: kvfleet reads E4M3 (float8_e4m3fn) weights")
    scheme = q.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise ValueError(f"{QC}.activation_scheme {scheme!r} is not supported: dynamic or static")
    block = q.get("weight_block_size")
    if block is not None and not (isinstance(block, list) and len(block) == 2
                                  and all(isinstance(x, int) and x > 0 for x in block)):
        raise ValueError(f"{QC}.weight_block_size {block!r} must be [rows, cols]")
    # vLLM lists exact module names (ignored_layers); transformers matches substrings (modules_to_not_convert)
    ignore = _names(q, "ignored_layers") + _names(q, "modules_to_not_convert", substring=True)
    return QuantSpec(method="fp8", bits=8, symmetric=True, ignore=ignore, fp8=True,
                     weight_strategy="tensor" if block is None else "block",
                     block_size=None if block is None else (block[0], block[1]), activation_scheme=scheme)
