// Fused elementwise ops of a decoder layer for CPU: RMSNorm (with the residual add folded in), rotate-half rotary
// embedding and SwiGLU's silu(gate) * up, each one pass over its rows instead of the 4-10 tiny ops (and their
// temporaries) eager PyTorch runs for reference.py's versions.
//
// Results are reference.py's: float32 arithmetic, with a value rounded to bfloat16 (to nearest even, as
// c10::BFloat16) wherever PyTorch's op sequence rounds one, so bf16 outputs are PyTorch's bits: RMSNorm's
// normalised value before the weight, the residual sum, rotary's two products and their sum, silu before the
// multiply. Only RMSNorm's sum of squares (summation order) and silu's exp (a polynomial in the AVX2 loop) differ
// from PyTorch's in float32's last bits. Rows run on the calling thread unless a call is big enough to pay for
// torch's OpenMP pool (at::parallel_for); a row is always one thread's, so any thread count gives the same bits.
// AVX2+FMA code is chosen at run time, a portable loop elsewhere (or on request: tests).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <vector>

#include "cpu_simd.h"

namespace {

using bf16 = uint16_t;  // bfloat16 bits

// A call of at most this many elements runs on the calling thread (a decode step's rows: waking the pool costs
// more than the pass); bigger ones split their rows into tasks of about GRAIN elements.
constexpr int64_t SERIAL = 32768;
constexpr int64_t GRAIN = 16384;

inline float load1(const float* p) { return *p; }
inline float load1(const bf16* p) { return bf16_to_float(*p); }
inline bf16 to_bf16(float f) {  // round to nearest even, NaN to the quiet NaN: c10::BFloat16's conversion
  if (std::isnan(f)) return 0x7FC0;
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return static_cast<bf16>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
inline void store1(float* p, float v) { *p = v; }
inline void store1(bf16* p, float v) { *p = to_bf16(v); }
// v as computed, opaque to the optimiser: a rounded product that no FMA may fuse into the add after it (PyTorch
// rounds in between; GCC contracts a * b + c where the target has FMA, and the AVX2 code's has).
inline float opaque(float v) {
#if defined(__x86_64__) || defined(_M_X64)
  asm("" : "+x"(v));
#elif defined(__aarch64__)
  asm("" : "+w"(v));
#endif
  return v;
}
template <typename T>
inline float round1(float v) {  // v as T would hold it
  if constexpr (std::is_same_v<T, bf16>) {
    const bf16 b = to_bf16(v);
    return load1(&b);
  } else {
    return opaque(v);
  }
}

// ---- Portable rows (also the AVX2 loops' tails) ----------------------------------------------------------------

// One row of H: o = w * round_X(s * rsqrt(mean(s^2) + eps)), s = x, or (ADD) s = round_X(r + x) stored to ro.
template <bool ADD, typename XT, typename WT, typename OT>
void norm_row(const XT* x, const XT* r, XT* ro, const WT* w, OT* o, int64_t H, float eps) {
  double ss = 0.;  // one chain: in double, or its rounding grows with H (PyTorch's cascade sum does not)
  for (int64_t i = 0; i < H; ++i) {
    float v = load1(x + i);
    if constexpr (ADD) {
      v = round1<XT>(load1(r + i) + v);
      store1(ro + i, v);
    }
    ss += static_cast<double>(v) * v;
  }
  const XT* s = ADD ? ro : x;
  const float inv = 1.f / std::sqrt(static_cast<float>(ss) / static_cast<float>(H) + eps);
  for (int64_t i = 0; i < H; ++i) store1(o + i, load1(w + i) * round1<XT>(load1(s + i) * inv));
}

// One head of D = 2 * half from i0 on: o = x * c + rotate_half(x) * s, each product and the sum rounded as T.
template <typename T>
void rotary_row_from(const T* x, const T* c, const T* s, T* o, int64_t i0, int64_t half) {
  for (int64_t i = i0; i < half; ++i) {
    const float x1 = load1(x + i), x2 = load1(x + half + i);
    store1(o + i, round1<T>(x1 * load1(c + i)) - round1<T>(x2 * load1(s + i)));
    store1(o + half + i, round1<T>(x2 * load1(c + half + i)) + round1<T>(x1 * load1(s + half + i)));
  }
}
template <typename T>
void rotary_row(const T* x, const T* c, const T* s, T* o, int64_t half) { rotary_row_from(x, c, s, o, 0, half); }

// o = round_T(g / (1 + e^-g)) * u from i0 on (PyTorch's silu, then its multiply).
template <typename T>
void silu_mul_row_from(const T* g, const T* u, T* o, int64_t i0, int64_t n) {
  for (int64_t i = i0; i < n; ++i) {
    const float gi = load1(g + i);
    store1(o + i, round1<T>(gi / (1.f + std::exp(-gi))) * load1(u + i));
  }
}
template <typename T>
void silu_mul_row(const T* g, const T* u, T* o, int64_t n) { silu_mul_row_from(g, u, o, 0, n); }

// ---- AVX2 + FMA rows -------------------------------------------------------------------------------------------

#ifdef KVF_X86
KVF_AVX2 inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
KVF_AVX2 inline __m256 load8(const bf16* p) { return bf16x8_to_float(p); }
// Each lane's bf16 bits (in its low half), rounded as to_bf16 does.
KVF_AVX2 inline __m256i bf16_bits(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i bias = _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1)),
                                        _mm256_set1_epi32(0x7FFF));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
}
KVF_AVX2 inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
KVF_AVX2 inline void store8(bf16* p, __m256 v) {
  const __m256i r = bf16_bits(v);  // lanes <= 0xFFFF: the unsigned-saturating pack keeps them as they are
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}
template <typename T>
KVF_AVX2 inline __m256 round8(__m256 v) {
  if constexpr (std::is_same_v<T, bf16>) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits(v), 16));
  } else {
    asm("" : "+x"(v));  // as opaque(): no FMA across it
    return v;
  }
}
KVF_AVX2 inline float hsum(__m256 v) {
  const __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 b = _mm_add_ps(a, _mm_movehl_ps(a, a));
  return _mm_cvtss_f32(_mm_add_ss(b, _mm_movehdup_ps(b)));
}


template <bool ADD, typename XT, typename WT, typename OT>
KVF_AVX2 void norm_row_avx2(const XT* x, const XT* r, XT* ro, const WT* w, OT* o, int64_t H, float eps) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();  // two FMA chains
  int64_t i = 0;
  for (; i + 16 <= H; i += 16) {
    __m256 v0 = load8(x + i), v1 = load8(x + i + 8);
    if constexpr (ADD) {
      v0 = round8<XT>(_mm256_add_ps(load8(r + i), v0));
      v1 = round8<XT>(_mm256_add_ps(load8(r + i + 8), v1));
      store8(ro + i, v0);
      store8(ro + i + 8, v1);
    }
    a0 = _mm256_fmadd_ps(v0, v0, a0);
    a1 = _mm256_fmadd_ps(v1, v1, a1);
  }
  for (; i + 8 <= H; i += 8) {
    __m256 v = load8(x + i);
    if constexpr (ADD) {
      v = round8<XT>(_mm256_add_ps(load8(r + i), v));
      store8(ro + i, v);
    }
    a0 = _mm256_fmadd_ps(v, v, a0);
  }
  float ss = hsum(_mm256_add_ps(a0, a1));
  for (; i < H; ++i) {
    float v = load1(x + i);
    if constexpr (ADD) {
      v = round1<XT>(load1(r + i) + v);
      store1(ro + i, v);
    }
    ss += v * v;
  }
  const XT* s = ADD ? ro : x;
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(H) + eps);
  const __m256 vinv = _mm256_set1_ps(inv);
  for (i = 0; i + 8 <= H; i += 8)
    store8(o + i, _mm256_mul_ps(load8(w + i), round8<XT>(_mm256_mul_ps(load8(s + i), vinv))));
  for (; i < H; ++i) store1(o + i, load1(w + i) * round1<XT>(load1(s + i) * inv));
}

template <typename T>
KVF_AVX2 void rotary_row_avx2(const T* x, const T* c, const T* s, T* o, int64_t half) {
  int64_t i = 0;
  for (; i + 8 <= half; i += 8) {
    const __m256 x1 = load8(x + i), x2 = load8(x + half + i);
    const __m256 a = round8<T>(_mm256_mul_ps(x1, load8(c + i))), b = round8<T>(_mm256_mul_ps(x2, load8(s + i)));
    const __m256 a2 = round8<T>(_mm256_mul_ps(x2, load8(c + half + i)));
    const __m256 b2 = round8<T>(_mm256_mul_ps(x1, load8(s + half + i)));
    store8(o + i, _mm256_sub_ps(a, b));
    store8(o + half + i, _mm256_add_ps(a2, b2));
  }
  rotary_row_from(x, c, s, o, i, half);
}

template <typename T>
KVF_AVX2 void silu_mul_row_avx2(const T* g, const T* u, T* o, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 gv = load8(g + i);
    const __m256 silu = round8<T>(_mm256_div_ps(gv, _mm256_add_ps(one, exp8(_mm256_xor_ps(gv, sign)))));
    store8(o + i, _mm256_mul_ps(silu, load8(u + i)));
  }
  silu_mul_row_from(g, u, o, i, n);
}

#endif

// ---- Drivers ---------------------------------------------------------------------------------------------------

// f(r0, r1) over rows [0, rows) of width elements each: inline when small, else torch's pool.
template <typename F>
void for_rows(int64_t rows, int64_t width, const F& f) {
  if (rows * width <= SERIAL || rows == 1 || at::get_num_threads() == 1) return f(0, rows);
  at::parallel_for(0, rows, std::max<int64_t>(1, GRAIN / std::max<int64_t>(width, 1)), f);
}

// f(T{}) for the element type of a float32 / bfloat16 tensor (the only two check() lets through).
template <typename F>
void with_type(at::ScalarType s, const F& f) {
  if (s == at::kFloat) f(float{});
  else f(bf16{});
}

void check(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), "kvfleet_cpu_fused.", op, ": ", name, " must be a CPU tensor, not on ",
              t.device());
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, "kvfleet_cpu_fused.", op, ": ",
              name, " has dtype ", t.scalar_type(), ", not supported (float32 or bfloat16)");
}

// t as [rows, last] with its last dim dense: a 2-D t as it is (any row stride), anything else a dense copy's view.
at::Tensor as_rows(const at::Tensor& t) {
  if (t.dim() == 2 && (t.stride(1) == 1 || t.size(1) <= 1)) return t;
  return t.contiguous().view({-1, t.size(-1)});
}

// RMSNorm of x, or (residual given) of residual + x: (normed, the new residual or an undefined tensor).
std::tuple<at::Tensor, at::Tensor> norm(const at::Tensor& x, const at::Tensor* residual, const at::Tensor& weight,
                                        double eps, bool portable, const char* op) {
  check(x, op, "x");
  check(weight, op, "weight");
  TORCH_CHECK(x.dim() >= 1, "kvfleet_cpu_fused.", op, ": x must have a hidden dim");
  const int64_t H = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == H, "kvfleet_cpu_fused.", op, ": weight must be [", H,
              "], not ", weight.sizes());
  if (residual) {
    check(*residual, op, "residual");
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type(), "kvfleet_cpu_fused.",
                op, ": residual ", residual->sizes(), " ", residual->scalar_type(), " must match x ", x.sizes(), " ",
                x.scalar_type());
  }
  // weight * normed.to(x.dtype): PyTorch's promotion, bf16 only when both are.
  const bool bf16_out = x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16;
  at::Tensor out = at::empty(x.sizes(), x.options().dtype(bf16_out ? at::kBFloat16 : at::kFloat));
  at::Tensor res = residual ? at::empty(x.sizes(), x.options()) : at::Tensor();
  if (x.numel() == 0) return {out, res};
  const at::Tensor xr = as_rows(x), rr = residual ? as_rows(*residual) : xr, w = weight.contiguous();
  const int64_t T = xr.size(0), xs = xr.stride(0), rs = rr.stride(0);
  const bool avx2 = has_avx2() && !portable;
  with_type(x.scalar_type(), [&](auto xt) {
    with_type(weight.scalar_type(), [&](auto wt) {
      using XT = decltype(xt);
      using WT = decltype(wt);
      using OT = std::conditional_t<std::is_same_v<XT, bf16> && std::is_same_v<WT, bf16>, bf16, float>;
      using Fn = void (*)(const XT*, const XT*, XT*, const WT*, OT*, int64_t, float);
      Fn fn = residual ? &norm_row<true, XT, WT, OT> : &norm_row<false, XT, WT, OT>;
#ifdef KVF_X86
      if (avx2) fn = residual ? &norm_row_avx2<true, XT, WT, OT> : &norm_row_avx2<false, XT, WT, OT>;
#endif
      const XT* xp = static_cast<const XT*>(xr.const_data_ptr());
      const XT* rp = static_cast<const XT*>(rr.const_data_ptr());
      XT* rop = residual ? static_cast<XT*>(res.mutable_data_ptr()) : nullptr;
      const WT* wp = static_cast<const WT*>(w.const_data_ptr());
      OT* op = static_cast<OT*>(out.mutable_data_ptr());
      const float e = static_cast<float>(eps);
      for_rows(T, H, [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; ++t)
          fn(xp + t * xs, rp + t * rs, rop ? rop + t * H : nullptr, wp, op + t * H, H, e);
      });
    });
  });
  return {out, res};
}

// x [T, H] (or any shape: rows of its last dim), weight [H].
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool portable) {
  return std::get<0>(norm(x, nullptr, weight, eps, portable, "rms_norm"));
}

// residual + x in x's dtype, then its RMSNorm: (normed, new residual); neither input is written.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps, bool portable) {
  return norm(x, &residual, weight, eps, portable, "add_rms_norm");
}

// x [T, heads, D] (any token and head strides, D dense: the model's view into its packed QKV is read in place),
// cos / sin [T, D] in x's dtype -> [T, heads, D] contiguous.
at::Tensor rotary(const at::Tensor& x_in, const at::Tensor& cos_in, const at::Tensor& sin_in, bool portable) {
  check(x_in, "rotary", "x");
  check(cos_in, "rotary", "cos");
  check(sin_in, "rotary", "sin");
  TORCH_CHECK(x_in.dim() == 3, "kvfleet_cpu_fused.rotary: x must be [T, heads, D], not ", x_in.sizes());
  const int64_t T = x_in.size(0), NH = x_in.size(1), D = x_in.size(2);
  TORCH_CHECK(D % 2 == 0, "kvfleet_cpu_fused.rotary: the head size ", D, " must be even");
  for (const at::Tensor* t : {&cos_in, &sin_in})
    TORCH_CHECK(t->dim() == 2 && t->size(0) == T && t->size(1) == D && t->scalar_type() == x_in.scalar_type(),
                "kvfleet_cpu_fused.rotary: cos and sin must be [", T, ", ", D, "] ", x_in.scalar_type(), ", not ",
                t->sizes(), " ", t->scalar_type());
  at::Tensor out = at::empty({T, NH, D}, x_in.options());
  if (out.numel() == 0) return out;
  const at::Tensor x = x_in.stride(2) == 1 ? x_in : x_in.contiguous();
  const at::Tensor c = cos_in.stride(1) == 1 ? cos_in : cos_in.contiguous();
  const at::Tensor s = sin_in.stride(1) == 1 ? sin_in : sin_in.contiguous();
  const int64_t xs0 = x.stride(0), xs1 = x.stride(1), cs = c.stride(0), ss = s.stride(0), half = D / 2;
  const bool avx2 = has_avx2() && !portable;
  with_type(x.scalar_type(), [&](auto xt) {
    using E = decltype(xt);
    using Fn = void (*)(const E*, const E*, const E*, E*, int64_t);
    Fn fn = &rotary_row<E>;
#ifdef KVF_X86
    if (avx2) fn = &rotary_row_avx2<E>;
#endif
    const E* xp = static_cast<const E*>(x.const_data_ptr());
    const E* cp = static_cast<const E*>(c.const_data_ptr());
    const E* sp = static_cast<const E*>(s.const_data_ptr());
    E* op = static_cast<E*>(out.mutable_data_ptr());
    for_rows(T, NH * D, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t)
        for (int64_t h = 0; h < NH; ++h)
          fn(xp + t * xs0 + h * xs1, cp + t * cs, sp + t * ss, op + (t * NH + h) * D, half);
    });
  });
  return out;
}

// gate_up [..., 2N] (gate then up) -> silu(gate) * up [..., N].
at::Tensor silu_and_mul(const at::Tensor& gate_up, bool portable) {
  check(gate_up, "silu_and_mul", "gate_up");
  TORCH_CHECK(gate_up.dim() >= 1 && gate_up.size(-1) % 2 == 0,
              "kvfleet_cpu_fused.silu_and_mul: gate_up's last dim must be even (gate then up), not ", gate_up.sizes());
  const int64_t N = gate_up.size(-1) / 2;
  std::vector<int64_t> sizes = gate_up.sizes().vec();
  sizes.back() = N;
  at::Tensor out = at::empty(sizes, gate_up.options());
  if (out.numel() == 0) return out;
  const at::Tensor g = as_rows(gate_up);
  const int64_t T = g.size(0), gs = g.stride(0);
  const bool avx2 = has_avx2() && !portable;
  with_type(g.scalar_type(), [&](auto gt) {
    using E = decltype(gt);
    using Fn = void (*)(const E*, const E*, E*, int64_t);
    Fn fn = &silu_mul_row<E>;
#ifdef KVF_X86
    if (avx2) fn = &silu_mul_row_avx2<E>;
#endif
    const E* gp = static_cast<const E*>(g.const_data_ptr());
    E* op = static_cast<E*>(out.mutable_data_ptr());
    for_rows(T, 2 * N, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) fn(gp + t * gs, gp + t * gs + N, op + t * N, N);
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(kvfleet_cpu_fused, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, bool portable=False) -> Tensor", &rms_norm);
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps, bool portable=False) -> (Tensor, Tensor)",
        &add_rms_norm);
  m.def("rotary(Tensor x, Tensor cos, Tensor sin, bool portable=False) -> Tensor", &rotary);
  m.def("silu_and_mul(Tensor gate_up, bool portable=False) -> Tensor", &silu_and_mul);
  m.def("has_avx2() -> bool", [] { return has_avx2(); });
}
