// AVX-512 CpuAdam kernels for compact optimizer states: 8-bit moments (the quantizer's search by
// arithmetic and by levels, the dequantizer, and the fused kernel that decodes, steps and encodes a
// block of 64 in registers) and bf16 master weights rounded stochastically.
//
// Built with the flags of cpu_adam_avx512.cpp (src/CMakeLists.txt) and entered only after CPUID
// says so; every operation mirrors the reference (device::adam8_*, adamw_reference) in its order,
// without FMA contraction, so the bytes are the reference's. Internal linkage throughout.
#include <immintrin.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <limits>

#include "src/optim/cpu_adam_avx512.h"
#include "src/optim/cpu_adam_kernels.h"
#include "strata/device/adam8bit.h"

namespace strata::optim::detail {
namespace {

// ---- 8-bit moments ----

// Tables looked up in registers instead of gathered (a gather of 16 lanes costs more than the
// whole Adam update of them): vpermt2ps picks each lane's float from 32 by the index's low 5
// bits, and masked blends on the next bits pick among those.
template <int kN>
inline __m512 lookup(const float* table, __m512i j) {
  static_assert(kN == 32 || kN == 64 || kN == 128 || kN == 256);
  if constexpr (kN == 32) {
    return _mm512_maskz_permutex2var_ps(kAll, _mm512_loadu_ps(table), j,
                                        _mm512_loadu_ps(table + 16));
  } else {
    constexpr int kHalf = kN / 2;
    const __mmask16 upper = _mm512_test_epi32_mask(j, _mm512_set1_epi32(kHalf));
    return _mm512_mask_blend_ps(upper, lookup<kHalf>(table, j), lookup<kHalf>(table + kHalf, j));
  }
}

// The binary search of u's magnitude among 2^kBits (device::Adam8Search::level): the level with
// kN candidates, then the next ones.
template <int kBits, int kN = 1>
inline __m512i search_level(const float* level, __m512 u, __m512i k) {
  constexpr int kStep = (1 << (kBits - 1)) / kN;  // k moves by kStep at this level
  __m512 t;
  if constexpr (kN == 1) {
    t = _mm512_set1_ps(level[1]);
  } else {
    constexpr int kShift = std::countr_zero(static_cast<unsigned>(2 * kStep));
    const __m512i j = _mm512_maskz_srli_epi32(kAll, k, kShift);  // the candidate: k / (2 * kStep)
    if constexpr (kN <= 16) {
      t = _mm512_maskz_permutexvar_ps(kAll, j, _mm512_loadu_ps(level + kN));
    } else {
      t = lookup<kN>(level + kN, j);
    }
  }
  k = _mm512_mask_add_epi32(k, _mm512_cmp_ps_mask(t, u, _CMP_LT_OQ), k, _mm512_set1_epi32(kStep));
  if constexpr (kStep == 1) {
    return k;
  } else {
    return search_level<kBits, 2 * kN>(level, u, k);
  }
}

// The byte of each lane's magnitude u by arithmetic (device::Adam8Search::band_*), the tables in
// registers: the band from u's binade (and the decimal boundary inside it), the byte the floor
// of x = u * slope + offset in one rounding. Where a lane's x lies within kAdam8BandMargin of an
// integer (one lane in about 500, and NaN), the whole vector takes the search by levels instead,
// so the bytes are the search's everywhere.
struct BandTables {
  __m512i band_lo, band_hi;
  __m512 boundary_lo, boundary_hi, slope, offset;
  explicit BandTables(const Quant8Search& s)
      : band_lo(_mm512_loadu_si512(s.binade_band)),
        band_hi(_mm512_loadu_si512(s.binade_band + 16)),
        boundary_lo(_mm512_loadu_ps(s.binade_boundary)),
        boundary_hi(_mm512_loadu_ps(s.binade_boundary + 16)),
        slope(_mm512_loadu_ps(s.band_slope)),
        offset(_mm512_loadu_ps(s.band_offset)) {}
};

template <int kBits>
inline __m512i search_band(const Quant8Search& s, const BandTables& b, __m512 u) {
  const __m512i zero = _mm512_setzero_si512();
  const __m512i binade = _mm512_maskz_max_epi32(
      kAll,
      _mm512_sub_epi32(_mm512_maskz_srli_epi32(kAll, _mm512_castps_si512(u), 23),
                       _mm512_set1_epi32(device::kAdam8BinadeLo)),
      zero);
  __m512i z = _mm512_maskz_permutex2var_epi32(kAll, b.band_lo, binade, b.band_hi);
  const __m512 boundary = _mm512_maskz_permutex2var_ps(kAll, b.boundary_lo, binade, b.boundary_hi);
  z = _mm512_mask_sub_epi32(z, _mm512_cmp_ps_mask(u, boundary, _CMP_GT_OQ), z,
                            _mm512_set1_epi32(1));
  const __m512 x = _mm512_fmadd_ps(u, _mm512_maskz_permutexvar_ps(kAll, z, b.slope),
                                   _mm512_maskz_permutexvar_ps(kAll, z, b.offset));
  const __m512 whole =
      _mm512_maskz_roundscale_ps(kAll, x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 frac = _mm512_sub_ps(x, whole);
  const __mmask16 certain =
      _mm512_cmp_ps_mask(frac, _mm512_set1_ps(device::kAdam8BandMargin), _CMP_GE_OQ) &
      _mm512_cmp_ps_mask(frac, _mm512_set1_ps(1.0f - device::kAdam8BandMargin), _CMP_LE_OQ);
  if (certain != kAll) [[unlikely]] {
    return search_level<kBits>(s.level, u, zero);
  }
  return _mm512_maskz_cvttps_epi32(kAll, whole);
}

// The byte of y = x * r in the first moment's (signed) code: the magnitude's byte, with the sign
// bit for a negative y (never for 0).
inline __m512i code_m(const Quant8Search& s, const BandTables& b, __m512 y) {
  const __m512i zero = _mm512_setzero_si512();
  const __m512i k = search_band<7>(s, b, _mm512_abs_ps(y));
  const __mmask16 at_zero = _mm512_cmpeq_epi32_mask(k, zero);
  const __mmask16 negative = _mm512_cmplt_epi32_mask(_mm512_castps_si512(y), zero);
  return _mm512_mask_or_epi32(k, negative & static_cast<__mmask16>(~at_zero), k,
                              _mm512_set1_epi32(0x80));
}

// The byte of a second moment's root y = sqrt(v) * r in the unsigned code: a positive root that
// finds 0 takes 1.
inline __m512i code_v(const Quant8Search& s, const BandTables& b, __m512 y) {
  const __m512i k = search_band<8>(s, b, y);
  const __mmask16 at_zero = _mm512_cmpeq_epi32_mask(k, _mm512_setzero_si512());
  return _mm512_mask_mov_epi32(k, at_zero & _mm512_cmp_ps_mask(y, _mm512_setzero_ps(), _CMP_GT_OQ),
                               _mm512_set1_epi32(1));
}

// The largest of 16 lanes, none NaN.
inline float max_lane(__m512 x) {
  const __m512d d = _mm512_castps_pd(x);
  const __m256 h = _mm256_max_ps(_mm256_castpd_ps(_mm512_maskz_extractf64x4_pd(0xf, d, 0)),
                                 _mm256_castpd_ps(_mm512_maskz_extractf64x4_pd(0xf, d, 1)));
  __m128 q = _mm_max_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  q = _mm_max_ps(q, _mm_movehl_ps(q, q));
  return _mm_cvtss_f32(_mm_max_ss(q, _mm_shuffle_ps(q, q, 1)));
}

// device::adam8_reciprocal's statement, inline (a call a block showed in profiles).
inline float block_reciprocal(float a) {
  return a >= std::numeric_limits<float>::min() ? 1.0f / a : 0.0f;
}

// The scalar kernel's statements 16 lanes at a time: the absolute maximum (order-free), the square
// root, the product by the reciprocal, the byte, narrowed on store.
template <bool kSecond>
void quant8_lanes(const Quant8Search& s, const float* x, std::int64_t n, std::uint8_t* codes,
                  float* scale) {
  // The values quantized (the second moment's roots, each taken once) and their largest magnitude.
  alignas(64) float base[device::kAdam8BlockElems];
  __m512 amax = _mm512_setzero_ps();
  for (std::int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask(std::min<std::int64_t>(n - i, 16));
    __m512 v = _mm512_maskz_loadu_ps(m, x + i);
    if constexpr (kSecond) v = _mm512_maskz_sqrt_ps(kAll, v);
    _mm512_store_ps(base + i, v);
    amax = _mm512_maskz_max_ps(kAll, _mm512_abs_ps(v), amax);  // a NaN skipped (adam8_block)
  }
  const float a = max_lane(amax);
  const float r = block_reciprocal(a);
  *scale = r == 0.0f ? 0.0f : a;
  if (r == 0.0f) {
    for (std::int64_t i = 0; i < n; ++i) codes[i] = 0;
    return;
  }
  const __m512 vr = _mm512_set1_ps(r);
  const BandTables bands(s);
  for (std::int64_t i = 0; i < n; i += 16) {
    const __m512 y = _mm512_maskz_mul_ps(kAll, _mm512_load_ps(base + i), vr);
    const __m512i k = kSecond ? code_v(s, bands, y) : code_m(s, bands, y);
    if (n - i >= 16) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + i), _mm512_maskz_cvtepi32_epi8(kAll, k));
    } else {
      _mm512_mask_cvtepi32_storeu_epi8(codes + i, tail_mask(n - i), k);
    }
  }
}

void quant8_block(const Quant8Search& s, const float* x, std::int64_t n, std::uint8_t* codes,
                  float* scale) {
  if (s.second) {
    quant8_lanes<true>(s, x, n, codes, scale);
  } else {
    quant8_lanes<false>(s, x, n, codes, scale);
  }
}

// value[c] * scale by register lookups: the signed code's 128 magnitudes with the sign bit
// applied after (bytes above 0x80; 0x80 is 0), or (dequant_v) the unsigned code's 256 values,
// the product squared.
inline __m512 dequant_m(const float* value, __m512i c, __m512 scale) {
  const __m512 v = _mm512_maskz_mul_ps(kAll, lookup<128>(value, c), scale);
  const __mmask16 negative = _mm512_cmpgt_epu32_mask(c, _mm512_set1_epi32(0x80));
  return _mm512_castsi512_ps(_mm512_mask_xor_epi32(
      _mm512_castps_si512(v), negative, _mm512_castps_si512(v), _mm512_set1_epi32(INT32_MIN)));
}
inline __m512 dequant_v(const float* value, __m512i c, __m512 scale) {
  const __m512 v = _mm512_maskz_mul_ps(kAll, lookup<256>(value, c), scale);
  return _mm512_maskz_mul_ps(kAll, v, v);
}

void dequant8_block(const float* value, const std::uint8_t* codes, float scale, std::int64_t n,
                    bool square, float* out) {
  const __m512 vs = _mm512_set1_ps(scale);
  for (std::int64_t i = 0; i < n; i += 16) {
    const __mmask16 tail = tail_mask(std::min<std::int64_t>(n - i, 16));
    const __m512i c = _mm512_maskz_cvtepu8_epi32(kAll, _mm_maskz_loadu_epi8(tail, codes + i));
    _mm512_mask_storeu_ps(out + i, tail,
                          square ? dequant_v(value, c, vs) : dequant_m(value, c, vs));
  }
}

// ---- bf16 master weights, stochastic rounding ----

constexpr __mmask8 kAll8 = 0xff;

// x * c modulo 2^64 in each 64-bit lane, from 32-bit products (AVX-512F has no 64-bit multiply).
inline __m512i mul64(__m512i x, std::uint64_t c) {
  const __m512i c_lo = _mm512_set1_epi64(static_cast<long long>(c & 0xffffffffu));
  const __m512i c_hi = _mm512_set1_epi64(static_cast<long long>(c >> 32));
  const __m512i cross =
      _mm512_add_epi64(_mm512_maskz_mul_epu32(kAll8, x, c_hi),
                       _mm512_maskz_mul_epu32(kAll8, _mm512_maskz_srli_epi64(kAll8, x, 32), c_lo));
  return _mm512_add_epi64(_mm512_maskz_mul_epu32(kAll8, x, c_lo),
                          _mm512_maskz_slli_epi64(kAll8, cross, 32));
}

// splitmix64_at's mixing of eight states z = key + (i + 1) * golden.
inline __m512i splitmix_mix(__m512i z) {
  z = mul64(_mm512_xor_si512(z, _mm512_maskz_srli_epi64(kAll8, z, 30)), 0xbf58476d1ce4e5b9ull);
  z = mul64(_mm512_xor_si512(z, _mm512_maskz_srli_epi64(kAll8, z, 27)), 0x94d049bb133111ebull);
  return _mm512_xor_si512(z, _mm512_maskz_srli_epi64(kAll8, z, 31));
}

// The low 32 bits of splitmix64_at(seed, first + j) for 16 consecutive elements j, a vector at a
// time: each element's state advances by 16 golden steps a vector.
class StochasticDraws {
 public:
  StochasticDraws(std::uint64_t seed, std::uint64_t first) {
    const __m512i lane = _mm512_set_epi64(7, 6, 5, 4, 3, 2, 1, 0);
    // States of elements first + j (j = lane, lane + 8): key + (first + j + 1) * golden.
    z0_ = _mm512_add_epi64(
        _mm512_set1_epi64(static_cast<long long>(seed)),
        mul64(_mm512_add_epi64(lane, _mm512_set1_epi64(static_cast<long long>(first + 1))),
              kGolden));
    z1_ = _mm512_add_epi64(z0_, _mm512_set1_epi64(static_cast<long long>(8 * kGolden)));
  }
  // Lanes 0-7 from z0's states, 8-15 from z1's; then the next 16 elements.
  __m512i next() {
    const __m512i low_halves =
        _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i r =
        _mm512_maskz_permutex2var_epi32(kAll, splitmix_mix(z0_), low_halves, splitmix_mix(z1_));
    const __m512i step = _mm512_set1_epi64(static_cast<long long>(16 * kGolden));
    z0_ = _mm512_add_epi64(z0_, step);
    z1_ = _mm512_add_epi64(z1_, step);
    return r;
  }

 private:
  static constexpr std::uint64_t kGolden = 0x9e3779b97f4a7c15ull;
  __m512i z0_, z1_;
};

// f32_to_bf16_stochastic on 16 lanes with the draws r: infinities and NaNs round to nearest as
// f32_to_bf16 does. The bf16 bits, in the low half of each lane.
inline __m512i round_stochastic_bits(__m512 x, __m512i r) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i exp = _mm512_set1_epi32(0x7f800000);
  __m512i bits = shr16(_mm512_add_epi32(u, _mm512_and_si512(r, _mm512_set1_epi32(0xffff))));
  // Infinity and NaN round as f32_to_bf16 does: to themselves, NaN quieted.
  const __mmask16 special = _mm512_cmpeq_epi32_mask(_mm512_and_si512(u, exp), exp);
  if (special != 0) bits = _mm512_mask_mov_epi32(bits, special, widen_u16(f32_to_bf16_int(x)));
  return bits;
}

// The scalar loop 16 lanes at a time.
void round_stochastic(float* p, std::int64_t n, std::uint64_t seed, std::uint64_t first,
                      std::uint16_t* dst) {
  StochasticDraws draws(seed, first);
  for (std::int64_t j = 0; j < n; j += 16) {
    const __mmask16 tail = tail_mask(std::min<std::int64_t>(n - j, 16));
    const __m512i bits = round_stochastic_bits(_mm512_maskz_loadu_ps(tail, p + j), draws.next());
    _mm512_mask_cvtepi32_storeu_epi16(dst + j, tail, bits);
    _mm512_mask_storeu_ps(p + j, tail, _mm512_castsi512_ps(shl16(bits)));
  }
}

// ---- 8-bit moments, fused: a block at a time in registers ----

constexpr int kBlockVecs = static_cast<int>(device::kAdam8BlockElems / kLanes);
static_assert(device::kAdam8BlockElems % kLanes == 0);

template <bool kMasked>
inline __m512i load_codes(const std::uint8_t* p, __mmask16 k) {
  if constexpr (kMasked) {
    return _mm512_maskz_cvtepu8_epi32(kAll, _mm_maskz_loadu_epi8(k, p));
  } else {
    return _mm512_maskz_cvtepu8_epi32(kAll, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
}

template <bool kMasked>
inline void store_codes(std::uint8_t* p, __m512i k, __mmask16 mask) {
  if constexpr (kMasked) {
    _mm512_mask_cvtepi32_storeu_epi8(p, mask, k);
  } else {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_maskz_cvtepi32_epi8(kAll, k));
  }
}

// The master weights of 16 elements from element i, in f32: f32 ones; bf16 ones plus their Kahan
// compensation (the chunks' add_compensation); or bf16 ones.
template <int kMaster, bool kMasked>
inline __m512 load_master(const Adam8Tile& t, std::int64_t i, __mmask16 k) {
  if constexpr (kMaster == kMasterF32) {
    return load_f32<kMasked>(static_cast<const float*>(t.param_in) + i, k);
  } else {
    const __m512 p =
        bf16x16_to_f32(load_u16x16<kMasked>(static_cast<const std::uint16_t*>(t.param_in) + i, k));
    if constexpr (kMaster == kMasterKahan) {
      return _mm512_add_ps(p, bf16x16_to_f32(load_u16x16<kMasked>(t.param_comp_in + i, k)));
    } else {
      return p;
    }
  }
}

// Stores the updated master weights p of 16 elements from element i as CpuAdam's store_master
// does, and gives the value stored: f32; bf16 rounded to nearest with what that dropped, rounded
// toward zero, as the compensation (the value stored is their f32 sum); or bf16 rounded
// stochastically with the draws r.
template <int kMaster, bool kNativeBF16, bool kMasked>
inline __m512 store_master(const Adam8Tile& t, std::int64_t i, __m512 p, __mmask16 k, __m512i r) {
  if constexpr (kMaster == kMasterF32) {
    store_f32<kMasked, false>(static_cast<float*>(t.param) + i, p, k);
    return p;
  } else if constexpr (kMaster == kMasterKahan) {
    const __m256i h = kNativeBF16 ? f32_to_bf16_native(p) : f32_to_bf16_int(p);
    const __m512 hi = bf16x16_to_f32(h);
    const __m256i comp = narrow_u32(shr16(_mm512_castps_si512(_mm512_sub_ps(p, hi))));
    store_u16x16<kMasked, false>(static_cast<std::uint16_t*>(t.param) + i, h, k);
    store_u16x16<kMasked, false>(t.param_comp + i, comp, k);
    return _mm512_add_ps(hi, bf16x16_to_f32(comp));
  } else {
    const __m512i bits = round_stochastic_bits(p, r);
    store_u16x16<kMasked, false>(static_cast<std::uint16_t*>(t.param) + i, narrow_u32(bits), k);
    return _mm512_castsi512_ps(shl16(bits));
  }
}

// One block of `len` elements from element `at` (kMasked: len < the block's elements): the
// moments dequantized (dequant8_block), adam_vec's statements on each vector (the root Adam
// divides by is the root the second moment's byte is found for), the master weights stored and
// the copy converted from the value stored, the block's absolute maxima (a NaN skipped, as
// std::max skips it in the reference), and each moment's bytes (quant8_lanes'; a block whose
// maximum is below f32's normal range has reciprocal 0, so every product is 0 or NaN, whose byte
// is 0).
// What every block of a tile reads: the constants broadcast, each moment's code and its tables in
// registers, the tile (a copy, as adam_tile keeps), and the stochastic draws, which advance a
// vector at a time through the tile.
struct Adam8Pass {
  Adam8Pass(const AdamConstants& constants, const Quant8Search& m, const Quant8Search& v,
            const Adam8Tile& tile)
      : c(broadcast(constants)), qm(m), qv(v), bm(m), bv(v), t(tile), draws(t.seed, t.first) {}
  const Vconsts c;
  const Quant8Search& qm;
  const Quant8Search& qv;
  const BandTables bm, bv;
  const Adam8Tile t;
  StochasticDraws draws;
};

template <int G, int O, bool kAdamW, bool kNativeBF16, int kMaster, bool kMasked>
inline void adam8_block(Adam8Pass& pass, std::int64_t at, std::int64_t block, std::int64_t len) {
  const Vconsts& c = pass.c;
  const Quant8Search &qm = pass.qm, &qv = pass.qv;
  const BandTables &bm = pass.bm, &bv = pass.bv;
  const Adam8Tile& t = pass.t;
  const __m512 ms = _mm512_set1_ps(t.exp_avg_scale_in[block]);
  const __m512 vs = _mm512_set1_ps(t.exp_avg_sq_scale_in[block]);
  __m512 m[kBlockVecs], root[kBlockVecs];
  __mmask16 mask[kBlockVecs];
  __m512 amax_m = _mm512_setzero_ps(), amax_v = _mm512_setzero_ps();
#pragma GCC unroll 4
  for (int k = 0; k < kBlockVecs; ++k) {
    const std::int64_t i = at + kLanes * k;
    mask[k] = kMasked ? tail_mask(std::clamp<std::int64_t>(len - kLanes * k, 0, kLanes)) : kAll;
    __m512 g = _mm512_mul_ps(load_grad<G, kMasked>(t.grad, i, mask[k]), c.grad_scale);
    __m512 p = load_master<kMaster, kMasked>(t, i, mask[k]);
    if constexpr (kAdamW) {
      p = _mm512_mul_ps(p, c.decay);
    } else {
      g = _mm512_add_ps(g, _mm512_mul_ps(c.wd, p));
    }
    const __m512 m_old = dequant_m(qm.value, load_codes<kMasked>(t.exp_avg_in + i, mask[k]), ms);
    const __m512 v_old = dequant_v(qv.value, load_codes<kMasked>(t.exp_avg_sq_in + i, mask[k]), vs);
    m[k] = _mm512_add_ps(_mm512_mul_ps(c.beta1, m_old), _mm512_mul_ps(c.omb1, g));
    const __m512 v =
        _mm512_add_ps(_mm512_mul_ps(c.beta2, v_old), _mm512_mul_ps(_mm512_mul_ps(c.omb2, g), g));
    root[k] = _mm512_maskz_sqrt_ps(kAll, v);
    const __m512 denom = _mm512_add_ps(_mm512_div_ps(root[k], c.bc2_sqrt), c.eps);
    p = _mm512_sub_ps(p, _mm512_div_ps(_mm512_mul_ps(c.step_size, m[k]), denom));
    __m512i r = _mm512_setzero_si512();
    if constexpr (kMaster == kMasterStochastic) r = pass.draws.next();
    p = store_master<kMaster, kNativeBF16, kMasked>(t, i, p, mask[k], r);
    store_out<O, kNativeBF16, kMasked, false>(t.param_out, i, p, mask[k]);
    // vmaxps gives its second operand where either is NaN: the maximum so far.
    amax_m = _mm512_maskz_max_ps(kAll, _mm512_abs_ps(m[k]), amax_m);
    amax_v = _mm512_maskz_max_ps(kAll, root[k], amax_v);
  }
  const float a_m = max_lane(amax_m), a_v = max_lane(amax_v);
  const float r_m = block_reciprocal(a_m), r_v = block_reciprocal(a_v);
  t.exp_avg_scale[block] = r_m == 0.0f ? 0.0f : a_m;
  t.exp_avg_sq_scale[block] = r_v == 0.0f ? 0.0f : a_v;
  const __m512 vr_m = _mm512_set1_ps(r_m), vr_v = _mm512_set1_ps(r_v);
#pragma GCC unroll 4
  for (int k = 0; k < kBlockVecs; ++k) {
    const std::int64_t i = at + kLanes * k;
    store_codes<kMasked>(t.exp_avg + i, code_m(qm, bm, _mm512_maskz_mul_ps(kAll, m[k], vr_m)),
                         mask[k]);
    store_codes<kMasked>(t.exp_avg_sq + i, code_v(qv, bv, _mm512_maskz_mul_ps(kAll, root[k], vr_v)),
                         mask[k]);
  }
}

template <int G, int O, bool kAdamW, bool kNativeBF16, int kMaster>
void adam8_tile(const AdamConstants& constants, const Quant8Search& qm, const Quant8Search& qv,
                const Adam8Tile& tile) {
  Adam8Pass pass(constants, qm, qv, tile);
  constexpr std::int64_t kBlock = device::kAdam8BlockElems;
  const std::int64_t n = pass.t.n;
  std::int64_t at = 0, block = 0;
  for (; at + kBlock <= n; at += kBlock, ++block) {
    adam8_block<G, O, kAdamW, kNativeBF16, kMaster, false>(pass, at, block, kBlock);
  }
  if (at < n) adam8_block<G, O, kAdamW, kNativeBF16, kMaster, true>(pass, at, block, n - at);
}

// ---- table ----

template <bool kNativeBF16>
struct Avx512Compact {
  template <int G, int O, bool kAdamW, int kMaster>
  static constexpr Adam8Kernel adam8 = &adam8_tile<G, O, kAdamW, kNativeBF16, kMaster>;
  static constexpr Quant8Kernel quant8 = &quant8_block;
  static constexpr Dequant8Kernel dequant8 = &dequant8_block;
  static constexpr RoundStochasticKernel round_stochastic = &detail::round_stochastic;
};

}  // namespace

void fill_avx512_compact_kernels(KernelSet* set, bool native_bf16) {
  if (native_bf16) {
    fill_compact_kernels<Avx512Compact<true>>(set);
  } else {
    fill_compact_kernels<Avx512Compact<false>>(set);
  }
}

}  // namespace strata::optim::detail
