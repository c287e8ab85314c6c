// The weight-streaming GEMM the CPU linear ops share: y[M, n] = x[M, K] · W[n, K]ᵀ (· scale[n]), for a weight
// prepacked as [NT, K, 16] (tile t holds output columns 16t..16t+15, one 16-wide row per k), so a tile streams
// contiguously and every row of x in a register block reads it once. Few rows (decode, verification) make a linear
// a read of its weight: this reads it once per 96 rows, where MKL's sgemm on 2-8 rows took about twice its one-row
// time here. The element type W is float (cpu_f32.cpp) or int8 dequantized in registers (cpu_int8.cpp); a load16
// overload per type is all that differs. Included by both; each builds its own copy.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_simd.h"

namespace kvf_tiles {

constexpr int64_t NR = 16;   // output columns per packed tile (two 8-float registers)
constexpr int64_t MR = 6;    // rows per register block: 6 x 2 accumulators + 2 weights + 1 broadcast <= 16 ymm
constexpr int64_t MC = 96;   // rows per pass over the tiles, so a long x (prefill) is re-read from L2, not memory

// Portable loops (no AVX2, or not x86): c[r, 0:16] = Σ_k x[r, k] · w[k, 0:16] for rows [0, rows).
template <class W>
void rows_portable(const float* x, int64_t lda, int64_t rows, const W* wt, int64_t K, float* c) {
  for (int64_t r = 0; r < rows; ++r) {
    float acc[NR] = {};
    for (int64_t k = 0; k < K; ++k) {
      const float a = x[r * lda + k];
      for (int64_t j = 0; j < NR; ++j) acc[j] += a * static_cast<float>(wt[k * NR + j]);
    }
    std::memcpy(c + r * NR, acc, sizeof(acc));
  }
}

#ifdef KVF_X86
// One 16-wide k-row of a tile into two registers.
KVF_AVX2 inline void load16(const float* p, __m256& lo, __m256& hi) {
  lo = _mm256_loadu_ps(p);
  hi = _mm256_loadu_ps(p + 8);
}

KVF_AVX2 inline void load16(const int8_t* p, __m256& lo, __m256& hi) {
  // Two 8-byte loads sign-extended straight from memory (vpmovsxbd ymm, m64): no shuffle to split a 16-byte load.
  lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8))));
}

// R rows against one tile: one accumulator pair per row, summed over k in order. The same order for every R, so a
// row's result does not depend on how many rows share its block or its call (a request's logits do not change with
// what it is batched with). Few rows stream the weight from L3 or memory, which bounds them rather than the FMA
// chain (a 64-byte k-row per 4-cycle FMA is 16 B a cycle, above this machine's bandwidth).
template <class W, int R>
KVF_AVX2 void rows_avx2_block(const float* x, int64_t lda, const W* wt, int64_t K, float* c) {
  __m256 acc[R][2];
  KVF_UNROLL
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m256 b0, b1;
    load16(wt + k * NR, b0, b1);
    KVF_UNROLL
    for (int r = 0; r < R; ++r) {
      const __m256 a = _mm256_broadcast_ss(x + r * lda + k);
      acc[r][0] = _mm256_fmadd_ps(a, b0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(a, b1, acc[r][1]);
    }
  }
  KVF_UNROLL
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(c + r * NR, acc[r][0]);
    _mm256_storeu_ps(c + r * NR + 8, acc[r][1]);
  }
}

template <class W>
KVF_AVX2 void rows_avx2(const float* x, int64_t lda, int64_t rows, const W* wt, int64_t K, float* c) {
  for (int64_t r0 = 0; r0 < rows; r0 += MR) {
    const float* xr = x + r0 * lda;
    float* cr = c + r0 * NR;
    switch (std::min(rows - r0, MR)) {
      case 1: rows_avx2_block<W, 1>(xr, lda, wt, K, cr); break;
      case 2: rows_avx2_block<W, 2>(xr, lda, wt, K, cr); break;
      case 3: rows_avx2_block<W, 3>(xr, lda, wt, K, cr); break;
      case 4: rows_avx2_block<W, 4>(xr, lda, wt, K, cr); break;
      case 5: rows_avx2_block<W, 5>(xr, lda, wt, K, cr); break;
      default: rows_avx2_block<W, 6>(xr, lda, wt, K, cr); break;
    }
  }
}
// AVX-512: a 16-wide k-row is one register. Each row keeps S partial sums (k mod S), added at the end in one fixed
// order ((s0 + s1) + (s2 + s3)): one row's sum is then S independent FMA chains rather than one, where a chain
// stalls on the FMA's latency (4 cycles) and a decode's single row would run at a quarter of the FMA rate. The order
// is the same for every R, so as above a row's result does not depend on its block; it differs from the AVX2 path's
// (one chain), so results agree with that path to rounding, not bit for bit.
constexpr int64_t S512 = 4;

KVF_AVX512 inline __m512 load16x(const float* p) { return _mm512_loadu_ps(p); }

KVF_AVX512 inline __m512 load16x(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

template <class W, int R>
KVF_AVX512 void rows_avx512_block(const float* x, int64_t lda, const W* wt, int64_t K, float* c) {
  __m512 acc[R][S512];
  KVF_UNROLL
  for (int r = 0; r < R; ++r)
    KVF_UNROLL
    for (int s = 0; s < S512; ++s) acc[r][s] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + S512 <= K; k += S512) {
    KVF_UNROLL
    for (int s = 0; s < S512; ++s) {
      const __m512 b = load16x(wt + (k + s) * NR);
      KVF_UNROLL
      for (int r = 0; r < R; ++r) acc[r][s] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * lda + k + s]), b, acc[r][s]);
    }
  }
  for (int s = 0; k < K; ++k, ++s) {  // the last K mod S k-rows, each into its own partial sum as above
    const __m512 b = load16x(wt + k * NR);
    KVF_UNROLL
    for (int r = 0; r < R; ++r) acc[r][s] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * lda + k]), b, acc[r][s]);
  }
  KVF_UNROLL
  for (int r = 0; r < R; ++r)
    _mm512_storeu_ps(c + r * NR, _mm512_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]), _mm512_add_ps(acc[r][2], acc[r][3])));
}

template <class W>
KVF_AVX512 void rows_avx512(const float* x, int64_t lda, int64_t rows, const W* wt, int64_t K, float* c) {
  for (int64_t r0 = 0; r0 < rows; r0 += MR) {
    const float* xr = x + r0 * lda;
    float* cr = c + r0 * NR;
    switch (std::min(rows - r0, MR)) {
      case 1: rows_avx512_block<W, 1>(xr, lda, wt, K, cr); break;
      case 2: rows_avx512_block<W, 2>(xr, lda, wt, K, cr); break;
      case 3: rows_avx512_block<W, 3>(xr, lda, wt, K, cr); break;
      case 4: rows_avx512_block<W, 4>(xr, lda, wt, K, cr); break;
      case 5: rows_avx512_block<W, 5>(xr, lda, wt, K, cr); break;
      default: rows_avx512_block<W, 6>(xr, lda, wt, K, cr); break;
    }
  }
}
#endif

// y[r, 16t + j] = c[r, j] (· scale[16t + j]) for the columns that exist (the last tile may be partial).
inline void store_tile(const float* c, int64_t rows, int64_t t, const float* scale, int64_t n, float* y) {
  const int64_t j0 = t * NR, width = std::min(NR, n - j0);
  for (int64_t r = 0; r < rows; ++r) {
    if (scale == nullptr)
      std::memcpy(y + r * n + j0, c + r * NR, static_cast<size_t>(width) * sizeof(float));
    else
      for (int64_t j = 0; j < width; ++j) y[r * n + j0 + j] = c[r * NR + j] * scale[j0 + j];
  }
}

// x [M, K] fp32 (rows may be strided), wp [NT, K, 16] of W, scale [NT*16] fp32 or nullptr, n <= 16*NT real columns.
// portable: the plain C++ loop even where AVX2 runs (so tests check it on any machine).
template <class W>
at::Tensor tiled_linear(const at::Tensor& x_in, const at::Tensor& wp, const float* scale, int64_t n, bool portable) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat && x_in.device().is_cpu(), "x: 2-D fp32 CPU");
  TORCH_CHECK(wp.dim() == 3 && wp.size(2) == NR && wp.is_contiguous(), "the weight: contiguous [NT, K, 16] tiles");
  TORCH_CHECK(wp.size(1) == x_in.size(1), "x has ", x_in.size(1), " columns, the weight ", wp.size(1));
  TORCH_CHECK(n > (wp.size(0) - 1) * NR && n <= wp.size(0) * NR, "n does not match the packed tiles");
  const at::Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), NT = wp.size(0), lda = x.stride(0);
  at::Tensor y = at::empty({M, n}, x.options());
  if (M == 0) return y;
  if (K == 0) return y.zero_();
  const float* xp = x.const_data_ptr<float>();
  const W* w = wp.const_data_ptr<W>();
  float* yp = y.mutable_data_ptr<float>();
  const bool avx2 = has_avx2() && !portable, avx512 = has_avx512() && !portable;
  // Enough tiles per task that a thread's share outweighs waking it (~64K multiply-adds).
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / (NR * K * std::min(M, MC)));
  at::parallel_for(0, NT, grain, [&](int64_t t0, int64_t t1) {
    const int64_t mc = std::min(M, MC);
    std::vector<float> c(static_cast<size_t>(mc * NR));
    for (int64_t m0 = 0; m0 < M; m0 += mc) {  // one pass for decode batches
      const int64_t rows = std::min(mc, M - m0);
      const float* xm = xp + m0 * lda;
      for (int64_t t = t0; t < t1; ++t) {
        const W* wt = w + t * K * NR;
#ifdef KVF_X86
        if (avx512)
          rows_avx512<W>(xm, lda, rows, wt, K, c.data());
        else if (avx2)
          rows_avx2<W>(xm, lda, rows, wt, K, c.data());
        else
#endif
          rows_portable<W>(xm, lda, rows, wt, K, c.data());
        store_tile(c.data(), rows, t, scale, n, yp + m0 * n);
      }
    }
  });
  return y;
}

}  // namespace kvf_tiles
