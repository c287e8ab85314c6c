// fp32 GEMM for few rows on CPU: y[M, n] = x[M, K] · w[n, K]ᵀ, the weight prepacked (cpu_f32.py) as [NT, K, 16].
//
// A decode or verification step runs a linear on 1-8 rows, where the time is a read of the weight. MKL's sgemm took
// about twice its one-row time from 2 rows on here (2-core AMD EPYC, AVX2: 1408x256 weight, 57 us at one row, 105
// at two, 116 at five), and oneDNN's prepacked path costs 25-40 us a call before any work; cpu_tiles.h streams each
// 16-column tile once for up to 96 rows. Below the row count measured at load (layers/gemm_crossover.py) a linear
// runs this; above it oneDNN's blocked GEMM, which wins large batches.
#include <torch/library.h>

#include "cpu_tiles.h"

namespace {

// x [M, K] fp32 (rows may be strided), wp [NT, K, 16] fp32, n <= 16*NT real columns.
at::Tensor f32_linear(const at::Tensor& x, const at::Tensor& wp, int64_t n, bool portable) {
  TORCH_CHECK(wp.scalar_type() == at::kFloat, "wp: fp32 [NT, K, 16] tiles");
  return kvf_tiles::tiled_linear<float>(x, wp, nullptr, n, portable);
}

}  // namespace

TORCH_LIBRARY(kvfleet_cpu_f32, m) {
  m.def("f32_linear(Tensor x, Tensor wp, int n, bool portable=False) -> Tensor", &f32_linear);
}
