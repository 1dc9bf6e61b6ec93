// Block-wise 8-bit Adam moments against a reference written from the paper (Dettmers et al.,
// "8-bit Optimizers via Block-wise Quantization", section 2): the dynamic tree code decoded from
// its bit fields, quantization as an exhaustive search for the nearest value, and the AdamW step
// over dequantized moments, all independent of strata's tables and searches.
#include "strata/device/adam8bit.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "strata/core/rng.h"
#include "strata/device/ops.h"

namespace strata::device {
namespace {

// ---- the paper's reference -------------------------------------------------------------------

// Dynamic tree quantization: [sign] then zeros (a decimal exponent each), an indicator 1, and the
// remaining bits a linear fraction over [0.1, 1] (its bins' upper ends); all zeros is 0.
double paper_decode(unsigned byte, bool is_signed) {
  const int bits = is_signed ? 7 : 8;
  const bool negative = is_signed && (byte & 0x80u) != 0;
  const unsigned body = is_signed ? byte & 0x7fu : byte;
  int exponent = 0;  // count the zero bits from the top until the indicator
  int pos = bits - 1;
  while (pos >= 0 && ((body >> pos) & 1u) == 0) {
    ++exponent;
    --pos;
  }
  if (pos < 0) return 0.0;
  const int fraction_bits = pos;  // the bits below the indicator
  const unsigned fraction = body & ((1u << fraction_bits) - 1u);
  const double linear =
      0.1 + 0.9 * static_cast<double>(fraction + 1) / static_cast<double>(1u << fraction_bits);
  const double value = std::pow(10.0, -exponent) * linear;
  return negative ? -value : value;
}

// The byte whose value is nearest y (ties: the smaller magnitude; zero as byte 0), compared in
// double; `nonzero`: a positive y never becomes 0.
std::uint8_t paper_encode(float y, bool is_signed, bool nonzero) {
  int best = -1;
  double best_value = 0, best_dist = std::numeric_limits<double>::infinity();
  for (unsigned b = 0; b < 256; ++b) {
    const double v = static_cast<float>(paper_decode(b, is_signed));  // the code holds f32
    if (nonzero && y > 0 && v == 0.0) continue;
    const double d = std::fabs(static_cast<double>(y) - v);
    if (d < best_dist || (d == best_dist && std::fabs(v) < std::fabs(best_value))) {
      best = static_cast<int>(b);
      best_dist = d;
      best_value = v;
    }
  }
  return best_value == 0.0 ? 0 : static_cast<std::uint8_t>(best);
}

// A block: scale = the largest magnitude a (of m, or of sqrt(v)); each element y = x * (1 / a),
// in f32; a block whose a is below f32's normal range is all zeros with scale 0.
void paper_quantize(const std::vector<float>& x, bool second, std::vector<std::uint8_t>* codes,
                    float* scale) {
  std::vector<float> base(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) base[i] = second ? std::sqrt(x[i]) : x[i];
  float a = 0;
  for (float b : base) a = std::max(a, std::fabs(b));
  codes->assign(x.size(), 0);
  *scale = 0;
  if (a < std::numeric_limits<float>::min()) return;
  *scale = a;
  const float r = 1.0f / a;
  for (std::size_t i = 0; i < x.size(); ++i) {
    (*codes)[i] = paper_encode(base[i] * r, !second, second);
  }
}

float paper_dequantize(std::uint8_t code, float scale, bool second) {
  const float s = static_cast<float>(paper_decode(code, !second)) * scale;
  return second ? s * s : s;
}

// Moments of many magnitudes inside one block, zeros and a few extremes, as Adam makes them.
std::vector<float> random_block(Rng& rng, std::int64_t n, bool nonneg) {
  std::vector<float> x(static_cast<std::size_t>(n));
  const double base = std::pow(10.0, rng.uniform() * 20.0 - 15.0);
  for (auto& e : x) {
    const double u = rng.uniform();
    double v = rng.normal() * base * std::pow(10.0, rng.uniform() * 8.0 - 7.0);
    if (u < 0.05) v = 0;
    if (u > 0.98) v = base * 3.0;  // the block's maximum, maybe negative
    if (nonneg) v = v * v;
    e = static_cast<float>(v);
  }
  return x;
}

TEST(Adam8bit, CodesAreThePapersDynamicTreeValues) {
  const auto& s = adam8_signed_code();
  const auto& u = adam8_unsigned_code();
  for (unsigned b = 0; b < 256; ++b) {
    EXPECT_EQ(s[b], static_cast<float>(paper_decode(b, true))) << b;
    EXPECT_EQ(u[b], static_cast<float>(paper_decode(b, false))) << b;
  }
  // Both hold 0 and exactly 1 (and -1), and reach 10^-6 and 10^-7.
  EXPECT_EQ(*std::max_element(s.begin(), s.end()), 1.0f);
  EXPECT_EQ(*std::min_element(s.begin(), s.end()), -1.0f);
  EXPECT_EQ(*std::max_element(u.begin(), u.end()), 1.0f);
  float smallest_s = 1, smallest_u = 1;
  for (unsigned b = 0; b < 256; ++b) {
    if (s[b] > 0) smallest_s = std::min(smallest_s, s[b]);
    if (u[b] > 0) smallest_u = std::min(smallest_u, u[b]);
  }
  EXPECT_EQ(smallest_s, 1e-6f);
  EXPECT_EQ(smallest_u, 1e-7f);
}

// Strata's table search gives the paper's exhaustive nearest-value search, byte for byte, on
// random blocks and on every midpoint between neighbouring values and the floats beside it.
TEST(Adam8bit, QuantizationIsThePapersNearestValue) {
  Rng rng(8);
  for (int trial = 0; trial < 200; ++trial) {
    const std::int64_t n = trial % 7 == 0 ? 1 + trial % (kAdam8BlockElems - 1) : kAdam8BlockElems;
    for (const bool second : {false, true}) {
      const std::vector<float> x = random_block(rng, n, second);
      std::vector<std::uint8_t> want;
      float want_scale = 0;
      paper_quantize(x, second, &want, &want_scale);
      std::vector<std::uint8_t> got(static_cast<std::size_t>(n));
      float got_scale = -1;
      if (second) {
        adam8_quantize_v(x.data(), n, got.data(), &got_scale);
      } else {
        adam8_quantize_m(x.data(), n, got.data(), &got_scale);
      }
      ASSERT_EQ(got_scale, want_scale) << trial;
      ASSERT_EQ(got, want) << "trial " << trial << (second ? " second moment" : " first moment");
    }
  }
  // Midpoints: with scale 1 (a block whose largest element is 1), y is the element itself.
  for (const bool second : {false, true}) {
    const auto& code = second ? adam8_unsigned_code() : adam8_signed_code();
    std::vector<float> sorted(code.begin(), code.end());
    std::sort(sorted.begin(), sorted.end());
    std::vector<float> ys;
    for (std::size_t j = 0; j + 1 < sorted.size(); ++j) {
      const auto mid = static_cast<float>((static_cast<double>(sorted[j]) + sorted[j + 1]) / 2);
      for (float y : {std::nextafter(mid, -1.0f), mid, std::nextafter(mid, 2.0f)}) {
        if (y >= -1 && y <= 1 && (!second || y >= 0)) ys.push_back(y);
      }
    }
    for (std::size_t at = 0; at < ys.size(); at += kAdam8BlockElems - 1) {
      std::vector<float> x(
          ys.begin() + static_cast<std::ptrdiff_t>(at),
          ys.begin() + static_cast<std::ptrdiff_t>(std::min(ys.size(), at + kAdam8BlockElems - 1)));
      x.push_back(1.0f);  // the scale
      if (second) {
        for (float& e : x) e = e * e;  // v whose root is (about) y
      }
      std::vector<std::uint8_t> want;
      float want_scale = 0;
      paper_quantize(x, second, &want, &want_scale);
      std::vector<std::uint8_t> got(x.size());
      float got_scale = 0;
      const auto len = static_cast<std::int64_t>(x.size());
      second ? adam8_quantize_v(x.data(), len, got.data(), &got_scale)
             : adam8_quantize_m(x.data(), len, got.data(), &got_scale);
      ASSERT_EQ(got, want) << (second ? "unsigned" : "signed") << " midpoints from " << at;
    }
  }
}

// The vector kernels' short cuts find the byte the full search finds, for every 97th f32 in
// [0, 1] and for each code's thresholds and the floats beside them: the search by levels (in
// registers on AVX-512, where the arithmetic is unsure), the bucket by u's top 16 bits with two
// thresholds (gathers on AVX2), and the arithmetic by band wherever it is sure (AVX-512).
TEST(Adam8bit, TheVectorSearchesFindTheFullSearchsByte) {
  for (const bool second : {false, true}) {
    const Adam8Search& s = adam8_search(second);
    const int half = second ? 128 : 64;  // the byte's magnitude bits: 8 or 7
    const auto by_levels = [&](float u) {
      int k = 0;
      for (int n = 1; n <= half; n *= 2) {
        const int step = half / n;
        if (s.level[static_cast<std::size_t>(n + k / (2 * step))] < u) k += step;
      }
      return k;
    };
    const auto bucketed = [&](float u) {
      const auto key = static_cast<std::int32_t>(std::bit_cast<std::uint32_t>(u) >> 16);
      const std::int32_t first = s.bucket[static_cast<std::size_t>(
          std::clamp(key, kAdam8BucketLo, kAdam8BucketHi) - kAdam8BucketLo)];
      return first + (s.threshold[static_cast<std::size_t>(first)] < u) +
             (s.threshold[static_cast<std::size_t>(first + 1)] < u);
    };
    // x = u * slope + offset of u's band (its binade's, one less above the boundary in it).
    const auto band_x = [&](float u) {
      const auto exponent = static_cast<std::int32_t>(std::bit_cast<std::uint32_t>(u) >> 23);
      const auto binade = static_cast<std::size_t>(std::max(exponent - kAdam8BinadeLo, 0));
      std::int32_t z = s.binade_band[binade];
      if (u > s.binade_boundary[binade]) --z;
      const auto at = static_cast<std::size_t>(z);
      return std::fma(u, s.band_slope[at], s.band_offset[at]);
    };
    // The band's byte, or -1 where x lies within the margin of an integer (or is NaN).
    const auto by_band = [&](float u) {
      const float x = band_x(u);
      const float whole = std::floor(x);
      if (!(x - whole >= kAdam8BandMargin && x - whole <= 1.0f - kAdam8BandMargin)) return -1;
      return static_cast<int>(whole);
    };
    std::vector<float> us = {0.0f, 1.0f, std::numeric_limits<float>::denorm_min(),
                             std::nextafter(1.0f, 2.0f)};
    for (std::size_t j = 0; j < 256 && std::isfinite(s.threshold[j]); ++j) {
      const float t = s.threshold[j];
      us.insert(us.end(), {std::nextafter(t, -2.0f), t, std::nextafter(t, 2.0f)});
    }
    for (std::uint32_t bits = 0; bits <= 0x3f800000u; bits += 97) {
      us.push_back(std::bit_cast<float>(bits));
    }
    std::size_t unsure = 0;
    for (const float u : us) {
      const int want = adam8_nearest(s, u);
      ASSERT_EQ(by_levels(u), want) << (second ? "unsigned" : "signed") << " u " << u;
      ASSERT_EQ(bucketed(u), want) << (second ? "unsigned" : "signed") << " u " << u;
      const int band = by_band(u);
      if (band >= 0) {
        ASSERT_EQ(band, want) << (second ? "unsigned" : "signed") << " u " << u;
      }
      unsure += band < 0 ? 1 : 0;
    }
    // Unsure about 2 x the margin of the u between thresholds, not more (it costs a search).
    EXPECT_LT(static_cast<double>(unsure) / static_cast<double>(us.size()), 0.01);
    // Sure means right everywhere, not only at the u above: x rises with u within a band, so it
    // suffices that x at each threshold t, and at the next f32 above t, lies within the margin of
    // the byte it steps to there (the count of thresholds below u goes from j to j + 1).
    for (std::size_t j = 0; j < 256 && std::isfinite(s.threshold[j]); ++j) {
      const float t = s.threshold[j];
      for (const float u : {t, std::nextafter(t, 2.0f)}) {
        EXPECT_LT(std::abs(static_cast<double>(band_x(u)) - static_cast<double>(j + 1)),
                  std::ldexp(1.0, -15))  // the header's 2^-16, with a factor of 2 to spare
            << (second ? "unsigned" : "signed") << " threshold " << j << " (u " << u << ")";
      }
    }
  }
}

// A block whose largest magnitude is below f32's normal range (its reciprocal would overflow) is
// stored as zeros with scale 0, and reads back as zeros.
TEST(Adam8bit, BlocksBelowTheNormalRangeAreStoredAsZeros) {
  const float tiny = std::numeric_limits<float>::min() / 4;
  const std::vector<float> m = {tiny, -tiny / 2, 0.0f, tiny / 8};
  std::vector<std::uint8_t> codes(m.size(), 0xff);
  float scale = -1;
  adam8_quantize_m(m.data(), static_cast<std::int64_t>(m.size()), codes.data(), &scale);
  EXPECT_EQ(scale, 0.0f);
  EXPECT_EQ(codes, std::vector<std::uint8_t>(m.size(), 0));
  std::vector<float> back(m.size(), 1.0f);
  adam8_dequantize_m(codes.data(), scale, static_cast<std::int64_t>(m.size()), back.data());
  EXPECT_EQ(back, std::vector<float>(m.size(), 0.0f));
  // The smallest normal block maximum still quantizes (its reciprocal is finite).
  const std::vector<float> normal = {std::numeric_limits<float>::min(), 0.0f};
  adam8_quantize_m(normal.data(), 2, codes.data(), &scale);
  EXPECT_EQ(scale, std::numeric_limits<float>::min());
  EXPECT_EQ(codes[0], 127);  // the magnitude 1
}

// The error of a round trip is at most half the gap between the code values around y = x / scale
// (times the scale), which the code's construction bounds by decade: for |y| in [0.1, 1] x 10^-z
// the values are 0.9 x 10^-z / 2^k apart (k = 6 - z signed, 7 - z unsigned); in the lowest
// decade and below, its one value 10^-6 (10^-7) or 0 is within 10^-6 (10^-7). A non-zero root
// never decodes to zero.
TEST(Adam8bit, RoundTripErrorStaysWithinTheCodesResolution) {
  Rng rng(9);
  for (int trial = 0; trial < 100; ++trial) {
    for (const bool second : {false, true}) {
      const std::vector<float> x = random_block(rng, kAdam8BlockElems, second);
      std::vector<std::uint8_t> codes(x.size());
      float scale = 0;
      std::vector<float> back(x.size());
      if (second) {
        adam8_quantize_v(x.data(), kAdam8BlockElems, codes.data(), &scale);
        adam8_dequantize_v(codes.data(), scale, kAdam8BlockElems, back.data());
      } else {
        adam8_quantize_m(x.data(), kAdam8BlockElems, codes.data(), &scale);
        adam8_dequantize_m(codes.data(), scale, kAdam8BlockElems, back.data());
      }
      const int bits = second ? 8 : 7;
      for (std::size_t i = 0; i < x.size(); ++i) {
        const double base = second ? std::sqrt(static_cast<double>(x[i])) : x[i];
        const double got = second ? std::sqrt(static_cast<double>(back[i])) : back[i];
        const double y = std::fabs(base) / scale;
        // The lowest decade has one value, 10^-(bits-1), beside 0: at most that far.
        double bound = std::pow(10.0, -(bits - 1));
        for (int z = 0; z < bits - 1; ++z) {
          if (y >= 0.1 * std::pow(10.0, -z)) {
            bound = 0.5 * 0.9 * std::pow(10.0, -z) / std::pow(2.0, bits - 1 - z);
            break;
          }
        }
        // Plus the f32 roundings of y, the product and (second) the square and its root.
        const double slack = 4.0 * std::ldexp(1.0, -23) * scale;
        ASSERT_LE(std::fabs(got - base), bound * scale + slack)
            << "trial " << trial << " element " << i << " y " << y;
        if (second && x[i] > 0) {
          ASSERT_GT(back[i], 0.0f) << "a non-zero moment became zero";
        }
      }
    }
  }
}

// Dequantizing and quantizing again gives the same bytes and scale: the largest element is stored
// exactly (the codes hold 1 and -1), so a checkpoint's f32 moments resume as they were. (Second
// moments whose dequantized square falls below f32's normal range, 1.2e-38, lose bits there.)
TEST(Adam8bit, DequantizedBlocksQuantizeBackToTheSameBytes) {
  Rng rng(10);
  for (int trial = 0; trial < 100; ++trial) {
    const std::int64_t n = 1000 + trial;
    for (const bool second : {false, true}) {
      std::vector<float> x(static_cast<std::size_t>(n));
      for (std::int64_t b = 0; b < n; b += kAdam8BlockElems) {
        auto block = random_block(rng, kAdam8BlockElems, second);
        if (second) {
          const float top = *std::max_element(block.begin(), block.end());
          for (float& e : block) {
            if (e < top * 1e-14f || e < 1e-22f) e = 0;  // (1e-7 x root)^2 stays normal
          }
        }
        std::copy_n(block.begin(), std::min(kAdam8BlockElems, n - b),
                    x.begin() + static_cast<std::ptrdiff_t>(b));
      }
      std::vector<std::uint8_t> codes(x.size()), again(x.size());
      std::vector<float> scales(static_cast<std::size_t>(adam8_blocks(n))), scales2(scales.size());
      std::vector<float> back(x.size());
      adam8_quantize_array(x.data(), n, second, codes.data(), scales.data());
      adam8_dequantize_array(codes.data(), scales.data(), n, second, back.data());
      adam8_quantize_array(back.data(), n, second, again.data(), scales2.data());
      ASSERT_EQ(again, codes) << trial;
      ASSERT_EQ(scales2, scales) << trial;
    }
  }
}

// One AdamW step with 8-bit moments as the paper describes it (dequantize, the 32-bit update,
// quantize), torch.optim.AdamW's arithmetic in f32, against adamw_reference.
TEST(Adam8bit, TheReferenceStepIsThePapersStep) {
  Rng rng(11);
  const std::int64_t n = 1000;  // three whole blocks and a partial one
  std::vector<float> p(n), g(n), m(n), v(n);
  for (std::int64_t i = 0; i < n; ++i) {
    p[i] = static_cast<float>(rng.normal());
    g[i] = static_cast<float>(rng.normal() * 1e-2);
    m[i] = static_cast<float>(rng.normal() * 1e-3);
    v[i] = static_cast<float>(rng.normal() * rng.normal() * 1e-5);
  }
  std::vector<std::uint8_t> mc(n), vc(n);
  std::vector<float> ms(static_cast<std::size_t>(adam8_blocks(n))), vs(ms.size());
  for (std::int64_t b = 0; b < n; b += kAdam8BlockElems) {
    const std::int64_t len = std::min(kAdam8BlockElems, n - b);
    std::vector<std::uint8_t> c;
    paper_quantize(std::vector<float>(m.begin() + b, m.begin() + b + len), false, &c,
                   &ms[static_cast<std::size_t>(b / kAdam8BlockElems)]);
    std::copy(c.begin(), c.end(), mc.begin() + b);
    std::vector<float> vabs(v.begin() + b, v.begin() + b + len);
    for (float& e : vabs) e = std::fabs(e);
    paper_quantize(vabs, true, &c, &vs[static_cast<std::size_t>(b / kAdam8BlockElems)]);
    std::copy(c.begin(), c.end(), vc.begin() + b);
  }
  AdamWArgs a;
  a.lr = 1e-3;
  a.weight_decay = 0.1;
  a.step = 7;
  a.n = n;
  a.grad = g.data();
  a.state_dtype = kAdam8StateDType;

  // The paper's step on copies.
  std::vector<float> p_want = p;
  std::vector<std::uint8_t> mc_want = mc, vc_want = vc;
  std::vector<float> ms_want = ms, vs_want = vs;
  const AdamWConstants k = adamw_constants(a);
  const auto beta1 = static_cast<float>(a.beta1), beta2 = static_cast<float>(a.beta2);
  for (std::int64_t b = 0; b < n; b += kAdam8BlockElems) {
    const std::int64_t len = std::min(kAdam8BlockElems, n - b);
    const auto blk = static_cast<std::size_t>(b / kAdam8BlockElems);
    std::vector<float> m_new(len), v_new(len);
    for (std::int64_t j = 0; j < len; ++j) {
      const float m0 = paper_dequantize(mc[b + j], ms[blk], false);
      const float v0 = paper_dequantize(vc[b + j], vs[blk], true);
      float w = p_want[b + j] * k.decay;
      const float gi = g[b + j];
      m_new[j] = beta1 * m0 + k.one_minus_beta1 * gi;
      v_new[j] = beta2 * v0 + k.one_minus_beta2 * gi * gi;
      w -= k.step_size * m_new[j] / (std::sqrt(v_new[j]) / k.bc2_sqrt + static_cast<float>(a.eps));
      p_want[b + j] = w;
    }
    std::vector<std::uint8_t> c;
    paper_quantize(m_new, false, &c, &ms_want[blk]);
    std::copy(c.begin(), c.end(), mc_want.begin() + b);
    paper_quantize(v_new, true, &c, &vs_want[blk]);
    std::copy(c.begin(), c.end(), vc_want.begin() + b);
  }

  a.param = p.data();
  a.exp_avg = mc.data();
  a.exp_avg_sq = vc.data();
  a.exp_avg_scale = ms.data();
  a.exp_avg_sq_scale = vs.data();
  adamw_reference(a);
  EXPECT_EQ(p, p_want);
  EXPECT_EQ(mc, mc_want);
  EXPECT_EQ(vc, vc_want);
  EXPECT_EQ(ms, ms_want);
  EXPECT_EQ(vs, vs_want);
}

}  // namespace
}  // namespace strata::device
