"""Kernel benchmark on a CUDA GPU: each Triton kernel against its reference at Llama-3-8B shapes, in GB/s or TFLOP/s."""

import argparse
import statistics
import sys
from collections.abc import Callable
from functools import partial
from typing import cast

import torch

from kvfleet_kernels import plan, reference

# python -m kvfleet_kernels.bench [--dtype bfloat16] [--only decode,prefill,kv_write,norm,rotary] [--reps 50]
#
# The method of the device library's METHOD.md: two ceilings measured first (a device-to-device copy, counting
# bytes read plus written; an 8192³ matrix product); random inputs, never zeros; each kernel checked against its
# reference (relative error) before it is timed; CUDA events, warm-up, the median of the timed runs; inputs
# rotated among enough copies to exceed the L2 four times, as a model's layers would be; Triton also timed as
# CUDA graph replays, which removes the Python launch cost that decode steps under graphs do not pay.
H, KVH, D, HIDDEN, BS = 32, 8, 128, 4096, 16  # Llama-3-8B, block size 16
QUANT_SHAPES = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))  # its qkv, o, gate_up, down [out, in]
Fn = Callable[[], object]


def decode_bytes(lengths: list[int], h: int, kvh: int, d: int, elt: int) -> int:
    """Fewest bytes a decode step moves: every cached K and V once, q read and the output written once."""
    return sum(lengths) * kvh * d * 2 * elt + 2 * len(lengths) * h * d * elt


def prefill_flops(t: int, context: int, h: int, d: int) -> int:
    """Two matrix products (QKᵀ, PV) over the visible pairs: query i of the chunk sees context + i + 1 keys."""
    pairs = t * context + t * (t + 1) // 2
    return 4 * h * d * pairs


def time_ms(fn: Fn, warmup: int, reps: int) -> float:
    """Median milliseconds of fn, each run between two CUDA events, after warm-up runs."""
    for _ in range(warmup):
        fn()
    times: list[float] = []
    for _ in range(reps):
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(float(start.elapsed_time(end)))
    return statistics.median(times)


def graph_ms(fn: Fn, warmup: int, reps: int) -> float:
    """time_ms of fn captured once as a CUDA graph and replayed."""
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return time_ms(graph.replay, warmup, reps)


def rotations(bytes_per_call: int) -> int:
    """How many copies of the inputs to cycle through so that together they exceed the L2 four times (≤ 256)."""
    l2 = int(getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 64 << 20))
    return min(256, max(1, -(-4 * l2 // max(bytes_per_call, 1))))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a64, b64 = a.double(), b.double()
    return float((a64 - b64).norm() / b64.norm().clamp_min(1e-30))


class Bench:
    """Cases at the given shapes (Llama-3-8B by default); each prints one line of figures."""

    def __init__(self, dtype: torch.dtype, warmup: int, reps: int, device: str = "cuda",
                 shapes: tuple[int, int, int, int, int] = (H, KVH, D, HIDDEN, BS)) -> None:
        self.dtype, self.warmup, self.reps, self.device = dtype, warmup, reps, device
        self.h, self.kvh, self.d, self.hidden, self.bs = shapes
        self.elt = torch.empty(0, dtype=dtype).element_size()
        self.gen = torch.Generator(device=self.device).manual_seed(0)
        self.copy_gbs = self.matmul_tflops = 0.0

    def randn(self, *shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(shape, generator=self.gen, device=self.device) * scale).to(self.dtype)

    def pool(self, num_blocks: int) -> torch.Tensor:
        return self.randn(num_blocks, self.bs, self.kvh, self.d)

    def ceilings(self) -> None:
        n = 2 << 30
        src = torch.randint(0, 256, (n,), dtype=torch.uint8, device=self.device, generator=self.gen)
        dst = torch.empty_like(src)
        self.copy_gbs = 2 * n / time_ms(lambda: dst.copy_(src), 3, 20) / 1e6
        a, b = self.randn(8192, 8192), self.randn(8192, 8192)
        self.matmul_tflops = 2 * 8192 ** 3 / time_ms(lambda: a @ b, 3, 20) / 1e9
        print(f"ceilings: copy {self.copy_gbs:.0f} GB/s (read + write), {self.dtype} matmul "
              f"{self.matmul_tflops:.0f} TFLOP/s (8192³, random)")

    def report(self, op: str, case: str, calls: list[tuple[Fn, Fn]], check: tuple[torch.Tensor, torch.Tensor],
               work: int, unit: str) -> None:
        """Times the rotated (triton, reference) calls; work is bytes (GB/s) or FLOP (TFLOP/s) of one call."""
        err = rel_err(*check)
        ok = err < (1e-5 if self.dtype == torch.float32 else 1e-2)
        n = len(calls)

        def run(i: int) -> Fn:
            return lambda: [c[i]() for c in calls]

        eager = time_ms(run(0), self.warmup, self.reps) / n
        try:
            graphed: float | None = graph_ms(run(0), self.warmup, self.reps) / n
        except RuntimeError as e:  # a kernel that cannot be captured: say so, keep the eager figure
            print(f"  ({op} {case}: no CUDA graph: {e})")
            graphed = None
        ref = time_ms(run(1), 2, max(3, self.reps // 5)) / n
        best = min(eager, graphed) if graphed is not None else eager
        if unit == "GB/s":
            rate = work / best / 1e6
            share = f"{100 * rate / self.copy_gbs:5.1f}% of copy"
        else:
            rate = work / best / 1e9
            share = f"{100 * rate / self.matmul_tflops:5.1f}% of matmul"
        g = f"{graphed * 1e3:9.1f}" if graphed is not None else "      n/a"
        print(f"{op:<10} {case:<22} {eager * 1e3:9.1f} {g} {rate:9.1f} {unit:<7} {share}  ref {ref * 1e3:9.1f} us"
              f"  x{ref / best:6.2f}  err {err:.1e}{'' if ok else '  FAILED CHECK'}")

    # -----------------------------------------------------------------------------------------

    def decode(self, lengths: list[int], case: str) -> None:
        from kvfleet_kernels import paged_attention as pa

        batch, need, scale = len(lengths), [-(-n // self.bs) for n in lengths], self.d ** -0.5
        work = decode_bytes(lengths, self.h, self.kvh, self.d, self.elt)
        calls: list[tuple[Fn, Fn]] = []
        for _ in range(rotations(work)):  # each copy a layer's pool, its sequences in shuffled blocks
            k, v = self.pool(sum(need)), self.pool(sum(need))
            perm = torch.randperm(sum(need), device=self.device, generator=self.gen).tolist()
            tables = torch.tensor([perm[sum(need[:i]):sum(need[:i + 1])] + [0] * (max(need) - n)
                                   for i, n in enumerate(need)], device=self.device)
            lens = torch.tensor(lengths, device=self.device)
            flat, valid = plan.decode_plan(tables, lens, self.bs, max(lengths))
            q = self.randn(batch, self.h, self.d)
            calls.append((partial(pa.planned_decode_attention, q, k, v, flat, valid, scale),
                          partial(reference.planned_decode_attention, q, k, v, flat, valid, scale)))
        check = (pa.planned_decode_attention(q, k, v, flat, valid, scale).float(),
                 reference.planned_decode_attention(q.float(), k.float(), v.float(), flat, valid, scale))
        self.report("decode", case, calls, check, work, "GB/s")

    def prefill(self, t: int, context: int) -> None:
        from kvfleet_kernels import paged_attention as pa

        length, scale = context + t, self.d ** -0.5
        nb = -(-length // self.bs)
        k, v = self.pool(nb), self.pool(nb)
        table = torch.randperm(nb, device=self.device, generator=self.gen)
        q = self.randn(t, self.h, self.d)
        if context:  # a chunk after a cached prefix: through the block table
            calls: list[tuple[Fn, Fn]] = [(partial(pa.paged_prefill_attention, q, k, v, table, length, scale),
                                          partial(reference.paged_prefill_attention, q, k, v, table, length, scale))]
            check = (pa.paged_prefill_attention(q, k, v, table, length, scale).float(),
                     reference.paged_prefill_attention(q.float(), k.float(), v.float(), table, length, scale))
        else:  # a whole prompt: its own fresh K/V, as the attention layer does
            kd, vd = self.randn(t, self.kvh, self.d), self.randn(t, self.kvh, self.d)
            calls = [(partial(pa.causal_attention, q, kd, vd, scale),
                      partial(reference.causal_attention, q, kd, vd, scale))]
            check = (pa.causal_attention(q, kd, vd, scale).float(),
                     reference.causal_attention(q.float(), kd.float(), vd.float(), scale))
        self.report("prefill", f"t{t} ctx{context}", calls, check, prefill_flops(t, context, self.h, self.d), "TFLOP/s")

    def kv_write(self, t: int) -> None:
        from kvfleet_kernels import kv_write as kw

        num_blocks = max(4096, -(-t // self.bs))
        work = 2 * t * self.kvh * self.d * self.elt * 2 + 8 * t  # K and V read and written, the slots read
        calls: list[tuple[Fn, Fn]] = []
        kc, vc = self.pool(num_blocks), self.pool(num_blocks)  # one pool, far larger than the L2, written at random
        for _ in range(rotations(work)):
            k, v = self.randn(t, self.kvh, self.d), self.randn(t, self.kvh, self.d)
            slots = torch.randperm(num_blocks * self.bs, device=self.device, generator=self.gen)[:t]
            calls.append((partial(kw.write_kv, kc, vc, k, v, slots), partial(reference.write_kv, kc, vc, k, v, slots)))
        want_k, want_v = kc.clone(), vc.clone()
        reference.write_kv(want_k, want_v, k, v, slots)
        kw.write_kv(kc, vc, k, v, slots)
        self.report("kv_write", f"t{t}", calls, (torch.cat([kc, vc]), torch.cat([want_k, want_v])), work, "GB/s")

    def norm(self, rows: int, residual: bool) -> None:
        from kvfleet_kernels import fused

        streams = 4 if residual else 2  # x (and the residual) read, the output (and the new residual) written
        work = (streams * rows + 1) * self.hidden * self.elt
        w = self.randn(self.hidden, scale=0.3) + 1
        calls: list[tuple[Fn, Fn]] = []
        for _ in range(rotations(work)):
            x, r = self.randn(rows, self.hidden, scale=3.0), self.randn(rows, self.hidden)
            if residual:
                calls.append((partial(fused.add_rms_norm, x, r, w, 1e-5),
                              partial(reference.add_rms_norm, x, r, w, 1e-5)))
            else:
                calls.append((partial(fused.rms_norm, x, w, 1e-5), partial(reference.rms_norm, x, w, 1e-5)))
        x, r = self.randn(rows, self.hidden, scale=3.0), self.randn(rows, self.hidden)
        got = fused.add_rms_norm(x, r, w, 1e-5)[0] if residual else fused.rms_norm(x, w, 1e-5)
        want = reference.add_rms_norm(x, r, w, 1e-5)[0] if residual else reference.rms_norm(x, w, 1e-5)
        check = (got.float(), want.float())  # the same roundings as the reference: compared in its dtype
        self.report("add_norm" if residual else "rms_norm", f"rows{rows}", calls, check, work, "GB/s")

    def rotary(self, t: int) -> None:
        from kvfleet_kernels import fused

        heads = self.h + self.kvh  # queries and keys, rotated in one call as the model does
        work = 2 * t * heads * self.d * self.elt + 2 * t * self.d * self.elt
        calls: list[tuple[Fn, Fn]] = []
        for _ in range(rotations(work)):
            x, cos, sin = self.randn(t, heads, self.d), self.randn(t, self.d), self.randn(t, self.d)
            calls.append((partial(fused.rotary, x, cos, sin), partial(reference.rotary, x, cos, sin)))
        x, cos, sin = self.randn(t, heads, self.d), self.randn(t, self.d), self.randn(t, self.d)
        check = (fused.rotary(x, cos, sin).float(), reference.rotary(x.float(), cos.float(), sin.float()))
        self.report("rotary", f"t{t}", calls, check, work, "GB/s")

    def quant(self, op: str, m: int, n: int, k: int) -> None:
        """w8a16 (int8 per channel), w4a16 (int4, groups of 128, zeros) or fp8: GB/s at decode, TFLOP/s else."""
        from kvfleet_kernels import quant_matmul as qm

        if op == "fp8" and self.device == "cuda" and not qm.fp8_scaled_mm_supported(torch.device("cuda")):
            return print("fp8: torch._scaled_mm needs compute capability 8.9 or later: not measured")
        gs, dev, bits = 128 if op == "w4a16" else k, self.device, 4 if op == "w4a16" else 8
        work = n * k * bits // 8 + k // gs * n * 4 * (2 if bits == 4 else 1) + (m * k + m * n) * self.elt
        calls: list[tuple[Fn, Fn]] = []
        for _ in range(rotations(work)):
            x, s = self.randn(m, k), torch.rand(n, k // gs, device=dev, generator=self.gen) * 2e-3 + 1e-3
            q = torch.randint(0, 2 ** bits, (n, k), device=dev, generator=self.gen).to(torch.int8)  # 8 bits: wraps
            z = torch.randint(0, 16, s.shape, device=dev, generator=self.gen).float() if bits == 4 else None
            if op == "fp8":
                q = torch.randn(n, k, device=dev, generator=self.gen).to(qm.FP8)
                fn: Fn = partial(qm.fp8_linear, x, q, s, scaled_mm=True)
                want, dense = qm.emulate_fp8_linear(x.float(), q, s), (q.float() * s).to(self.dtype)
            else:
                fn = partial(qm.w4a16_matmul, x, qm.pack_int4(q, s, z, gs)) if bits == 4 else \
                    partial(qm.w8a16_matmul, x, qm.pack_int8(q, s, z, gs))
                want, dense = qm.ref_w8a16(x.float(), q, s, z, gs), qm.dequantize(q, s, z, gs).to(self.dtype)
            calls.append((fn, partial(torch.matmul, x, dense.t())))  # the reference: the dense 16-bit matmul
        self.report(op, f"m{m} {n}x{k}", calls, (cast(torch.Tensor, fn()).float(), want),
                    work if m <= 64 else 2 * m * n * k, "GB/s" if m <= 64 else "TFLOP/s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvfleet_kernels.bench", description=__doc__)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--only", default="decode,prefill,kv_write,norm,rotary",
                        help="comma-separated ops; opt-in beside these: w8a16, w4a16, fp8")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--reps", type=int, default=50)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("kvfleet_kernels.bench needs a CUDA GPU and none is visible: nothing measured "
              "(the kernels' correctness runs on CPU: pytest tests/kernels)")
        return 0
    import triton  # type: ignore[import-untyped]

    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}, triton {triton.__version__}, "
          f"CUDA {torch.version.cuda}; {args.dtype}; Llama-3-8B shapes: {H} heads, {KVH} KV heads, head size {D}, "
          f"hidden {HIDDEN}, block size {BS}; median of {args.reps} after {args.warmup} warm-ups")
    bench = Bench(getattr(torch, args.dtype), args.warmup, args.reps)
    bench.ceilings()
    print(f"{'op':<10} {'case':<22} {'eager us':>9} {'graph us':>9} {'best rate':>17} {'of ceiling':>16}"
          "  reference (eager), its time over Triton's best, relative error against it")
    only = set(args.only.split(","))
    if "decode" in only:
        for batch in (1, 8, 32, 64, 128):
            bench.decode([4096] * batch, f"b{batch} ctx4096")
        ragged = torch.randint(1, 4097, (64,), generator=torch.Generator().manual_seed(1)).tolist()
        bench.decode(ragged, "b64 ctx1-4096")
    if "prefill" in only:
        for t, context in ((512, 0), (2048, 0), (512, 3584), (2048, 2048)):
            bench.prefill(t, context)
    if "kv_write" in only:
        for t in (64, 8192):
            bench.kv_write(t)
    if "norm" in only:
        for rows in (64, 8192):
            bench.norm(rows, residual=False)
            bench.norm(rows, residual=True)
    if "rotary" in only:
        for t in (64, 8192):
            bench.rotary(t)
    for op in [op for op in ("w8a16", "w4a16", "fp8") if op in only]:
        for (n, k), m in [(shape, m) for shape in QUANT_SHAPES for m in (1, 16)] + [((14336, 4096), 2048)]:
            bench.quant(op, m, n, k)
    return 0


if __name__ == "__main__":
    sys.exit(main())
