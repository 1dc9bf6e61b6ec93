// AVX2+FMA+F16C CpuAdam kernels, 8 floats per vector; tails run the same vector code on a
// zero-padded copy.
//
// Built with -mavx2 -mfma -mf16c -ffp-contract=off (src/CMakeLists.txt) and entered only after
// CPUID says so. FMA is never used for the update: each operation mirrors
// device::adamw_reference in the same order, so results are bit-identical, and the conversions
// reproduce strata::f32_to_bf16/f32_to_f16 exactly (including NaN payloads). Everything here has
// internal linkage (see cpu_adam_kernels.h).
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "src/optim/cpu_adam_kernels.h"
#include "strata/device/adam8bit.h"

namespace strata::optim::detail {
namespace {

constexpr std::int64_t kLanes = 8;

struct Vconsts {
  __m256 beta1, beta2, omb1, omb2, eps, wd, decay, step_size, bc2_sqrt, grad_scale;
};

Vconsts broadcast(const AdamConstants& c) {
  return Vconsts{_mm256_set1_ps(c.beta1),
                 _mm256_set1_ps(c.beta2),
                 _mm256_set1_ps(c.one_minus_beta1),
                 _mm256_set1_ps(c.one_minus_beta2),
                 _mm256_set1_ps(c.eps),
                 _mm256_set1_ps(c.weight_decay),
                 _mm256_set1_ps(c.decay),
                 _mm256_set1_ps(c.step_size),
                 _mm256_set1_ps(c.bc2_sqrt),
                 _mm256_set1_ps(c.grad_scale)};
}

constexpr std::int64_t grad_bytes(int g) { return g == kGradF32 ? 4 : 2; }
constexpr std::int64_t out_bytes(int o) { return o == kOutNone ? 0 : (o == kOutF32 ? 4 : 2); }

inline __m256 bf16x8_to_f32(__m128i h) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

template <int G>
inline __m256 load_grad(const void* grad, std::int64_t i) {
  if constexpr (G == kGradF32) {
    return _mm256_loadu_ps(static_cast<const float*>(grad) + i);
  } else {
    const __m128i h = _mm_loadu_si128(
        reinterpret_cast<const __m128i*>(static_cast<const std::uint16_t*>(grad) + i));
    if constexpr (G == kGradBF16) {
      return bf16x8_to_f32(h);
    } else {
      return _mm256_cvtph_ps(h);
    }
  }
}

template <bool kNT>
inline void store_f32(float* p, __m256 x) {
  if constexpr (kNT) {
    _mm256_stream_ps(p, x);
  } else {
    _mm256_storeu_ps(p, x);
  }
}

template <bool kNT>
inline void store_u16x8(void* p, __m128i x) {
  if constexpr (kNT) {
    _mm_stream_si128(static_cast<__m128i*>(p), x);
  } else {
    _mm_storeu_si128(static_cast<__m128i*>(p), x);
  }
}

// Eight 32-bit lanes holding values <= 0xffff -> eight u16 in order.
inline __m128i narrow(__m256i x) {
  return _mm_packus_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
}

inline __m256i nan_mask(__m256i u) {
  const __m256i abs = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
  return _mm256_cmpgt_epi32(abs, _mm256_set1_epi32(0x7f800000));  // both non-negative
}

// strata::f32_to_bf16 on eight lanes: round to nearest even on the bits, NaN quieted.
inline __m128i f32_to_bf16(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i rounded =
      _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)), 16);
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  return narrow(_mm256_blendv_epi8(rounded, quiet, nan_mask(u)));
}

// vcvtps2ph matches strata::f32_to_f16 except for NaN payloads (the reference: sign | 0x7e00).
inline __m128i f32_to_f16(__m256 x) {
  __m128i out = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT);
  const __m256i u = _mm256_castps_si256(x);
  const __m256i nan = nan_mask(u);
  if (_mm256_movemask_epi8(nan) != 0) [[unlikely]] {
    const __m256i canon =
        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x8000)),
                        _mm256_set1_epi32(0x7e00));
    const __m128i nan16 =
        _mm_packs_epi32(_mm256_castsi256_si128(nan), _mm256_extracti128_si256(nan, 1));
    out = _mm_blendv_epi8(out, narrow(canon), nan16);
  }
  return out;
}

template <int O, bool kNT>
inline void store_out(void* out, std::int64_t i, __m256 p) {
  if constexpr (O == kOutF32) {
    store_f32<kNT>(static_cast<float*>(out) + i, p);
  } else if constexpr (O == kOutBF16) {
    store_u16x8<kNT>(static_cast<std::uint16_t*>(out) + i, f32_to_bf16(p));
  } else if constexpr (O == kOutF16) {
    store_u16x8<kNT>(static_cast<std::uint16_t*>(out) + i, f32_to_f16(p));
  }
}

// Vectors per block. A block loads kSpan vectors of each input array, updates them, then stores
// kSpan vectors of each output array, so every f32 array is touched in runs of 2 cache lines
// instead of alternating between all five every 32 bytes. Arrays whose addresses agree in many low
// bits (equal-sized 2^k-byte allocations from mmap) otherwise evict each other's L1 lines on every
// access on some CPUs: on an AMD EPYC Zen 3 the one-vector loop ran 3.4x slower with such arrays
// than with arrays a page apart (bench/RESULTS.md, "CPU Adam"). Each lane still sees exactly the
// reference's operations in its order.
constexpr int kSpan = 4;

// Stores S vectors of each f32 state array, one array after the other (see kSpan).
template <bool kNT, int S>
inline void store_state(const AdamTile& t, std::int64_t i, const __m256* m, const __m256* v,
                        const __m256* p) {
#pragma GCC unroll 4
  for (int k = 0; k < S; ++k) store_f32<kNT>(t.exp_avg + i + kLanes * k, m[k]);
#pragma GCC unroll 4
  for (int k = 0; k < S; ++k) store_f32<kNT>(t.exp_avg_sq + i + kLanes * k, v[k]);
#pragma GCC unroll 4
  for (int k = 0; k < S; ++k) store_f32<kNT>(t.param + i + kLanes * k, p[k]);
}

// The statements of device::adamw_reference on kSpan x 8 lanes; same operations, same order.
template <int G, int O, bool kAdamW, bool kNT, int S>
inline void adam_vec(const Vconsts& c, const AdamTile& t, std::int64_t i) {
  __m256 g[S], p[S], m[S], v[S];
#pragma GCC unroll 4
  for (int k = 0; k < S; ++k) {
    g[k] = _mm256_mul_ps(load_grad<G>(t.grad, i + kLanes * k), c.grad_scale);
  }
#pragma GCC unroll 4
  for (int k = 0; k < S; ++k) p[k] = _mm256_loadu_ps(t.param_in + i + kLanes * k);
#pragma GCC unroll 4
  for (int k = 0; k < S; ++k) m[k] = _mm256_loadu_ps(t.exp_avg_in + i + kLanes * k);
#pragma GCC unroll 4
  for (int k = 0; k < S; ++k) v[k] = _mm256_loadu_ps(t.exp_avg_sq_in + i + kLanes * k);
#pragma GCC unroll 4
  for (int k = 0; k < S; ++k) {
    if constexpr (kAdamW) {
      p[k] = _mm256_mul_ps(p[k], c.decay);
    } else {
      g[k] = _mm256_add_ps(g[k], _mm256_mul_ps(c.wd, p[k]));
    }
    m[k] = _mm256_add_ps(_mm256_mul_ps(c.beta1, m[k]), _mm256_mul_ps(c.omb1, g[k]));
    v[k] = _mm256_add_ps(_mm256_mul_ps(c.beta2, v[k]),
                         _mm256_mul_ps(_mm256_mul_ps(c.omb2, g[k]), g[k]));
    const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v[k]), c.bc2_sqrt), c.eps);
    p[k] = _mm256_sub_ps(p[k], _mm256_div_ps(_mm256_mul_ps(c.step_size, m[k]), denom));
  }
  store_state<kNT, S>(t, i, m, v, p);
#pragma GCC unroll 4
  for (int k = 0; k < S; ++k) store_out<O, kNT>(t.param_out, i + kLanes * k, p[k]);
}

// Copies `rem` < 8 elements at i into zero-padded vectors, runs `vec` on them, copies back.
template <int G, int O, typename Vec>
inline void on_padded_copy(const AdamTile& t, std::int64_t i, std::int64_t rem, Vec vec) {
  alignas(32) float p[kLanes] = {}, m[kLanes] = {}, v[kLanes] = {};
  alignas(32) unsigned char g[kLanes * 4] = {}, out[kLanes * 4] = {};
  const auto f32 = static_cast<std::size_t>(rem) * 4;
  std::memcpy(p, t.param_in + i, f32);
  std::memcpy(m, t.exp_avg_in + i, f32);
  std::memcpy(v, t.exp_avg_sq_in + i, f32);
  std::memcpy(g, static_cast<const unsigned char*>(t.grad) + i * grad_bytes(G),
              static_cast<std::size_t>(rem * grad_bytes(G)));
  const AdamTile tmp{p, g, m, v, out, kLanes, p, m, v};
  vec(tmp);
  std::memcpy(t.param + i, p, f32);
  std::memcpy(t.exp_avg + i, m, f32);
  std::memcpy(t.exp_avg_sq + i, v, f32);
  if constexpr (O != kOutNone) {
    std::memcpy(static_cast<unsigned char*>(t.param_out) + i * out_bytes(O), out,
                static_cast<std::size_t>(rem * out_bytes(O)));
  }
}

inline bool aligned(const void* p, std::uintptr_t a) {
  return (reinterpret_cast<std::uintptr_t>(p) & (a - 1)) == 0;
}

// Streaming needs every stored array aligned at the same element (32 bytes for f32 vectors,
// 16 for the half-precision copy); otherwise the tile falls back to regular stores.
template <int O>
bool nt_aligned(const AdamTile& t) {
  if (!aligned(t.param, 32) || !aligned(t.exp_avg, 32) || !aligned(t.exp_avg_sq, 32)) return false;
  if constexpr (O == kOutF32) return aligned(t.param_out, 32);
  if constexpr (O == kOutBF16 || O == kOutF16) return aligned(t.param_out, 16);
  return true;
}

// Asks for the lines kPrefetchAheadBytes past element i of every f32 input array, for a block of
// kElems elements (one line per 16 elements). A half-precision gradient is left to the hardware
// prefetcher: asking for its lines too made the bf16-gradient step 1.4x slower on an AMD Zen 3,
// and without them it runs as fast as the f32 one. Addresses are formed as integers: past the
// end of an array a prefetch is a harmless hint.
template <int G, std::int64_t kElems>
inline void prefetch_ahead(const AdamTile& t, std::int64_t i) {
  constexpr std::int64_t kAhead = kPrefetchAheadBytes / 4;
  const auto at = [](const void* base, std::int64_t byte_offset) {
    return reinterpret_cast<const char*>(reinterpret_cast<std::uintptr_t>(base) +
                                         static_cast<std::uintptr_t>(byte_offset));
  };
  for (std::int64_t e = 0; e < kElems; e += 16) {
    _mm_prefetch(at(t.param_in, (i + kAhead + e) * 4), _MM_HINT_T0);
    _mm_prefetch(at(t.exp_avg_in, (i + kAhead + e) * 4), _MM_HINT_T0);
    _mm_prefetch(at(t.exp_avg_sq_in, (i + kAhead + e) * 4), _MM_HINT_T0);
    if constexpr (G == kGradF32) _mm_prefetch(at(t.grad, (i + kAhead + e) * 4), _MM_HINT_T0);
  }
}

template <int G, int O, bool kAdamW, bool kNT, bool kPrefetch>
void adam_tile(const AdamConstants& constants, const AdamTile& tile) {
  // A local copy: stores through its pointers cannot change it, so the pointers stay in
  // registers instead of being reloaded after every store.
  const AdamTile t = tile;
  const Vconsts c = broadcast(constants);
  const std::int64_t n = t.n;
  std::int64_t i = 0;
  constexpr std::int64_t kBlock = kSpan * kLanes;
  if (kNT && nt_aligned<O>(t)) {
    for (; i + kBlock <= n; i += kBlock) {
      if constexpr (kPrefetch) prefetch_ahead<G, kBlock>(t, i);
      adam_vec<G, O, kAdamW, true, kSpan>(c, t, i);
    }
    for (; i + kLanes <= n; i += kLanes) adam_vec<G, O, kAdamW, true, 1>(c, t, i);
    _mm_sfence();
  }
  for (; i + kBlock <= n; i += kBlock) {
    if constexpr (kPrefetch) prefetch_ahead<G, kBlock>(t, i);
    adam_vec<G, O, kAdamW, false, kSpan>(c, t, i);
  }
  for (; i + kLanes <= n; i += kLanes) adam_vec<G, O, kAdamW, false, 1>(c, t, i);
  if (i < n) {
    on_padded_copy<G, O>(t, i, n - i,
                         [&](const AdamTile& tmp) { adam_vec<G, O, kAdamW, false, 1>(c, tmp, 0); });
  }
}

// ---- roofline: the same loads and stores, trivial combine ----

// Same blocks as adam_vec: loads of each array in runs, then stores of each array in runs.
template <int G, int O, bool kNT, int S>
inline void roofline_vec(const AdamTile& t, std::int64_t i) {
  __m256 g[S], p[S], m[S], v[S];
#pragma GCC unroll 4
  for (int k = 0; k < S; ++k) {
    if constexpr (G == kGradF32) {
      g[k] = _mm256_loadu_ps(static_cast<const float*>(t.grad) + i + kLanes * k);
    } else {
      g[k] = bf16x8_to_f32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(
          static_cast<const std::uint16_t*>(t.grad) + i + kLanes * k)));
    }
  }
#pragma GCC unroll 4
  for (int k = 0; k < S; ++k) {
    p[k] = _mm256_add_ps(_mm256_loadu_ps(t.param_in + i + kLanes * k), g[k]);
  }
#pragma GCC unroll 4
  for (int k = 0; k < S; ++k) {
    m[k] = _mm256_add_ps(_mm256_loadu_ps(t.exp_avg_in + i + kLanes * k), g[k]);
  }
#pragma GCC unroll 4
  for (int k = 0; k < S; ++k) {
    v[k] = _mm256_add_ps(_mm256_loadu_ps(t.exp_avg_sq_in + i + kLanes * k), g[k]);
  }
  store_state<kNT, S>(t, i, m, v, p);
#pragma GCC unroll 4
  for (int k = 0; k < S; ++k) {
    if constexpr (O == kOutF32) {
      store_f32<kNT>(static_cast<float*>(t.param_out) + i + kLanes * k, p[k]);
    } else if constexpr (O != kOutNone) {
      store_u16x8<kNT>(static_cast<std::uint16_t*>(t.param_out) + i + kLanes * k,
                       narrow(_mm256_srli_epi32(_mm256_castps_si256(p[k]), 16)));
    }
  }
}

template <int G, int O, bool kNT, bool kPrefetch>
void roofline_tile(const AdamTile& tile) {
  const AdamTile t = tile;  // as in adam_tile
  const std::int64_t n = t.n;
  constexpr std::int64_t kBlock = kSpan * kLanes;
  std::int64_t i = 0;
  if (kNT && nt_aligned<O>(t)) {
    for (; i + kBlock <= n; i += kBlock) {
      if constexpr (kPrefetch) prefetch_ahead<G, kBlock>(t, i);
      roofline_vec<G, O, true, kSpan>(t, i);
    }
    for (; i + kLanes <= n; i += kLanes) roofline_vec<G, O, true, 1>(t, i);
    _mm_sfence();
  }
  for (; i + kBlock <= n; i += kBlock) {
    if constexpr (kPrefetch) prefetch_ahead<G, kBlock>(t, i);
    roofline_vec<G, O, false, kSpan>(t, i);
  }
  for (; i + kLanes <= n; i += kLanes) roofline_vec<G, O, false, 1>(t, i);
  if (i < n) {
    on_padded_copy<G, O>(t, i, n - i,
                         [&](const AdamTile& tmp) { roofline_vec<G, O, false, 1>(tmp, 0); });
  }
}

// ---- finite scan ----

template <int G>
bool all_finite(const void* grad, std::int64_t n) {
  const auto* bytes = static_cast<const unsigned char*>(grad);
  __m256i bad = _mm256_setzero_si256();
  std::int64_t i = 0;
  if constexpr (G == kGradF32) {
    const __m256i exp = _mm256_set1_epi32(0x7f800000);
    for (; i + 8 <= n; i += 8) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes + i * 4));
      bad = _mm256_or_si256(bad, _mm256_cmpeq_epi32(_mm256_and_si256(x, exp), exp));
    }
  } else {
    const __m256i exp = _mm256_set1_epi16(G == kGradBF16 ? 0x7f80 : 0x7c00);
    for (; i + 16 <= n; i += 16) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes + i * 2));
      bad = _mm256_or_si256(bad, _mm256_cmpeq_epi16(_mm256_and_si256(x, exp), exp));
    }
  }
  if (_mm256_movemask_epi8(bad) != 0) return false;
  for (; i < n; ++i) {
    if constexpr (G == kGradF32) {
      std::uint32_t u;
      std::memcpy(&u, bytes + i * 4, 4);
      if ((u & 0x7f800000u) == 0x7f800000u) return false;
    } else {
      std::uint16_t u;
      std::memcpy(&u, bytes + i * 2, 2);
      const std::uint16_t exp = G == kGradBF16 ? 0x7f80 : 0x7c00;
      if ((u & exp) == exp) return false;
    }
  }
  return true;
}

// ---- 8-bit moments ----

// The scalar kernel's statements 8 lanes at a time (a block's last partial 8 through a padded
// copy): the absolute maximum (order-free), the square root, the product by the reciprocal, and
// the magnitude's search as a bucket and two thresholds, gathered.
void quant8_block(const Quant8Search& s, const float* x, std::int64_t n, std::uint8_t* codes,
                  float* scale) {
  alignas(32) float pad[8];
  const auto load = [&](std::int64_t i) {
    __m256 v;
    if (n - i >= 8) {
      v = _mm256_loadu_ps(x + i);
    } else {
      for (int j = 0; j < 8; ++j) pad[j] = i + j < n ? x[i + j] : 0.0f;
      v = _mm256_load_ps(pad);
    }
    return s.second ? _mm256_sqrt_ps(v) : v;
  };
  __m256 amax = _mm256_setzero_ps();
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  // vmaxps gives its second operand where either is NaN: the maximum so far, so a NaN is skipped
  // as std::max skips it in the reference.
  for (std::int64_t i = 0; i < n; i += 8)
    amax = _mm256_max_ps(_mm256_and_ps(load(i), abs_mask), amax);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, amax);
  float a = 0.0f;
  for (float l : lanes) a = l > a ? l : a;
  const float r = device::adam8_reciprocal(a);
  *scale = r == 0.0f ? 0.0f : a;
  if (r == 0.0f) {
    for (std::int64_t i = 0; i < n; ++i) codes[i] = 0;
    return;
  }
  const __m256 vr = _mm256_set1_ps(r);
  const __m256i lo = _mm256_set1_epi32(s.bucket_lo), hi = _mm256_set1_epi32(s.bucket_hi);
  const __m256i zero = _mm256_setzero_si256();
  alignas(32) std::int32_t bytes[8];
  for (std::int64_t i = 0; i < n; i += 8) {
    const __m256 y = _mm256_mul_ps(load(i), vr);
    const __m256 u = _mm256_and_ps(y, abs_mask);
    // The bucket of u's top 16 bits, then the two thresholds that may lie above its start.
    __m256i key = _mm256_srli_epi32(_mm256_castps_si256(u), 16);
    key = _mm256_sub_epi32(_mm256_min_epi32(_mm256_max_epi32(key, lo), hi), lo);
    const __m256i first = _mm256_i32gather_epi32(s.bucket, key, 4);
    const __m256 t0 = _mm256_i32gather_ps(s.threshold, first, 4);
    const __m256 t1 = _mm256_i32gather_ps(s.threshold + 1, first, 4);
    // A true comparison is all ones (-1): subtracting it adds one.
    __m256i k = _mm256_sub_epi32(first, _mm256_castps_si256(_mm256_cmp_ps(t0, u, _CMP_LT_OQ)));
    k = _mm256_sub_epi32(k, _mm256_castps_si256(_mm256_cmp_ps(t1, u, _CMP_LT_OQ)));
    // A NaN (its key clamped to the last bucket) has no threshold below it: byte 0.
    k = _mm256_andnot_si256(_mm256_castps_si256(_mm256_cmp_ps(u, u, _CMP_UNORD_Q)), k);
    const __m256i at_zero = _mm256_cmpeq_epi32(k, zero);
    if (s.second) {
      // A positive root that found 0 takes 1: subtracting the all-ones lanes adds one.
      k = _mm256_sub_epi32(k, _mm256_and_si256(at_zero, _mm256_castps_si256(_mm256_cmp_ps(
                                                            u, _mm256_setzero_ps(), _CMP_GT_OQ))));
    } else {
      // A negative element's byte: its magnitude's with the sign bit (never for 0).
      const __m256i sign = _mm256_srai_epi32(_mm256_castps_si256(y), 31);
      k = _mm256_or_si256(
          k, _mm256_andnot_si256(at_zero, _mm256_and_si256(sign, _mm256_set1_epi32(0x80))));
    }
    _mm256_store_si256(reinterpret_cast<__m256i*>(bytes), k);
    const std::int64_t len = n - i >= 8 ? 8 : n - i;
    for (std::int64_t j = 0; j < len; ++j) codes[i + j] = static_cast<std::uint8_t>(bytes[j]);
  }
}

void dequant8_block(const float* value, const std::uint8_t* codes, float scale, std::int64_t n,
                    bool square, float* out) {
  const __m256 vs = _mm256_set1_ps(scale);
  std::int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    std::int64_t eight;
    __builtin_memcpy(&eight, codes + i, 8);
    const __m256i c = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(eight));
    __m256 v = _mm256_mul_ps(_mm256_i32gather_ps(value, c, 4), vs);
    if (square) v = _mm256_mul_ps(v, v);
    _mm256_storeu_ps(out + i, v);
  }
  for (; i < n; ++i) {
    const float v = value[codes[i]] * scale;
    out[i] = square ? v * v : v;
  }
}

// ---- table ----

struct Avx2 {
  template <int G, int O, bool kAdamW, bool kNT, bool kPF>
  static constexpr AdamKernel adam = &adam_tile<G, O, kAdamW, kNT, kPF>;
  // bf16 moments: widened into f32 scratch by the caller.
  template <int G, int O, bool kAdamW>
  static constexpr AdamKernel adam_bf16_moments = nullptr;
  template <int G, int O, bool kAdamW, int kMaster>
  static constexpr Adam8Kernel adam8 = nullptr;
  template <int G, int O, bool kNT, bool kPF>
  static constexpr RooflineKernel roofline = &roofline_tile<G, O, kNT, kPF>;
  template <int G>
  static constexpr FiniteKernel all_finite = &detail::all_finite<G>;
  static constexpr Quant8Kernel quant8 = &quant8_block;
  static constexpr Dequant8Kernel dequant8 = &dequant8_block;
  static constexpr RoundStochasticKernel round_stochastic = &round_stochastic_scalar;
};

}  // namespace

void fill_avx2_kernels(KernelSet* set) { fill_kernel_table<Avx2>(set, "avx2"); }

}  // namespace strata::optim::detail
