// AVX-512 CpuAdam kernels (F+BW+VL, optional BF16), 16 floats per vector, masked tails.
//
// Built with -mavx512f -mavx512bw -mavx512vl -mavx512bf16 -ffp-contract=off (src/CMakeLists.txt)
// and entered only after CPUID says so. Every arithmetic operation mirrors
// device::adamw_reference in the same order, without FMA contraction, so results are
// bit-identical; the conversions reproduce strata::f32_to_bf16/f32_to_f16 exactly, including
// NaN payloads and bf16 subnormals (which vcvtneps2bf16 flushes to zero; they are fixed up).
// Everything here has internal linkage (see cpu_adam_kernels.h).

#include "src/optim/cpu_adam_avx512.h"

#include <immintrin.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <limits>

#include "src/optim/cpu_adam_kernels.h"

namespace strata::optim::detail {
namespace {

// ---- Adam ----

// Vectors per block. A block loads kSpan vectors of each input array, updates them, then stores
// kSpan vectors of each output array, so every f32 array is touched in runs of 4 cache lines
// instead of alternating between all of them every 64 bytes (as the AVX2 kernels do, and for the
// same reason: arrays whose addresses agree in many low bits evict each other's lines when they
// are interleaved line by line). Each lane still sees exactly the reference's operations in its
// order.
constexpr int kSpan = 4;

// The moments: f32, or (kHalf) bf16 widened on load and rounded to nearest even on store, as
// the reference does (the tile's moment pointers then point at std::uint16_t).
template <bool kHalf, bool kMasked>
inline __m512 load_moment(const float* p, std::int64_t i, __mmask16 k) {
  if constexpr (kHalf) {
    return bf16x16_to_f32(load_u16x16<kMasked>(reinterpret_cast<const std::uint16_t*>(p) + i, k));
  } else {
    return load_f32<kMasked>(p + i, k);
  }
}

template <bool kHalf, bool kNativeBF16, bool kMasked, bool kNT>
inline void store_moment(float* p, std::int64_t i, __m512 x, __mmask16 k) {
  if constexpr (kHalf) {
    const __m256i h = kNativeBF16 ? f32_to_bf16_native(x) : f32_to_bf16_int(x);
    store_u16x16<kMasked, kNT>(reinterpret_cast<std::uint16_t*>(p) + i, h, k);
  } else {
    store_f32<kMasked, kNT>(p + i, x, k);
  }
}

// The statements of device::adamw_reference on 16 lanes; same operations, same order. For the
// masked head and tail of a tile.
template <int G, int O, bool kAdamW, bool kNativeBF16, bool kMasked, bool kNT, bool kHalf>
inline void adam_vec(const Vconsts& c, const AdamTile& t, std::int64_t i, __mmask16 k) {
  __m512 g = _mm512_mul_ps(load_grad<G, kMasked>(t.grad, i, k), c.grad_scale);
  __m512 p = load_f32<kMasked>(t.param_in + i, k);
  if constexpr (kAdamW) {
    p = _mm512_mul_ps(p, c.decay);
  } else {
    g = _mm512_add_ps(g, _mm512_mul_ps(c.wd, p));
  }
  const __m512 m =
      _mm512_add_ps(_mm512_mul_ps(c.beta1, load_moment<kHalf, kMasked>(t.exp_avg_in, i, k)),
                    _mm512_mul_ps(c.omb1, g));
  const __m512 v =
      _mm512_add_ps(_mm512_mul_ps(c.beta2, load_moment<kHalf, kMasked>(t.exp_avg_sq_in, i, k)),
                    _mm512_mul_ps(_mm512_mul_ps(c.omb2, g), g));
  store_moment<kHalf, kNativeBF16, kMasked, kNT>(t.exp_avg, i, m, k);
  store_moment<kHalf, kNativeBF16, kMasked, kNT>(t.exp_avg_sq, i, v, k);
  const __m512 denom =
      _mm512_add_ps(_mm512_div_ps(_mm512_maskz_sqrt_ps(kAll, v), c.bc2_sqrt), c.eps);
  p = _mm512_sub_ps(p, _mm512_div_ps(_mm512_mul_ps(c.step_size, m), denom));
  store_f32<kMasked, kNT>(t.param + i, p, k);
  store_out<O, kNativeBF16, kMasked, kNT>(t.param_out, i, p, k);
}

// Stores S vectors of each state array, one array after the other (see kSpan).
template <bool kNT, int S, bool kHalf, bool kNativeBF16>
inline void store_state(const AdamTile& t, std::int64_t i, const __m512* m, const __m512* v,
                        const __m512* p) {
#pragma GCC unroll 4
  for (int k = 0; k < S; ++k) {
    store_moment<kHalf, kNativeBF16, false, kNT>(t.exp_avg, i + kLanes * k, m[k], kAll);
  }
#pragma GCC unroll 4
  for (int k = 0; k < S; ++k) {
    store_moment<kHalf, kNativeBF16, false, kNT>(t.exp_avg_sq, i + kLanes * k, v[k], kAll);
  }
#pragma GCC unroll 4
  for (int k = 0; k < S; ++k) store_f32<false, kNT>(t.param + i + kLanes * k, p[k], kAll);
}

// adam_vec on S whole vectors, each array loaded and stored in a run (see kSpan).
template <int G, int O, bool kAdamW, bool kNativeBF16, bool kNT, int S, bool kHalf>
inline void adam_block(const Vconsts& c, const AdamTile& t, std::int64_t i) {
  __m512 g[S], p[S], m[S], v[S];
#pragma GCC unroll 4
  for (int k = 0; k < S; ++k) {
    g[k] = _mm512_mul_ps(load_grad<G, false>(t.grad, i + kLanes * k, kAll), c.grad_scale);
  }
#pragma GCC unroll 4
  for (int k = 0; k < S; ++k) p[k] = _mm512_loadu_ps(t.param_in + i + kLanes * k);
#pragma GCC unroll 4
  for (int k = 0; k < S; ++k) m[k] = load_moment<kHalf, false>(t.exp_avg_in, i + kLanes * k, kAll);
#pragma GCC unroll 4
  for (int k = 0; k < S; ++k) {
    v[k] = load_moment<kHalf, false>(t.exp_avg_sq_in, i + kLanes * k, kAll);
  }
#pragma GCC unroll 4
  for (int k = 0; k < S; ++k) {
    if constexpr (kAdamW) {
      p[k] = _mm512_mul_ps(p[k], c.decay);
    } else {
      g[k] = _mm512_add_ps(g[k], _mm512_mul_ps(c.wd, p[k]));
    }
    m[k] = _mm512_add_ps(_mm512_mul_ps(c.beta1, m[k]), _mm512_mul_ps(c.omb1, g[k]));
    v[k] = _mm512_add_ps(_mm512_mul_ps(c.beta2, v[k]),
                         _mm512_mul_ps(_mm512_mul_ps(c.omb2, g[k]), g[k]));
    const __m512 denom =
        _mm512_add_ps(_mm512_div_ps(_mm512_maskz_sqrt_ps(kAll, v[k]), c.bc2_sqrt), c.eps);
    p[k] = _mm512_sub_ps(p[k], _mm512_div_ps(_mm512_mul_ps(c.step_size, m[k]), denom));
  }
  store_state<kNT, S, kHalf, kNativeBF16>(t, i, m, v, p);
#pragma GCC unroll 4
  for (int k = 0; k < S; ++k) {
    store_out<O, kNativeBF16, false, kNT>(t.param_out, i + kLanes * k, p[k], kAll);
  }
}

inline bool aligned(const void* p, std::uintptr_t a) {
  return (reinterpret_cast<std::uintptr_t>(p) & (a - 1)) == 0;
}

// Non-temporal stores need every stored array aligned at the same element: peel until param is
// 64-byte aligned, then stream only if the others line up too (they do for page-aligned buffers).
template <int O>
bool nt_aligned_at(const AdamTile& t, std::int64_t i) {
  if (!aligned(t.param + i, 64) || !aligned(t.exp_avg + i, 64) || !aligned(t.exp_avg_sq + i, 64)) {
    return false;
  }
  if constexpr (O == kOutF32) return aligned(static_cast<float*>(t.param_out) + i, 64);
  if constexpr (O == kOutBF16 || O == kOutF16) {
    return aligned(static_cast<std::uint16_t*>(t.param_out) + i, 32);
  }
  return true;
}

inline std::int64_t peel_to_64(const float* p, std::int64_t n) {
  const auto addr = reinterpret_cast<std::uintptr_t>(p);
  if ((addr & 3) != 0) return 0;  // never 64-byte aligned: no peel, regular stores
  const auto head = static_cast<std::int64_t>(((64 - (addr & 63)) & 63) / 4);
  return head < n ? head : n;
}

// Asks for the lines kPrefetchAheadBytes past elements i .. i + kElems of every f32 input array
// (one line per 16 elements). A half-precision gradient is left to the hardware prefetcher, as in
// the AVX2 kernels (see there). Addresses are formed as integers: past the end of an array a
// prefetch is a harmless hint.
template <int G, std::int64_t kElems>
inline void prefetch_ahead(const AdamTile& t, std::int64_t i) {
  constexpr std::int64_t kAhead = kPrefetchAheadBytes / 4;
  const auto at = [](const void* base, std::int64_t byte_offset) {
    return reinterpret_cast<const char*>(reinterpret_cast<std::uintptr_t>(base) +
                                         static_cast<std::uintptr_t>(byte_offset));
  };
  for (std::int64_t e = 0; e < kElems; e += kLanes) {
    _mm_prefetch(at(t.param_in, (i + kAhead + e) * 4), _MM_HINT_T0);
    _mm_prefetch(at(t.exp_avg_in, (i + kAhead + e) * 4), _MM_HINT_T0);
    _mm_prefetch(at(t.exp_avg_sq_in, (i + kAhead + e) * 4), _MM_HINT_T0);
    if constexpr (G == kGradF32) _mm_prefetch(at(t.grad, (i + kAhead + e) * 4), _MM_HINT_T0);
  }
}

template <int G, int O, bool kAdamW, bool kNativeBF16, bool kNT, bool kPrefetch, bool kHalf = false>
void adam_tile(const AdamConstants& constants, const AdamTile& tile) {
  // A local copy: stores through its pointers cannot change it, so the pointers stay in
  // registers instead of being reloaded after every store.
  const AdamTile t = tile;
  const Vconsts c = broadcast(constants);
  const std::int64_t n = t.n;
  constexpr std::int64_t kBlock = kSpan * kLanes;
  std::int64_t i = 0;
  static_assert(!(kHalf && (kNT || kPrefetch)), "bf16 moments: regular stores, no prefetch");
  if constexpr (kNT) {
    const std::int64_t head = peel_to_64(t.param, n);
    if (head > 0) {
      adam_vec<G, O, kAdamW, kNativeBF16, true, false, kHalf>(c, t, 0, tail_mask(head));
      i = head;
    }
    if (nt_aligned_at<O>(t, i)) {
      for (; i + kBlock <= n; i += kBlock) {
        if constexpr (kPrefetch) prefetch_ahead<G, kBlock>(t, i);
        adam_block<G, O, kAdamW, kNativeBF16, true, kSpan, kHalf>(c, t, i);
      }
      for (; i + kLanes <= n; i += kLanes) {
        adam_block<G, O, kAdamW, kNativeBF16, true, 1, kHalf>(c, t, i);
      }
    }
  }
  for (; i + kBlock <= n; i += kBlock) {
    if constexpr (kPrefetch) prefetch_ahead<G, kBlock>(t, i);
    adam_block<G, O, kAdamW, kNativeBF16, false, kSpan, kHalf>(c, t, i);
  }
  for (; i + kLanes <= n; i += kLanes)
    adam_block<G, O, kAdamW, kNativeBF16, false, 1, kHalf>(c, t, i);
  if (i < n) adam_vec<G, O, kAdamW, kNativeBF16, true, false, kHalf>(c, t, i, tail_mask(n - i));
  if constexpr (kNT) _mm_sfence();  // streamed stores are weakly ordered
}

// ---- roofline: the same loads and stores, trivial combine ----

template <int G, bool kMasked>
inline __m512 load_grad_bits(const AdamTile& t, std::int64_t i, __mmask16 k) {
  if constexpr (G == kGradF32) {
    return load_f32<kMasked>(static_cast<const float*>(t.grad) + i, k);
  } else {
    return bf16x16_to_f32(load_u16x16<kMasked>(static_cast<const std::uint16_t*>(t.grad) + i, k));
  }
}

template <int O, bool kMasked, bool kNT>
inline void store_out_bits(const AdamTile& t, std::int64_t i, __m512 p, __mmask16 k) {
  if constexpr (O == kOutF32) {
    store_f32<kMasked, kNT>(static_cast<float*>(t.param_out) + i, p, k);
  } else if constexpr (O != kOutNone) {
    const __m256i h = narrow_u32(shr16(_mm512_castps_si512(p)));
    store_u16x16<kMasked, kNT>(static_cast<std::uint16_t*>(t.param_out) + i, h, k);
  }
}

// For the masked head and tail.
template <int G, int O, bool kMasked, bool kNT>
inline void roofline_vec(const AdamTile& t, std::int64_t i, __mmask16 k) {
  const __m512 g = load_grad_bits<G, kMasked>(t, i, k);
  // Loads first, then stores, in Adam's order.
  const __m512 p = _mm512_add_ps(load_f32<kMasked>(t.param_in + i, k), g);
  const __m512 m = _mm512_add_ps(load_f32<kMasked>(t.exp_avg_in + i, k), g);
  const __m512 v = _mm512_add_ps(load_f32<kMasked>(t.exp_avg_sq_in + i, k), g);
  store_f32<kMasked, kNT>(t.exp_avg + i, m, k);
  store_f32<kMasked, kNT>(t.exp_avg_sq + i, v, k);
  store_f32<kMasked, kNT>(t.param + i, p, k);
  store_out_bits<O, kMasked, kNT>(t, i, p, k);
}

// Same blocks as adam_block.
template <int G, int O, bool kNT, int S>
inline void roofline_block(const AdamTile& t, std::int64_t i) {
  __m512 g[S], p[S], m[S], v[S];
#pragma GCC unroll 4
  for (int k = 0; k < S; ++k) g[k] = load_grad_bits<G, false>(t, i + kLanes * k, kAll);
#pragma GCC unroll 4
  for (int k = 0; k < S; ++k)
    p[k] = _mm512_add_ps(_mm512_loadu_ps(t.param_in + i + kLanes * k), g[k]);
#pragma GCC unroll 4
  for (int k = 0; k < S; ++k) {
    m[k] = _mm512_add_ps(_mm512_loadu_ps(t.exp_avg_in + i + kLanes * k), g[k]);
  }
#pragma GCC unroll 4
  for (int k = 0; k < S; ++k) {
    v[k] = _mm512_add_ps(_mm512_loadu_ps(t.exp_avg_sq_in + i + kLanes * k), g[k]);
  }
  store_state<kNT, S, false, false>(t, i, m, v, p);
#pragma GCC unroll 4
  for (int k = 0; k < S; ++k) store_out_bits<O, false, kNT>(t, i + kLanes * k, p[k], kAll);
}

template <int G, int O, bool kNT, bool kPrefetch>
void roofline_tile(const AdamTile& tile) {
  const AdamTile t = tile;  // as in adam_tile
  const std::int64_t n = t.n;
  constexpr std::int64_t kBlock = kSpan * kLanes;
  std::int64_t i = 0;
  if constexpr (kNT) {
    const std::int64_t head = peel_to_64(t.param, n);
    if (head > 0) {
      roofline_vec<G, O, true, false>(t, 0, tail_mask(head));
      i = head;
    }
    if (nt_aligned_at<O>(t, i)) {
      for (; i + kBlock <= n; i += kBlock) {
        if constexpr (kPrefetch) prefetch_ahead<G, kBlock>(t, i);
        roofline_block<G, O, true, kSpan>(t, i);
      }
      for (; i + kLanes <= n; i += kLanes) roofline_block<G, O, true, 1>(t, i);
    }
  }
  for (; i + kBlock <= n; i += kBlock) {
    if constexpr (kPrefetch) prefetch_ahead<G, kBlock>(t, i);
    roofline_block<G, O, false, kSpan>(t, i);
  }
  for (; i + kLanes <= n; i += kLanes) roofline_block<G, O, false, 1>(t, i);
  if (i < n) roofline_vec<G, O, true, false>(t, i, tail_mask(n - i));
  if constexpr (kNT) _mm_sfence();
}

// ---- finite scan ----

template <int G>
bool all_finite(const void* grad, std::int64_t n) {
  if constexpr (G == kGradF32) {
    const auto* g = static_cast<const float*>(grad);
    const __m512i exp = _mm512_set1_epi32(0x7f800000);
    __mmask16 bad = 0;
    std::int64_t i = 0;
    for (; i + kLanes <= n; i += kLanes) {
      const __m512i x = _mm512_and_si512(_mm512_castps_si512(_mm512_loadu_ps(g + i)), exp);
      bad |= _mm512_cmpeq_epi32_mask(x, exp);
    }
    if (i < n) {
      const __mmask16 k = tail_mask(n - i);
      const __m512i x = _mm512_and_si512(_mm512_castps_si512(_mm512_maskz_loadu_ps(k, g + i)), exp);
      bad |= _mm512_mask_cmpeq_epi32_mask(k, x, exp);
    }
    return bad == 0;
  } else {
    const auto* g = static_cast<const std::uint16_t*>(grad);
    const __m512i exp = _mm512_set1_epi16(G == kGradBF16 ? 0x7f80 : 0x7c00);
    __mmask32 bad = 0;
    std::int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
      const __m512i x = _mm512_and_si512(_mm512_loadu_si512(g + i), exp);
      bad |= _mm512_cmpeq_epi16_mask(x, exp);
    }
    if (i < n) {
      const auto k = static_cast<__mmask32>((std::uint64_t{1} << (n - i)) - 1);
      const __m512i x = _mm512_and_si512(_mm512_maskz_loadu_epi16(k, g + i), exp);
      bad |= _mm512_mask_cmpeq_epi16_mask(k, x, exp);
    }
    return bad == 0;
  }
}

// ---- table ----

// The f32 and bf16-moment kernels; the compact states' (cpu_adam_compact_avx512.cpp) are filled
// beside them.
template <bool kNativeBF16>
struct Avx512 {
  template <int G, int O, bool kAdamW, bool kNT, bool kPF>
  static constexpr AdamKernel adam = &adam_tile<G, O, kAdamW, kNativeBF16, kNT, kPF>;
  template <int G, int O, bool kAdamW>
  static constexpr AdamKernel adam_bf16_moments =
      &adam_tile<G, O, kAdamW, kNativeBF16, false, false, true>;
  template <int G, int O, bool kNT, bool kPF>
  static constexpr RooflineKernel roofline = &roofline_tile<G, O, kNT, kPF>;
  template <int G>
  static constexpr FiniteKernel all_finite = &detail::all_finite<G>;
};

}  // namespace

void fill_avx512_kernels(KernelSet* set, bool native_bf16) {
  if (native_bf16) {
    fill_adam_kernels<Avx512<true>>(set, "avx512+bf16");
  } else {
    fill_adam_kernels<Avx512<false>>(set, "avx512");
  }
  fill_avx512_compact_kernels(set, native_bf16);
}

}  // namespace strata::optim::detail
