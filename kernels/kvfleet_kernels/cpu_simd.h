// What the CPU C++ ops share: the x86 AVX2 target attribute (picked at run time, no -march), the run-time check,
// bfloat16 to float32, and a vector e^x. Included by cpu_attention.cpp, cpu_fused.cpp, cpu_argmax.cpp and cpu_tiles.h
// (cpu_int8.cpp, cpu_f32.cpp); each builds its own copy.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

// A bfloat16 (its bits, the upper half of a float's) as that float: exact.
inline float bf16_to_float(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define KVF_X86 1
#define KVF_AVX2 __attribute__((target("avx2,fma")))
// Fully unrolled before scalar replacement, or GCC keeps the accumulator arrays in memory (a store per FMA).
#define KVF_UNROLL _Pragma("GCC unroll 16")

// 8 bfloat16s (bits) as 8 floats: exact.
KVF_AVX2 static inline __m256 bf16x8_to_float(const uint16_t* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

// Whether this CPU runs the AVX2 + FMA paths (checked once).
static inline bool has_avx2() {
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return yes;
}

#define KVF_AVX512 __attribute__((target("avx512f,fma")))

// Whether this CPU runs the AVX-512 paths (checked once). KVFLEET_CPU_AVX512=0 keeps the AVX2 ones (tests compare the
// two, which must agree bit for bit).
static inline bool has_avx512() {
  static const bool yes = [] {
    const char* env = std::getenv("KVFLEET_CPU_AVX512");
    return __builtin_cpu_supports("avx512f") && has_avx2() && !(env != nullptr && std::strcmp(env, "0") == 0);
  }();
  return yes;
}

// e^x (Cephes' expf: reduction by ln 2, degree-5 polynomial; ~2 ulp). Above 88 it gives inf (e^88.72 is float's
// largest), below -87 about e^-87 rather than 0: beside a softmax's max of 1, or in silu's 1 + e^-g, the same.
KVF_AVX2 static inline __m256 exp8(__m256 x) {
  const __m256 over = _mm256_cmp_ps(x, _mm256_set1_ps(88.f), _CMP_GT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_set1_ps(88.f));
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(c));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_blendv_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(e)), _mm256_set1_ps(INFINITY), over);
}
#else
static inline bool has_avx2() { return false; }
static inline bool has_avx512() { return false; }
#endif
