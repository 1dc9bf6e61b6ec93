// Block-wise 8-bit Adam moments: the dynamic tree codes, their nearest-value search and the block
// quantizers (strata/device/adam8bit.h).
#include "strata/device/adam8bit.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>

namespace strata::device {
namespace {

// A byte's value: sign (signed code only), z leading zeros, the indicator, k fraction bits.
double tree_value(unsigned byte, bool is_signed) {
  const int bits = is_signed ? 7 : 8;
  const unsigned r = is_signed ? byte & 0x7fu : byte;
  if (r == 0) return 0.0;
  const int z = std::countl_zero(r) - (32 - bits);  // leading zeros within `bits`
  const int k = bits - 1 - z;
  const unsigned f = r & ((1u << k) - 1u);
  const double frac = 0.1 + 0.9 * static_cast<double>(f + 1) / static_cast<double>(1u << k);
  const double mag = std::pow(10.0, -z) * frac;
  return is_signed && (byte & 0x80u) != 0 ? -mag : mag;
}

// The number of thresholds below u (branch-free, 8 probes; the 7-bit search's padding is +inf).
inline int nearest(const Adam8Search& c, float u) {
  int idx = 0;
  for (int step = 128; step >= 1; step /= 2) {
    idx += c.threshold[static_cast<std::size_t>(idx + step - 1)] < u ? step : 0;
  }
  return idx;
}

// The search over the magnitudes of `code`'s first 2^bits bytes, which must ascend.
Adam8Search make_search(const std::array<float, 256>& code, int bits) {
  const int count = 1 << bits;
  Adam8Search s{};
  s.threshold.fill(std::numeric_limits<float>::infinity());
  s.level.fill(std::numeric_limits<float>::infinity());
  for (int j = 0; j + 1 < count; ++j) {
    const float lo = code[static_cast<std::size_t>(j)], hi = code[static_cast<std::size_t>(j + 1)];
    if (!(lo < hi)) {
      std::fprintf(stderr, "adam8bit: the code's magnitudes do not ascend at byte %d\n", j);
      std::abort();
    }
    const double mid = (static_cast<double>(lo) + static_cast<double>(hi)) / 2.0;
    float t = static_cast<float>(mid);
    if (static_cast<double>(t) > mid)
      t = std::nextafter(t, -std::numeric_limits<float>::infinity());
    s.threshold[static_cast<std::size_t>(j)] = t;
  }
  // By level: n candidates, each `step` = half / n apart in k, at [n, 2n).
  const int half = count / 2;
  for (int n = 1; n <= half; n *= 2) {
    const int step = half / n;
    for (int j = 0; j < n; ++j) {
      s.level[static_cast<std::size_t>(n + j)] =
          s.threshold[static_cast<std::size_t>(j * 2 * step + step - 1)];
    }
  }
  // The buckets: the thresholds below each bucket's least value, checked against its greatest.
  for (std::int32_t key = kAdam8BucketLo; key <= kAdam8BucketHi; ++key) {
    const auto bits16 = static_cast<std::uint32_t>(key) << 16;
    const float lo = key == kAdam8BucketLo ? 0.0f : std::bit_cast<float>(bits16);
    const float hi = std::bit_cast<float>(bits16 | 0xffffu);
    const std::int32_t first = nearest(s, lo);
    if (nearest(s, hi) - first > 2) {
      std::fprintf(stderr, "adam8bit: bucket %x holds more than 2 thresholds\n", key);
      std::abort();
    }
    s.bucket[static_cast<std::size_t>(key - kAdam8BucketLo)] = first;
  }
  // The bands: z = 0 .. bits - 1, the last reaching down to 0.
  const int last = bits - 1;
  for (int z = 0; z <= last; ++z) {
    const int k = bits - 1 - z;
    const double s_z = 0.9 * std::pow(10.0, -z) / static_cast<double>(1 << k);
    const double slope = z == last ? 1.0 / std::pow(10.0, -z) : 1.0 / s_z;
    const double low = z == last ? 0.0 : std::pow(10.0, -(z + 1));
    const auto at = static_cast<std::size_t>(z);
    s.band_slope[at] = static_cast<float>(slope);
    s.band_offset[at] = static_cast<float>((1 << k) - 0.5 - low * slope);
  }
  // The binades from 2^-31 (and everything below) to 1.
  for (int b = 0; b < 32; ++b) {
    const double lo = std::ldexp(1.0, b + kAdam8BinadeLo - 127);
    int z = 0;
    while (z < last && lo <= std::pow(10.0, -(z + 1))) ++z;
    const auto at = static_cast<std::size_t>(b);
    s.binade_band[at] = z;
    s.binade_boundary[at] = z > 0 && std::pow(10.0, -z) < 2 * lo
                                ? static_cast<float>(std::pow(10.0, -z))
                                : std::numeric_limits<float>::infinity();
  }
  return s;
}

std::array<float, 256> make_code(bool is_signed) {
  std::array<float, 256> code{};
  for (unsigned b = 0; b < 256; ++b) code[b] = static_cast<float>(tree_value(b, is_signed));
  return code;
}

}  // namespace

const std::array<float, 256>& adam8_signed_code() {
  static const std::array<float, 256> code = make_code(true);
  return code;
}

const std::array<float, 256>& adam8_unsigned_code() {
  static const std::array<float, 256> code = make_code(false);
  return code;
}

const Adam8Search& adam8_search(bool second) {
  static const Adam8Search m = make_search(adam8_signed_code(), 7);
  static const Adam8Search v = make_search(adam8_unsigned_code(), 8);
  return second ? v : m;
}

int adam8_nearest(const Adam8Search& s, float u) { return nearest(s, u); }

float adam8_reciprocal(float a) { return a >= std::numeric_limits<float>::min() ? 1.0f / a : 0.0f; }

void adam8_quantize_m(const float* m, std::int64_t n, std::uint8_t* codes, float* scale) {
  float a = 0.0f;
  for (std::int64_t i = 0; i < n; ++i) a = std::max(a, std::fabs(m[i]));
  const float r = adam8_reciprocal(a);
  *scale = r == 0.0f ? 0.0f : a;
  if (r == 0.0f) {
    std::fill_n(codes, n, std::uint8_t{0});
    return;
  }
  const Adam8Search& c = adam8_search(false);
  for (std::int64_t i = 0; i < n; ++i) {
    const float y = m[i] * r;
    const int k = nearest(c, std::fabs(y));
    codes[i] = static_cast<std::uint8_t>(k != 0 && std::signbit(y) ? 0x80 | k : k);
  }
}

void adam8_quantize_v(const float* v, std::int64_t n, std::uint8_t* codes, float* scale) {
  float root[kAdam8BlockElems];
  float a = 0.0f;
  for (std::int64_t i = 0; i < n; ++i) {
    root[i] = std::sqrt(v[i]);
    a = std::max(a, root[i]);
  }
  const float r = adam8_reciprocal(a);
  *scale = r == 0.0f ? 0.0f : a;
  if (r == 0.0f) {
    std::fill_n(codes, n, std::uint8_t{0});
    return;
  }
  const Adam8Search& c = adam8_search(true);
  for (std::int64_t i = 0; i < n; ++i) {
    const float y = root[i] * r;
    const int k = nearest(c, y);
    codes[i] = static_cast<std::uint8_t>(k == 0 && y > 0.0f ? 1 : k);  // non-zero stays non-zero
  }
}

void adam8_dequantize_m(const std::uint8_t* codes, float scale, std::int64_t n, float* m) {
  const auto& code = adam8_signed_code();
  for (std::int64_t i = 0; i < n; ++i) m[i] = code[codes[i]] * scale;
}

void adam8_dequantize_v(const std::uint8_t* codes, float scale, std::int64_t n, float* v) {
  const auto& code = adam8_unsigned_code();
  for (std::int64_t i = 0; i < n; ++i) {
    const float s = code[codes[i]] * scale;
    v[i] = s * s;
  }
}

void adam8_quantize_array(const float* x, std::int64_t n, bool second, std::uint8_t* codes,
                          float* scales) {
  for (std::int64_t b = 0; b * kAdam8BlockElems < n; ++b) {
    const std::int64_t at = b * kAdam8BlockElems;
    const std::int64_t len = std::min(kAdam8BlockElems, n - at);
    if (second) {
      adam8_quantize_v(x + at, len, codes + at, scales + b);
    } else {
      adam8_quantize_m(x + at, len, codes + at, scales + b);
    }
  }
}

void adam8_dequantize_array(const std::uint8_t* codes, const float* scales, std::int64_t n,
                            bool second, float* x) {
  for (std::int64_t b = 0; b * kAdam8BlockElems < n; ++b) {
    const std::int64_t at = b * kAdam8BlockElems;
    const std::int64_t len = std::min(kAdam8BlockElems, n - at);
    if (second) {
      adam8_dequantize_v(codes + at, scales[b], len, x + at);
    } else {
      adam8_dequantize_m(codes + at, scales[b], len, x + at);
    }
  }
}

}  // namespace strata::device
