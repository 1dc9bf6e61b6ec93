// AVX-512 lanes for the CpuAdam kernels (private to cpu_adam_avx512.cpp and
// cpu_adam_compact_avx512.cpp, which are built with the same ISA flags): 16 floats a vector, masked
// tails, loads and stores of every dtype, and the conversions exactly as strata::f32_to_bf16 and
// f32_to_f16 round. Internal linkage (an anonymous namespace), so no file built without these
// flags can pick up an instantiation of them (see cpu_adam_kernels.h).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "src/optim/cpu_adam_kernels.h"

namespace strata::optim::detail {
namespace {  // NOLINT(google-build-namespaces): internal linkage on purpose, see above

constexpr std::int64_t kLanes = 16;

struct Vconsts {
  __m512 beta1, beta2, omb1, omb2, eps, wd, decay, step_size, bc2_sqrt, grad_scale;
};

inline Vconsts broadcast(const AdamConstants& c) {
  return Vconsts{_mm512_set1_ps(c.beta1),
                 _mm512_set1_ps(c.beta2),
                 _mm512_set1_ps(c.one_minus_beta1),
                 _mm512_set1_ps(c.one_minus_beta2),
                 _mm512_set1_ps(c.eps),
                 _mm512_set1_ps(c.weight_decay),
                 _mm512_set1_ps(c.decay),
                 _mm512_set1_ps(c.step_size),
                 _mm512_set1_ps(c.bc2_sqrt),
                 _mm512_set1_ps(c.grad_scale)};
}

inline __mmask16 tail_mask(std::int64_t n) {
  return static_cast<__mmask16>((1u << static_cast<unsigned>(n)) - 1u);
}

// GCC 12's unmasked forms of these intrinsics trip -Wmaybe-uninitialized on their internal
// _mm512_undefined_* operand (GCC bug 105593, fixed in 13); the all-ones maskz forms are the
// same instructions without it (the mask is constant, so nothing is masked at run time).
constexpr __mmask16 kAll = 0xffff;
inline __m512i shl16(__m512i x) { return _mm512_maskz_slli_epi32(kAll, x, 16); }
inline __m512i shr16(__m512i x) { return _mm512_maskz_srli_epi32(kAll, x, 16); }
inline __m512i widen_u16(__m256i x) { return _mm512_maskz_cvtepu16_epi32(kAll, x); }
inline __m256i narrow_u32(__m512i x) { return _mm512_maskz_cvtepi32_epi16(kAll, x); }

// ---- loads ----

template <bool kMasked>
inline __m512 load_f32(const float* p, __mmask16 k) {
  if constexpr (kMasked) {
    return _mm512_maskz_loadu_ps(k, p);
  } else {
    return _mm512_loadu_ps(p);
  }
}

template <bool kMasked>
inline __m256i load_u16x16(const void* p, __mmask16 k) {
  if constexpr (kMasked) {
    return _mm256_maskz_loadu_epi16(k, p);
  } else {
    return _mm256_loadu_si256(static_cast<const __m256i*>(p));
  }
}

inline __m512 bf16x16_to_f32(__m256i h) { return _mm512_castsi512_ps(shl16(widen_u16(h))); }

template <int G, bool kMasked>
inline __m512 load_grad(const void* grad, std::int64_t i, __mmask16 k) {
  if constexpr (G == kGradF32) {
    return load_f32<kMasked>(static_cast<const float*>(grad) + i, k);
  } else if constexpr (G == kGradBF16) {
    return bf16x16_to_f32(load_u16x16<kMasked>(static_cast<const std::uint16_t*>(grad) + i, k));
  } else {
    return _mm512_maskz_cvtph_ps(
        kAll, load_u16x16<kMasked>(static_cast<const std::uint16_t*>(grad) + i, k));
  }
}

// ---- stores ----

template <bool kMasked, bool kNT>
inline void store_f32(float* p, __m512 x, __mmask16 k) {
  if constexpr (kMasked) {
    _mm512_mask_storeu_ps(p, k, x);
  } else if constexpr (kNT) {
    _mm512_stream_ps(p, x);
  } else {
    _mm512_storeu_ps(p, x);
  }
}

template <bool kMasked, bool kNT>
inline void store_u16x16(void* p, __m256i x, __mmask16 k) {
  if constexpr (kMasked) {
    _mm256_mask_storeu_epi16(p, k, x);
  } else if constexpr (kNT) {
    _mm256_stream_si256(static_cast<__m256i*>(p), x);
  } else {
    _mm256_storeu_si256(static_cast<__m256i*>(p), x);
  }
}

// ---- conversions, exactly strata::f32_to_bf16 / f32_to_f16 ----

inline __mmask16 nan_mask(__m512i u) {
  const __m512i abs = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff));
  return _mm512_cmpgt_epu32_mask(abs, _mm512_set1_epi32(0x7f800000));
}

// Round to nearest even on the bit pattern; NaN becomes the quieted high half.
inline __m256i f32_to_bf16_int(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(shr16(u), _mm512_set1_epi32(1));
  const __m512i rounded =
      shr16(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb)));
  const __m512i quiet = _mm512_or_si512(shr16(u), _mm512_set1_epi32(0x40));
  return narrow_u32(_mm512_mask_mov_epi32(rounded, nan_mask(u), quiet));
}

// vcvtneps2bf16 rounds like the reference and quiets NaN the same way, but treats subnormal
// inputs as zero; those lanes (exponent 0, mantissa != 0: rare) take the integer path.
inline __m256i f32_to_bf16_native(__m512 x) {
  __m256i out = (__m256i)_mm512_cvtneps_pbh(x);  // same bits, GCC vector cast
  const __m512i u = _mm512_castps_si512(x);
  const __mmask16 subnormal = _mm512_testn_epi32_mask(u, _mm512_set1_epi32(0x7f800000)) &
                              _mm512_test_epi32_mask(u, _mm512_set1_epi32(0x007fffff));
  if (subnormal != 0) [[unlikely]] {
    out = _mm256_mask_mov_epi16(out, subnormal, f32_to_bf16_int(x));
  }
  return out;
}

// vcvtps2ph rounds to nearest even with the reference's overflow and subnormal results; only
// NaN differs (the reference drops the payload: sign | 0x7e00).
inline __m256i f32_to_f16(__m512 x) {
  __m256i out = _mm512_maskz_cvtps_ph(kAll, x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512i u = _mm512_castps_si512(x);
  const __mmask16 nan = nan_mask(u);
  if (nan != 0) [[unlikely]] {
    const __m512i canon = _mm512_or_si512(_mm512_and_si512(shr16(u), _mm512_set1_epi32(0x8000)),
                                          _mm512_set1_epi32(0x7e00));
    out = _mm256_mask_mov_epi16(out, nan, narrow_u32(canon));
  }
  return out;
}

template <int O, bool kNativeBF16, bool kMasked, bool kNT>
inline void store_out(void* out, std::int64_t i, __m512 p, __mmask16 k) {
  if constexpr (O == kOutF32) {
    store_f32<kMasked, kNT>(static_cast<float*>(out) + i, p, k);
  } else if constexpr (O == kOutBF16) {
    const __m256i h = kNativeBF16 ? f32_to_bf16_native(p) : f32_to_bf16_int(p);
    store_u16x16<kMasked, kNT>(static_cast<std::uint16_t*>(out) + i, h, k);
  } else if constexpr (O == kOutF16) {
    store_u16x16<kMasked, kNT>(static_cast<std::uint16_t*>(out) + i, f32_to_f16(p), k);
  }
}

}  // namespace
}  // namespace strata::optim::detail
