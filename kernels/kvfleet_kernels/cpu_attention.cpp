// Paged decode attention for CPU: one query token per sequence over its cached K/V, read in place through the
// block table (no gathered copy), from a float32 / bfloat16 / int8 / fp8 (E4M3) cache, the last two with a
// float32 scale per (block, slot, KV head) (kv_quant.py). Queries, accumulation and output are float32.
//
// A work item is a sequence's KV heads (all of them, or a share when there are fewer sequences than threads).
// It walks the context in chunks of CHUNK tokens; per KV head, its GROUP query heads share every K/V row loaded:
// the chunk's scores (q·k · scale · k's row scale), the softmax's running max and sum updated (the accumulator
// rescaled when the max grows: online softmax), then the chunk's V rows accumulated with those weights (times
// v's row scale). Heads in lockstep read each chunk's cache blocks whole. Threads (torch's OpenMP pool, via
// at::parallel_for) take runs of items of equal total length; an item's arithmetic never depends on the split,
// so any thread count gives the same bits. AVX2+FMA code is chosen at run time, a portable loop elsewhere.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Float8_e4m3fn.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_simd.h"

namespace {

// Tokens per online-softmax step. On a 2-core EPYC (Zen 3), interleaved medians over the tiny/med shapes: 32 is
// best on batches of 16-64 (memory-bound: 5-10% over 64 and 256), one sequence prefers 64-256 (~10%); the
// two-pass form (one chunk: all scores, then all of V) is up to 1.3x slower on 2048-token contexts, where a
// head's V rows are out of cache again after its K pass.
constexpr int64_t CHUNK = 32;
// Software prefetch of K and V rows this many tokens ahead: a block's rows are a short stride that the hardware
// prefetchers barely learn before the jump to the next block (2x on int8 caches, 10-20% on fp32).
constexpr int64_t PREFETCH = 16;

// fp8 E4M3 byte -> float for every byte (c10's own conversion, so exactly what the reference dequantizes).
const std::array<float, 256> kFp8 = [] {
  std::array<float, 256> t{};
  for (int i = 0; i < 256; ++i)
    t[i] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(i), c10::Float8_e4m3fn::from_bits()));
  return t;
}();

// Cache elements by storage type: float, uint16_t (bfloat16 bits), int8_t, uint8_t (fp8 bits).
inline float load1(const float* p) { return *p; }
inline float load1(const uint16_t* p) { return bf16_to_float(*p); }
inline float load1(const int8_t* p) { return static_cast<float>(*p); }
inline float load1(const uint8_t* p) { return kFp8[*p]; }

// One KV head of an item. s: scores [G, C] (row stride C); o: accumulators [G, D].
template <typename T>
struct Item {
  const float* q;      // [G, D] its query heads (a dense copy)
  const T *k, *v;      // row r of the cache (r = (block * bs + slot) * KVH) at r * D, offset to this head
  const float *ks, *vs;  // per-row scales, offset to this head, or null for an unquantized cache
  const int64_t* row;  // [len] each context token's cache row
  int64_t D, len;
  float scale;
};

struct Portable {
  template <typename T>
  static void scores(const Item<T>& a, int64_t g0, int64_t gh, int64_t t0, int64_t t1, float* s, int64_t C) {
    for (int64_t t = t0; t < t1; ++t) {
      const T* kr = a.k + a.row[t] * a.D;
      const float f = a.scale * (a.ks ? a.ks[a.row[t]] : 1.f);
      for (int64_t g = g0; g < g0 + gh; ++g) {
        float dot = 0.f;
        for (int64_t d = 0; d < a.D; ++d) dot += a.q[g * a.D + d] * load1(kr + d);
        s[g * C + t - t0] = dot * f;
      }
    }
  }
  static float exp_sum(float* s, int64_t n, float m) {  // s = e^(s - m); returns the sum
    float sum = 0.f;
    for (int64_t t = 0; t < n; ++t) sum += (s[t] = std::exp(s[t] - m));
    return sum;
  }
  template <typename T>
  static void accumulate(const Item<T>& a, int64_t g0, int64_t gh, int64_t t0, int64_t t1, const float* p,
                         int64_t C, float* o) {
    for (int64_t t = t0; t < t1; ++t) {
      const T* vr = a.v + a.row[t] * a.D;
      const float f = a.vs ? a.vs[a.row[t]] : 1.f;  // v's row scale (no part of the softmax's sum)
      for (int64_t g = g0; g < g0 + gh; ++g)
        for (int64_t d = 0; d < a.D; ++d) o[g * a.D + d] += p[g * C + t - t0] * f * load1(vr + d);
    }
  }
};

#ifdef KVF_X86
KVF_AVX2 inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
KVF_AVX2 inline __m256 load8(const uint16_t* p) { return bf16x8_to_float(p); }
KVF_AVX2 inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
KVF_AVX2 inline __m256 load8(const uint8_t* p) {  // AVX2 has no fp8 conversion: a gather from the 1 KiB table
  const __m256i i = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_i32gather_ps(kFp8.data(), i, 4);
}

// Lane i = the sum of v[i]'s lanes.
KVF_AVX2 inline __m256 hsum8(const __m256* v) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}


// 8 dot products at a time, TN tokens x GH heads: each K vector converted once, 8 independent FMA chains.
template <int GH, typename T>
KVF_AVX2 void scores_avx2(const Item<T>& a, int64_t g0, int64_t t0, int64_t t1, float* s, int64_t C) {
  constexpr int TN = 8 / GH;
  for (int64_t t = t0; t < t1; t += TN) {
    const T* kr[TN];
    KVF_UNROLL for (int i = 0; i < TN; ++i) kr[i] = a.k + a.row[std::min(t + i, t1 - 1)] * a.D;  // a short tail repeats
    for (int64_t i = t + PREFETCH; g0 == 0 && i < std::min(t + PREFETCH + TN, a.len); ++i)
      for (int64_t b = 0; b < a.D * static_cast<int64_t>(sizeof(T)); b += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(a.k + a.row[i] * a.D) + b, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(a.v + a.row[i] * a.D) + b, _MM_HINT_T0);
      }
    __m256 acc[8];
    KVF_UNROLL for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t d = 0; d < a.D; d += 8) {
      __m256 kv[TN];
      KVF_UNROLL for (int i = 0; i < TN; ++i) kv[i] = load8(kr[i] + d);
      KVF_UNROLL for (int g = 0; g < GH; ++g) {
        const __m256 qv = _mm256_loadu_ps(a.q + (g0 + g) * a.D + d);
        KVF_UNROLL for (int i = 0; i < TN; ++i) acc[i * GH + g] = _mm256_fmadd_ps(qv, kv[i], acc[i * GH + g]);
      }
    }
    alignas(32) float dots[8];
    _mm256_store_ps(dots, hsum8(acc));
    for (int i = 0; i < TN && t + i < t1; ++i) {
      const float f = a.scale * (a.ks ? a.ks[a.row[t + i]] : 1.f);
      for (int g = 0; g < GH; ++g) s[(g0 + g) * C + t + i - t0] = dots[i * GH + g] * f;
    }
  }
}

// o[g, d:d+8NC] += Σ_t p[g, t] · v_t[d:d+8NC], GH x NC accumulators held in registers over the chunk.
template <int GH, int NC, typename T>
KVF_AVX2 void accumulate_avx2(const Item<T>& a, int64_t g0, int64_t t0, int64_t t1, const float* p, int64_t C,
                              float* o, int64_t d) {
  __m256 acc[GH][NC];
  KVF_UNROLL for (int g = 0; g < GH; ++g)
    KVF_UNROLL for (int c = 0; c < NC; ++c) acc[g][c] = _mm256_loadu_ps(o + (g0 + g) * a.D + d + 8 * c);
  for (int64_t t = t0; t < t1; ++t) {
    const T* vr = a.v + a.row[t] * a.D + d;
    const __m256 f = _mm256_set1_ps(a.vs ? a.vs[a.row[t]] : 1.f);  // v's row scale
    __m256 w[GH];
    KVF_UNROLL for (int g = 0; g < GH; ++g) w[g] = _mm256_mul_ps(_mm256_broadcast_ss(p + (g0 + g) * C + t - t0), f);
    KVF_UNROLL for (int c = 0; c < NC; ++c) {
      const __m256 vv = load8(vr + 8 * c);
      KVF_UNROLL for (int g = 0; g < GH; ++g) acc[g][c] = _mm256_fmadd_ps(w[g], vv, acc[g][c]);
    }
  }
  KVF_UNROLL for (int g = 0; g < GH; ++g)
    KVF_UNROLL for (int c = 0; c < NC; ++c) _mm256_storeu_ps(o + (g0 + g) * a.D + d + 8 * c, acc[g][c]);
}

template <int GH, typename T>
KVF_AVX2 void accumulate_all(const Item<T>& a, int64_t g0, int64_t t0, int64_t t1, const float* p, int64_t C,
                             float* o) {
  constexpr int NC = 8 / GH;  // 8 accumulators: enough independent FMA chains, few enough registers
  int64_t d = 0;
  for (; d + 8 * NC <= a.D; d += 8 * NC) accumulate_avx2<GH, NC>(a, g0, t0, t1, p, C, o, d);
  for (; d < a.D; d += 8) accumulate_avx2<GH, 1>(a, g0, t0, t1, p, C, o, d);
}

struct Avx2 {
  template <typename T>
  static void scores(const Item<T>& a, int64_t g0, int64_t gh, int64_t t0, int64_t t1, float* s, int64_t C) {
    gh == 1 ? scores_avx2<1>(a, g0, t0, t1, s, C) : gh == 2 ? scores_avx2<2>(a, g0, t0, t1, s, C)
            : gh == 4 ? scores_avx2<4>(a, g0, t0, t1, s, C) : scores_avx2<8>(a, g0, t0, t1, s, C);
  }
  KVF_AVX2 static float exp_sum(float* s, int64_t n, float m) {
    __m256 sum = _mm256_setzero_ps();
    int64_t t = 0;
    for (; t + 8 <= n; t += 8) {
      const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), _mm256_set1_ps(m)));
      _mm256_storeu_ps(s + t, e);
      sum = _mm256_add_ps(sum, e);
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, sum);
    float total = 0.f;
    for (const float x : lanes) total += x;
    return total + Portable::exp_sum(s + t, n - t, m);
  }
  template <typename T>
  static void accumulate(const Item<T>& a, int64_t g0, int64_t gh, int64_t t0, int64_t t1, const float* p,
                         int64_t C, float* o) {
    gh == 1 ? accumulate_all<1>(a, g0, t0, t1, p, C, o) : gh == 2 ? accumulate_all<2>(a, g0, t0, t1, p, C, o)
            : gh == 4 ? accumulate_all<4>(a, g0, t0, t1, p, C, o) : accumulate_all<8>(a, g0, t0, t1, p, C, o);
  }
};

#endif

// KV heads [h0, h1) of a sequence (a's pointers at head 0), in lockstep chunk by chunk -> out [n, D], n = the
// (h1 - h0) * G query heads. Scratch: s [G, C] scores, o [n, D] accumulators, ml [2n] running maxima and sums.
template <class K, typename T>
void run_item(const Item<T>& a, int64_t h0, int64_t h1, int64_t G, int64_t C, float* s, float* o, float* ml,
              float* out) {
  const int64_t D = a.D, n = (h1 - h0) * G, gh = std::min<int64_t>(G & -G, 8);  // heads per pass: 2^i dividing G
  float *m = ml, *l = ml + n;
  std::fill(o, o + n * D, 0.f);
  std::fill(m, m + n, -std::numeric_limits<float>::infinity());
  std::fill(l, l + n, 0.f);
  for (int64_t c0 = 0; c0 < a.len; c0 += C) {
    const int64_t c1 = std::min(a.len, c0 + C);
    for (int64_t h = h0; h < h1; ++h) {
      const int64_t j = (h - h0) * G;  // this KV head's first query head in the item
      Item<T> ah = a;
      ah.q += j * D, ah.k += h * D, ah.v += h * D;
      if (a.ks) ah.ks += h, ah.vs += h;
      for (int64_t g0 = 0; g0 < G; g0 += gh) K::scores(ah, g0, gh, c0, c1, s, C);
      for (int64_t g = j; g < j + G; ++g) {
        float* sg = s + (g - j) * C;
        const float mx = std::max(m[g], *std::max_element(sg, sg + c1 - c0));
        if (mx > m[g]) {  // a new max: what was summed so far scales by e^(old - new) (0 on the first chunk)
          const float f = std::exp(m[g] - mx);
          l[g] *= f;
          for (int64_t d = 0; d < D; ++d) o[g * D + d] *= f;
          m[g] = mx;
        }
        l[g] += K::exp_sum(sg, c1 - c0, m[g]);
      }
      for (int64_t g0 = 0; g0 < G; g0 += gh) K::accumulate(ah, g0, gh, c0, c1, s, C, o + j * D);
    }
  }
  for (int64_t g = 0; g < n; ++g) {
    const float inv = a.len ? 1.f / l[g] : 0.f;  // an empty context gives zeros
    for (int64_t d = 0; d < D; ++d) out[g * D + d] = o[g * D + d] * inv;
  }
}

struct Plan {
  const float* q;
  int64_t qs0, qs1, qs2, H, KVH, G, D, bs, C, R;  // R: items per sequence, each a run of its KV heads
  const int64_t* table;
  int64_t ts;                         // the table's row stride
  std::vector<int64_t> lens, bounds;  // bounds: each thread's first item, then B * R
  float scale;
};

template <class K, typename T>
void launch(const Plan& p, const T* k, const T* v, const float* ks, const float* vs, float* out) {
  const int64_t G = p.G, D = p.D, n = (p.KVH + p.R - 1) / p.R * G;  // the most query heads in one item
  const int64_t maxlen = *std::max_element(p.lens.begin(), p.lens.end());
  at::parallel_for(0, static_cast<int64_t>(p.bounds.size()) - 1, 1, [&](int64_t k0, int64_t k1) {
    std::vector<float> buf(static_cast<size_t>(G * p.C + n * (2 * D + 2)));
    std::vector<int64_t> rows(static_cast<size_t>(maxlen));
    float *s = buf.data(), *o = s + G * p.C, *qb = o + n * D, *ml = qb + n * D;
    for (int64_t i = p.bounds[k0]; i < p.bounds[k1]; ++i) {
      const int64_t b = i / p.R, h0 = i % p.R * p.KVH / p.R, h1 = (i % p.R + 1) * p.KVH / p.R, len = p.lens[b];
      for (int64_t t0 = 0; t0 < len; t0 += p.bs) {  // (a division per token cost as much as the dot products)
        const int64_t first = p.table[b * p.ts + t0 / p.bs] * p.bs * p.KVH;
        for (int64_t t = t0; t < std::min(len, t0 + p.bs); ++t) rows[t] = first + (t - t0) * p.KVH;
      }
      for (int64_t g = 0; g < (h1 - h0) * G; ++g)
        for (int64_t d = 0; d < D; ++d) qb[g * D + d] = p.q[b * p.qs0 + (h0 * G + g) * p.qs1 + d * p.qs2];
      run_item<K>(Item<T>{qb, k, v, ks, vs, rows.data(), D, len, p.scale}, h0, h1, G, p.C, s, o, ml,
                  out + (b * p.H + h0 * G) * D);
    }
  });
}

// q [B, H, D] fp32 (any strides); caches [N, bs, KVH, D], with scales [N, bs, KVH] fp32 when int8 / fp8;
// block_tables [B, W] int64; lengths: seq_lens [B] int64 or decode_plan's prefix mask [B, L] bool.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_tables, const at::Tensor& lengths, double scale,
                            const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale,
                            int64_t chunk, bool portable) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.device().is_cpu(), "q: [B, H, D] fp32 on CPU");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.dtype() == v_cache.dtype() &&
              k_cache.device().is_cpu() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "caches: alike, contiguous [N, bs, KVH, D] on CPU");
  const auto kind = k_cache.scalar_type();
  const bool quantized = kind == at::kChar || kind == at::kFloat8_e4m3fn;
  TORCH_CHECK(quantized || kind == at::kFloat || kind == at::kBFloat16, "cache dtype ", kind, " not supported");
  TORCH_CHECK(quantized == k_scale.has_value() && quantized == v_scale.has_value(), "scales go with int8/fp8 only");
  for (const auto& sc : {k_scale, v_scale})
    TORCH_CHECK(!sc || (sc->scalar_type() == at::kFloat && sc->is_contiguous() &&
                        sc->sizes() == k_cache.sizes().slice(0, 3)), "scales: contiguous fp32 [N, bs, KVH]");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), N = k_cache.size(0), bs = k_cache.size(1);
  const int64_t KVH = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && KVH > 0 && H % KVH == 0, "q's heads must be a multiple of the cache's");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == B && block_tables.scalar_type() == at::kLong,
              "block_tables: int64 [B, W]");
  const at::Tensor tables = block_tables.stride(1) == 1 ? block_tables : block_tables.contiguous();
  // A sequence's KV heads go together (its blocks read whole) unless that leaves threads too few items.
  const int64_t R = std::clamp<int64_t>(4 * at::get_num_threads() / std::max<int64_t>(B, 1), 1, KVH);
  Plan p{q.const_data_ptr<float>(), q.stride(0), q.stride(1), q.stride(2), H, KVH, H / KVH, D, bs, 0, R,
         tables.const_data_ptr<int64_t>(), tables.stride(0), std::vector<int64_t>(B), {}, static_cast<float>(scale)};
  const int64_t most = tables.size(1) * bs;  // tokens the table covers
  if (lengths.scalar_type() == at::kBool) {
    TORCH_CHECK(lengths.dim() == 2 && lengths.size(0) == B && lengths.size(1) <= most, "valid: bool [B, <= W bs]");
    const at::Tensor valid = lengths.contiguous();
    for (int64_t b = 0, L = valid.size(1); b < B; ++b) {
      const bool* r = valid.const_data_ptr<bool>() + b * L;
      p.lens[b] = std::find(r, r + L, false) - r;
      TORCH_CHECK(std::find(r + p.lens[b], r + L, true) == r + L, "valid must be a prefix mask (row ", b, ")");
    }
  } else {
    TORCH_CHECK(lengths.dim() == 1 && lengths.size(0) == B && lengths.scalar_type() == at::kLong, "seq_lens: int64");
    const at::Tensor sl = lengths.contiguous();
    for (int64_t b = 0; b < B; ++b) p.lens[b] = std::max<int64_t>(sl.const_data_ptr<int64_t>()[b], 0);
  }
  for (int64_t b = 0; b < B; ++b) {  // every block read must exist: a bad id would read outside the cache
    TORCH_CHECK(p.lens[b] <= most, "row ", b, ": ", p.lens[b], " tokens but the block table holds ", most);
    for (int64_t j = 0; j * bs < p.lens[b]; ++j) {
      const int64_t id = p.table[b * p.ts + j];
      TORCH_CHECK(id >= 0 && id < N, "row ", b, ": block id ", id, " out of range (", N, " blocks)");
    }
  }
  at::Tensor out = at::empty({B, H, D}, q.options());
  if (out.numel() == 0) return out;
  p.C = std::max<int64_t>(1, std::min(chunk > 0 ? chunk : CHUNK, *std::max_element(p.lens.begin(), p.lens.end())));
  // Threads take runs of items of about equal work (tokens x heads, plus a fixed cost); little work, one thread.
  std::vector<int64_t> cost(B * R + 1, 0);
  for (int64_t i = 0; i < B * R; ++i)
    cost[i + 1] = cost[i] + (p.lens[i / R] + 8) * ((i % R + 1) * KVH / R - i % R * KVH / R);
  const int64_t tasks = std::clamp<int64_t>(cost.back() / 512, 1, at::get_num_threads());
  for (int64_t k = 0, i = 0; k < tasks; ++k) {
    p.bounds.push_back(i);
    while (i < B * R && cost[i] * tasks < cost.back() * (k + 1)) ++i;
  }
  p.bounds.push_back(B * R);
  const float* ks = k_scale ? k_scale->const_data_ptr<float>() : nullptr;
  const float* vs = v_scale ? v_scale->const_data_ptr<float>() : nullptr;
  const bool avx2 = has_avx2() && !portable && D % 8 == 0;
  auto run = [&](auto* kp) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(kp)>>;
    const T* vp = static_cast<const T*>(v_cache.const_data_ptr());
#ifdef KVF_X86
    if (avx2) return launch<Avx2>(p, kp, vp, ks, vs, out.mutable_data_ptr<float>());
#endif
    launch<Portable>(p, kp, vp, ks, vs, out.mutable_data_ptr<float>());
  };
  const void* kd = k_cache.const_data_ptr();
  if (kind == at::kFloat) run(static_cast<const float*>(kd));
  else if (kind == at::kBFloat16) run(static_cast<const uint16_t*>(kd));
  else if (kind == at::kChar) run(static_cast<const int8_t*>(kd));
  else run(static_cast<const uint8_t*>(kd));
  return out;
}

}  // namespace

TORCH_LIBRARY(kvfleet_cpu_attention, m) {
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor lengths, "
        "float scale, Tensor? k_scale=None, Tensor? v_scale=None, int chunk=0, bool portable=False) -> Tensor",
        &decode_attention);
  m.def("has_avx2() -> bool", [] { return has_avx2(); });
}
