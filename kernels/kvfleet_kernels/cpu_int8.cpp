// Weight-only INT8 GEMM for CPU: y[M, n] = (x[M, K] · q[n, K]ᵀ) · scale[n], fp32 activations and accumulation.
//
// The weight is prepacked (cpu_int8.py) as [NT, K, 16] int8: tile t holds output columns 16t..16t+15, one
// 16-byte row per k, so a tile streams contiguously. The per-channel scale multiplies the finished dot product
// (it factors out of the sum), so the only rounding is fp32 accumulation.
// Each 16-wide k-row is dequantized in registers (vpmovsxbd + vcvtdq2ps) and FMA'd into the accumulators of up
// to 6 rows of x. Rows beyond 6 dequantize the tile again: on Zen 3 the conversions issue on other FP pipes than
// the FMAs, and this measured as fast or faster at every M (1..1024) than dequantizing a K-block into an L1 buffer
// once and reloading it per 6-row block (the BLIS-style alternative; e.g. 5632x1024 weight, M=16, two threads:
// 1.76 ms against 1.92, oneDNN's fp32 GEMM 3.16).
// The loops are cpu_tiles.h's, shared with the fp32 op (OpenMP through torch's own pool splits the tiles; AVX2+FMA
// code is chosen at run time, with a portable loop elsewhere, so one build runs on any x86-64 CPU).
#include <torch/library.h>

#include "cpu_tiles.h"

namespace {

// x [M, K] fp32 (rows may be strided), qp [NT, K, 16] int8, scale [NT*16] fp32, n <= 16*NT real columns.
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& qp, const at::Tensor& scale, int64_t n,
                       bool portable) {
  TORCH_CHECK(qp.dim() == 3 && qp.scalar_type() == at::kChar, "qp: int8 [NT, K, 16] tiles");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == qp.size(0) * kvf_tiles::NR,
              "scale: contiguous fp32 [NT*16]");
  return kvf_tiles::tiled_linear<int8_t>(x, qp, scale.const_data_ptr<float>(), n, portable);
}

}  // namespace

TORCH_LIBRARY(kvfleet_cpu_int8, m) {
  m.def("int8_linear(Tensor x, Tensor qp, Tensor scale, int n, bool portable=False) -> Tensor", &int8_linear);
  m.def("has_avx2() -> bool", [] { return has_avx2(); });
}
