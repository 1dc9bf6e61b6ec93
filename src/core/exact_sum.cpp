// ExactSum's fixed-point arithmetic.
#include "strata/core/exact_sum.h"

#include <bit>
#include <cmath>
#include <limits>

#include "strata/core/check.h"

namespace strata {

void ExactSum::add(double x) {
  if (!(x < std::numeric_limits<double>::infinity())) {  // NaN or infinity
    special += x;
    return;
  }
  STRATA_CHECK(x >= 0.0, "ExactSum adds non-negative terms", x);
  if (x == 0.0) return;
  const auto bits = std::bit_cast<std::uint64_t>(x);
  int exponent = static_cast<int>((bits >> 52) & 0x7ff);
  std::uint64_t mantissa = bits & ((std::uint64_t{1} << 52) - 1);
  if (exponent == 0) {
    exponent = 1;  // subnormal: no implicit bit
  } else {
    mantissa |= std::uint64_t{1} << 52;
  }
  // x = mantissa * 2^(exponent - 1075); its lowest bit sits `at` bits above limb 0's.
  int at = exponent - 1075 - kLowBit;
  if (at < 0) {
    if (at <= -53) return;
    mantissa >>= -at;
    at = 0;
  }
  if (at + 53 > kHighBit - kLowBit) {  // its top bit would reach the top limb
    special += std::numeric_limits<double>::infinity();
    return;
  }
  const int limb = at / kLimbBits;
  const unsigned __int128 v = static_cast<unsigned __int128>(mantissa) << (at % kLimbBits);
  constexpr std::uint64_t kMask = 0xffffffffu;
  limbs[limb] += static_cast<std::int64_t>(static_cast<std::uint64_t>(v) & kMask);
  limbs[limb + 1] += static_cast<std::int64_t>(static_cast<std::uint64_t>(v >> 32) & kMask);
  limbs[limb + 2] += static_cast<std::int64_t>(static_cast<std::uint64_t>(v >> 64));
}

ExactSum& ExactSum::operator+=(const ExactSum& other) {
  for (int i = 0; i < kLimbs; ++i) limbs[i] += other.limbs[i];
  special += other.special;
  return *this;
}

void ExactSum::normalize() {
  for (int i = 0; i + 1 < kLimbs; ++i) {
    const std::int64_t carry = limbs[i] >> kLimbBits;  // limbs are never negative
    limbs[i] -= carry << kLimbBits;
    limbs[i + 1] += carry;
  }
}

double ExactSum::value() const {
  ExactSum n = *this;
  n.normalize();
  double sum = 0.0;
  for (int i = kLimbs - 1; i >= 0; --i) {
    sum += std::ldexp(static_cast<double>(n.limbs[i]), kLimbBits * i + kLowBit);
  }
  return sum + special;
}

bool ExactSum::operator==(const ExactSum& other) const {
  ExactSum a = *this, b = other;
  a.normalize();
  b.normalize();
  for (int i = 0; i < kLimbs; ++i) {
    if (a.limbs[i] != b.limbs[i]) return false;
  }
  return std::bit_cast<std::uint64_t>(a.special) == std::bit_cast<std::uint64_t>(b.special) ||
         (std::isnan(a.special) && std::isnan(b.special));
}

void ExactSum::to_doubles(double* out) const {
  ExactSum n = *this;
  n.normalize();
  for (int i = 0; i < kLimbs; ++i) out[i] = static_cast<double>(n.limbs[i]);
  out[kLimbs] = n.special;
}

ExactSum ExactSum::from_doubles(const double* in) {
  ExactSum s;
  for (int i = 0; i < kLimbs; ++i) s.limbs[i] = static_cast<std::int64_t>(in[i]);
  s.special = in[kLimbs];
  return s;
}

}  // namespace strata
