"""`python -m kvfleet_agent.bench.fp8_checkpoint SRC DST`: a checkpoint's decoder linears as FP8 (E4M3), per row.

The layout vLLM and transformers read for `quant_method: fp8`: each weight in float8_e4m3fn with a float32
`weight_scale` of shape [out, 1] (the row's largest magnitude over E4M3's largest, 448), activations
dynamic. The quality benchmark serves it through the FP8 reader.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from kvfleet_agent.layers.quant.onload import E4M3_MAX, quantize_fp8

__all__ = ["E4M3_MAX", "write_fp8"]
def write_fp8(src: str, dst: str) -> None:
    """Copy src to dst with every decoder linear's weight in FP8 and the config saying so."""
    from safetensors.torch import load_file, save_file

    out = Path(dst)
    shutil.copytree(src, out, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(Path(src).glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    for name in [n for n in tensors if n.startswith("model.layers.") and n.endswith("proj.weight")]:
        qw = quantize_fp8(tensors[name])  # the on-load quantizer's own grid: the two FP8 paths cannot drift apart
        tensors[name], tensors[name.removesuffix("weight") + "weight_scale"] = qw.q, qw.scale
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    (out / "config.json").write_text(json.dumps(config, indent=2))


def main(argv: Sequence[str] | None = None) -> int:
    """SRC DST."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2:
        print("usage: python -m kvfleet_agent.bench.fp8_checkpoint SRC DST", file=sys.stderr)
        return 2
    write_fp8(args[0], args[1])
    print(f"wrote {args[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
