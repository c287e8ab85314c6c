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

E4M3_MAX = 448.0


def to_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight in E4M3, its per-row scale [out, 1]) with w ≈ weight · scale."""
    scale = (w.float().abs().amax(dim=1, keepdim=True) / E4M3_MAX).clamp(min=1e-12)
    return (w.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


def write_fp8(src: str, dst: str) -> None:
    """Copy src to dst with every decoder linear's weight in FP8 and the config saying so."""
    from safetensors.torch import load_file, save_file

    out = Path(dst)
    shutil.copytree(src, out, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(Path(src).glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    for name in [n for n in tensors if n.startswith("model.layers.") and n.endswith("proj.weight")]:
        tensors[name], tensors[name.removesuffix("weight") + "weight_scale"] = to_fp8(tensors[name])
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
