"""Checkpoint loading: safetensors files (single or sharded with an index) into a model's parameters.

Tensors are handed to the weight loaders as lazy slices of the memory-mapped files, so a
tensor-parallel rank reads only its own rows or columns and never holds a full copy of a sharded
weight.
"""

from __future__ import annotations

import glob
import os
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from kvfleet_agent.layers.quant.formats import is_quantized, read_quantized, split_name
from kvfleet_agent.layers.quant.spec import QuantSpec
from kvfleet_agent.layers.quant.weight import QuantWeight
from kvfleet_agent.layers.weights import CheckpointTensor
from kvfleet_agent.models.config import read_json


def checkpoint_files(model_dir: str) -> list[str]:
    """The safetensors files of a checkpoint, from its index when there is one."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index} has no 'weight_map' object naming the shard of each tensor")
        files = sorted({os.path.join(model_dir, f) for f in weight_map.values()})
        for f in files:
            if not os.path.exists(f):
                raise FileNotFoundError(f"{f} is listed in {index} but missing")
        return files
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no weights in {model_dir}: expected model.safetensors or sharded "
                                "*.safetensors with model.safetensors.index.json (.bin checkpoints are not read)")
    return files


def _shards_of(model: nn.Module, param_name: str) -> set[str | None]:
    """The shard ids a parameter is loaded in (packed linears), or {None} for a plain one."""
    names = getattr(model.get_submodule(param_name.rpartition(".")[0]), "shard_names", None)
    return set(names) if names else {None}


@dataclass
class LoadReport:
    """What a load read: bytes (in the model's dtype), and seconds spent reading rather than copying into place."""

    bytes_read: int = 0
    read_seconds: float = 0.0


def load_weights(model: nn.Module, model_dir: str, report: LoadReport | None = None,
                 quant: QuantSpec | None = None) -> int:
    """Copy every checkpoint tensor into its parameter through that parameter's weight_loader.

    Returns the bytes read from the checkpoint (dense tensors in the model's dtype, quantized ones as
    stored): about 1/N of the model on each of N tensor-parallel ranks, plus the small replicated tensors
    (norms, row-parallel biases). `report`, if given, gets the bytes and the seconds spent reading the files.
    With a pre-quantized checkpoint (`quant`), each linear's tensors (packed integers, scales, zeros) are
    gathered first, from whichever shard files hold them, and handed over as one QuantWeight.
    """
    params = dict(model.named_parameters())
    expected = {name: _shards_of(model, name) for name in params}
    seen: dict[str, set[str | None]] = {name: set() for name in params}
    tied = getattr(getattr(model, "cfg", None), "tie_word_embeddings", False)
    gather = quant is not None and not quant.on_load
    groups: dict[str, dict[str, str]] = {}  # a quantized linear's prefix → its tensors' suffixes → file
    total = LoadReport()

    def place(ckpt_name: str, loaded: CheckpointTensor | QuantWeight, where: str) -> None:
        name, shard = model.checkpoint_name(ckpt_name)  # type: ignore[operator]
        param = params.get(name)
        if param is None:
            raise ValueError(f"{where} holds tensor {ckpt_name!r}, which this model has no place for: "
                             "is config.json's architecture right?")
        with torch.no_grad():
            param.weight_loader(param, loaded, shard)  # type: ignore[attr-defined]
        seen[name].add(shard)

    for path in checkpoint_files(model_dir):
        with safe_open(path, framework="pt") as f:
            for ckpt_name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if "rotary_emb.inv_freq" in ckpt_name or (tied and ckpt_name == "lm_head.weight"):
                    continue
                if quant is not None and quant.kv_cache_scales and ckpt_name.endswith((".k_scale", ".v_scale")):
                    continue  # an FP8 KV cache's scales: this KV cache keeps the model's dtype (logged at start-up)
                parts = split_name(ckpt_name, quant) if gather and quant is not None else None
                if parts is not None:
                    groups.setdefault(parts[0], {})[parts[1]] = path
                    continue
                name, _ = model.checkpoint_name(ckpt_name)  # type: ignore[operator]
                param = params.get(name)
                # A quantized layer (its weight on the meta device) quantizes from the checkpoint's full precision.
                dtype = torch.float32 if param is None or param.is_meta else param.dtype
                loaded = CheckpointTensor(f.get_slice(ckpt_name), dtype)
                place(ckpt_name, loaded, path)
                total.bytes_read += loaded.bytes_read
                total.read_seconds += loaded.read_seconds
    if groups and quant is not None:
        _place_quantized(groups, quant, place, total)
    missing = [f"{n} ({', '.join(sorted(str(s) for s in expected[n] - seen[n]))})" if expected[n] != {None} else n
               for n in params if expected[n] - seen[n]]
    if missing:
        raise ValueError(f"the checkpoint in {model_dir} lacks tensors for: {', '.join(missing[:8])}"
                         + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))
    if report is not None:
        report.bytes_read += total.bytes_read
        report.read_seconds += total.read_seconds
    return total.bytes_read


def _place_quantized(groups: dict[str, dict[str, str]], quant: QuantSpec,
                     place: Callable[[str, CheckpointTensor | QuantWeight, str], None], total: LoadReport) -> None:
    """Read each quantized linear's tensors whole and place them as one QuantWeight (or dense, if unquantized)."""
    with ExitStack() as stack:
        files: dict[str, Any] = {}
        for prefix, suffixes in groups.items():
            start = time.perf_counter()
            tensors = {}
            for suffix, path in suffixes.items():
                if path not in files:
                    files[path] = stack.enter_context(safe_open(path, framework="pt"))
                tensors[suffix] = files[path].get_tensor(f"{prefix}.{suffix}")
            total.read_seconds += time.perf_counter() - start
            total.bytes_read += sum(t.numel() * t.element_size() for t in tensors.values())
            where = ", ".join(sorted(set(suffixes.values())))
            if not is_quantized(quant, tensors):  # a module the checkpoint left unquantized (its `ignore` list),
                for suffix, t in tensors.items():  # or a norm that FP8's plain `.weight` naming swept in
                    place(f"{prefix}.{suffix}", CheckpointTensor(t, t.dtype), where)
                continue
            try:
                qw = read_quantized(quant, tensors, prefix)
            except ValueError as e:
                raise ValueError(f"{where}: {prefix}: {e}") from None
            place(f"{prefix}.weight", qw, where)
