"""`python -m kvfleet_agent.bench.gptq`: GPTQ-quantize an fp checkpoint on calibration text and save it as GPTQ does.

What a user downloads as "GPTQ INT4" is this: each linear quantized column by column, the rounding error of
each column spread over the columns not yet quantized, weighted by the inverse Hessian of the layer's
inputs (Frantar et al., 2022), then packed in the AutoGPTQ layout (qweight, qzeros, scales, g_idx, with
`quantization_config` in config.json). The benchmark serves the result through the GPTQ reader, so the
quality table compares calibrated INT4 with plain round-to-nearest INT4 on the same model.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

BITS = 4
PACK = 32 // BITS  # values per int32
DAMP = 0.01  # of the Hessian's mean diagonal, added for a stable inverse (GPTQ's default)


def quantize_gptq(w: torch.Tensor, hessian: torch.Tensor, group: int, sym: bool) -> tuple[torch.Tensor, ...]:
    """(q [out, in] in 0..15, scales [out, groups], zeros [out, groups]) for weight w under the input Hessian."""
    w = w.clone().float()
    out, cols = w.shape
    h = hessian.clone()
    dead = torch.diag(h) == 0  # inputs that never fire: their weights do not matter, pin them
    h[dead, dead] = 1
    w[:, dead] = 0
    h += torch.eye(cols) * DAMP * torch.diag(h).mean()
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    q = torch.zeros(out, cols, dtype=torch.int8)
    scales, zeros = torch.zeros(out, cols // group), torch.zeros(out, cols // group)
    for g in range(cols // group):
        lo, hi = g * group, (g + 1) * group
        block = w[:, lo:hi]
        if sym:  # the grid of the group as it is now: earlier columns' errors have moved its weights
            s = (block.abs().amax(dim=1) * 2 / 15).clamp(min=1e-10)
            z = torch.full_like(s, 8.0)
        else:
            mn, mx = block.amin(dim=1).clamp(max=0), block.amax(dim=1).clamp(min=0)
            s = ((mx - mn) / 15).clamp(min=1e-10)
            z = torch.round(-mn / s)
        scales[:, g], zeros[:, g] = s, z
        err_block = torch.zeros_like(block)
        for i in range(group):
            col = block[:, i]
            qi = torch.clamp(torch.round(col / s) + z, 0, 15)
            q[:, lo + i] = qi.to(torch.int8)
            err = (col - (qi - z) * s) / hinv[lo + i, lo + i]
            block[:, i:] -= err[:, None] * hinv[lo + i, lo + i:hi][None, :]
            err_block[:, i] = err
        w[:, hi:] -= err_block @ hinv[lo:hi, hi:]
    return q, scales, zeros


def pack_gptq(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> dict[str, torch.Tensor]:
    """AutoGPTQ's tensors: qweight int32 [in/8, out] packed along the inputs (low bits first), qzeros int32
    [groups, out/8] packed along the outputs and stored minus one (the v1 checkpoint format), scales fp16
    [groups, out], g_idx int32 [in]."""
    out, cols = q.shape
    shifts = torch.arange(PACK, dtype=torch.int64) * BITS
    qt = q.t().to(torch.int64).reshape(cols // PACK, PACK, out)
    qweight = (qt << shifts[None, :, None]).sum(dim=1)
    zt = (zeros.t().to(torch.int64) - 1) & 0xF
    qzeros = (zt.reshape(zt.shape[0], out // PACK, PACK) << shifts[None, None, :]).sum(dim=2)
    group = cols // scales.shape[1]
    return {"qweight": _int32(qweight), "qzeros": _int32(qzeros), "scales": scales.t().contiguous().half(),
            "g_idx": (torch.arange(cols) // group).to(torch.int32)}


def _int32(x: torch.Tensor) -> torch.Tensor:
    """Two's-complement view of 32-bit patterns held in int64."""
    return torch.where(x >= 2**31, x - 2**32, x).to(torch.int32)


def hessians(model: Any, windows: torch.Tensor) -> dict[str, torch.Tensor]:
    """2·XᵀX/n of every decoder linear's inputs over the calibration windows (one fp forward pass)."""
    acc: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}
    hooks = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and ".layers." in f".{name}":
            def hook(mod: Any, args: tuple[torch.Tensor, ...], _out: Any, name: str = name) -> None:
                x = args[0].reshape(-1, args[0].shape[-1]).float()
                acc[name] = acc[name] + 2 * x.t() @ x if name in acc else 2 * x.t() @ x
                counts[name] = counts.get(name, 0) + x.shape[0]
            hooks.append(module.register_forward_hook(hook))
    with torch.no_grad():
        for w in tqdm(windows, desc="calibration", unit="window"):
            model(input_ids=w[None])
    for h in hooks:
        h.remove()
    return {name: acc[name] / counts[name] for name in acc}


def write_gptq(src: str, dst: str, windows: torch.Tensor, group: int = 128, sym: bool = True) -> None:
    """GPTQ-quantize src's decoder linears on the windows and write the checkpoint to dst."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    h = hessians(model, windows)
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:  # one matrix, saved once (as transformers does)
        tensors.pop("lm_head.weight", None)
    widths = {int(tensors[f"{name}.weight"].shape[1]) for name in h}
    if any(width % group for width in widths):  # one group size for the whole checkpoint, as GPTQ's config says
        raise SystemExit(f"--group-size {group} does not divide every linear's inputs {sorted(widths)}")
    for name in tqdm(sorted(h), desc="GPTQ", unit="linear"):
        q, s, z = quantize_gptq(tensors.pop(f"{name}.weight"), h[name], group, sym)
        tensors.update({f"{name}.{k}": v for k, v in pack_gptq(q, s, z).items()})
    out = Path(dst)
    shutil.copytree(src, out, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": BITS, "group_size": group, "desc_act": False,
                                     "sym": sym, "checkpoint_format": "gptq"}
    (out / "config.json").write_text(json.dumps(config, indent=2))


def main(argv: Sequence[str] | None = None) -> int:
    """Calibrate on the training split of the trained pair's corpus, write DST."""
    from tokenizers import Tokenizer

    from kvfleet_agent.models.stdlib_corpus import EOS_ID, texts

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--windows", type=int, default=128, help="calibration windows of 128 tokens")
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--asym", action="store_true", help="zero points per group (default: symmetric, zero 8)")
    a = p.parse_args(argv)
    tok = Tokenizer.from_file(str(Path(a.src) / "tokenizer.json"))
    train, _ = texts(600_000)  # calibration comes from the training files, never the held-out ones
    stream = [t for enc in tok.encode_batch(train) for t in [*enc.ids, EOS_ID]]
    windows = torch.tensor(stream[: a.windows * 128]).reshape(a.windows, 128)
    write_gptq(a.src, a.dst, windows, a.group_size, not a.asym)
    print(f"wrote {a.dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
