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

// The index of the nearest value: how many thresholds lie below y (branch-free, 8 probes).
inline int nearest(const Adam8Search& c, float y) {
  int idx = 0;
  for (int step = 128; step >= 1; step /= 2) {
    idx += c.threshold[static_cast<std::size_t>(idx + step - 1)] < y ? step : 0;
  }
  return idx;
}

Adam8Search sort_code(const std::array<float, 256>& code) {
  std::array<int, 256> order{};
  for (int b = 0; b < 256; ++b) order[static_cast<std::size_t>(b)] = b;
  std::stable_sort(order.begin(), order.end(), [&](int x, int y) {
    return code[static_cast<std::size_t>(x)] < code[static_cast<std::size_t>(y)];
  });
  std::array<float, 256> value{};
  Adam8Search s{};
  s.threshold.fill(std::numeric_limits<float>::infinity());
  int count = 0;
  for (const int b : order) {
    const float v = code[static_cast<std::size_t>(b)];
    // Equal values (the signed code's -0 and 0) keep the first byte: 0x00 for zero.
    if (count > 0 && value[static_cast<std::size_t>(count - 1)] == v) continue;
    value[static_cast<std::size_t>(count)] = v;
    s.byte[static_cast<std::size_t>(count)] = v == 0.0f ? 0 : b;
    if (v == 0.0f) s.zero = count;
    ++count;
  }
  for (int j = 0; j + 1 < count; ++j) {
    const double mid = (static_cast<double>(value[static_cast<std::size_t>(j)]) +
                        static_cast<double>(value[static_cast<std::size_t>(j + 1)])) /
                       2.0;
    float t = static_cast<float>(mid);
    if (static_cast<double>(t) > mid)
      t = std::nextafter(t, -std::numeric_limits<float>::infinity());
    s.threshold[static_cast<std::size_t>(j)] = t;
  }
  // The buckets: the thresholds below each bucket's least value, checked against its greatest.
  for (int negative = 0; negative < 2; ++negative) {
    for (std::int32_t key = kAdam8BucketLo; key <= kAdam8BucketHi; ++key) {
      const auto bits = static_cast<std::uint32_t>(key | (negative << 15)) << 16;
      const float a = key == kAdam8BucketLo ? 0.0f : std::bit_cast<float>(bits);
      const float b = std::bit_cast<float>(bits | 0xffffu);
      const float lo = std::min(a, b), hi = std::max(a, b);
      const std::int32_t first = nearest(s, lo);
      if (nearest(s, hi) - first > 2) {
        std::fprintf(stderr, "adam8bit: bucket %x holds more than 2 thresholds\n", key);
        std::abort();
      }
      s.bucket[static_cast<std::size_t>(negative * kAdam8Buckets + key - kAdam8BucketLo)] = first;
    }
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
  static const Adam8Search m = sort_code(adam8_signed_code());
  static const Adam8Search v = sort_code(adam8_unsigned_code());
  return second ? v : m;
}

void adam8_quantize_m(const float* m, std::int64_t n, std::uint8_t* codes, float* scale) {
  float a = 0.0f;
  for (std::int64_t i = 0; i < n; ++i) a = std::max(a, std::fabs(m[i]));
  *scale = a;
  if (a == 0.0f) {
    std::fill_n(codes, n, std::uint8_t{0});
    return;
  }
  const Adam8Search& c = adam8_search(false);
  for (std::int64_t i = 0; i < n; ++i)
    codes[i] = static_cast<std::uint8_t>(c.byte[static_cast<std::size_t>(nearest(c, m[i] / a))]);
}

void adam8_quantize_v(const float* v, std::int64_t n, std::uint8_t* codes, float* scale) {
  float root[kAdam8BlockElems];
  float a = 0.0f;
  for (std::int64_t i = 0; i < n; ++i) {
    root[i] = std::sqrt(v[i]);
    a = std::max(a, root[i]);
  }
  *scale = a;
  if (a == 0.0f) {
    std::fill_n(codes, n, std::uint8_t{0});
    return;
  }
  const Adam8Search& c = adam8_search(true);
  for (std::int64_t i = 0; i < n; ++i) {
    const float y = root[i] / a;
    int idx = nearest(c, y);
    if (idx == c.zero && y > 0.0f) idx = c.zero + 1;  // a non-zero root stays non-zero
    codes[i] = static_cast<std::uint8_t>(c.byte[static_cast<std::size_t>(idx)]);
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
