"""Checkpoint loading: safetensors files (single or sharded with an index) into a model's parameters.

Tensors are handed to the weight loaders as lazy slices of the memory-mapped files, so a
tensor-parallel rank reads only its own rows or columns and never holds a full copy of a sharded
weight.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass

import torch
from safetensors import safe_open
from torch import nn

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


def load_weights(model: nn.Module, model_dir: str, report: LoadReport | None = None) -> int:
    """Copy every checkpoint tensor into its parameter through that parameter's weight_loader.

    Returns the bytes read from the checkpoint (in the model's dtype): about 1/N of the model on
    each of N tensor-parallel ranks, plus the small replicated tensors (norms, row-parallel biases).
    `report`, if given, gets the bytes and the seconds spent reading the files.
    """
    params = dict(model.named_parameters())
    expected = {name: _shards_of(model, name) for name in params}
    seen: dict[str, set[str | None]] = {name: set() for name in params}
    tied = getattr(getattr(model, "cfg", None), "tie_word_embeddings", False)
    bytes_read = 0
    for path in checkpoint_files(model_dir):
        with safe_open(path, framework="pt") as f:
            for ckpt_name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if "rotary_emb.inv_freq" in ckpt_name or (tied and ckpt_name == "lm_head.weight"):
                    continue
                name, shard = model.checkpoint_name(ckpt_name)  # type: ignore[operator]
                param = params.get(name)
                if param is None:
                    raise ValueError(f"{path} holds tensor {ckpt_name!r}, which this model has no place for: "
                                     "is config.json's architecture right?")
                loaded = CheckpointTensor(f.get_slice(ckpt_name), param.dtype)
                with torch.no_grad():
                    param.weight_loader(param, loaded, shard)  # type: ignore[attr-defined]
                bytes_read += loaded.bytes_read
                if report is not None:
                    report.bytes_read += loaded.bytes_read
                    report.read_seconds += loaded.read_seconds
                seen[name].add(shard)
    missing = [f"{n} ({', '.join(sorted(str(s) for s in expected[n] - seen[n]))})" if expected[n] != {None} else n
               for n in params if expected[n] - seen[n]]
    if missing:
        raise ValueError(f"the checkpoint in {model_dir} lacks tensors for: {', '.join(missing[:8])}"
                         + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))
    return bytes_read
