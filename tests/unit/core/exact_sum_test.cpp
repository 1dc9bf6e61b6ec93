// ExactSum: the same terms give the same bits in any order and grouping, the value is the sum
// to a double's precision, and limbs survive a host all-reduce of their doubles.
#include "strata/core/exact_sum.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "strata/core/rng.h"

namespace strata {
namespace {

// Squares of f32 values over the whole exponent range (subnormals and the largest included),
// in float64, as the gradient norm's chunk sums are.
std::vector<double> wide_squares(std::size_t n, std::uint64_t seed) {
  Rng rng(seed);
  std::vector<double> terms(n);
  for (double& t : terms) {
    const auto bits = static_cast<std::uint32_t>(rng.next_u64()) & 0x7f7fffffu;  // finite, >= 0
    const double f = std::bit_cast<float>(bits);
    t = f * f;
  }
  terms[0] = static_cast<double>(std::numeric_limits<float>::denorm_min()) *
             static_cast<double>(std::numeric_limits<float>::denorm_min());
  terms[1] = static_cast<double>(std::numeric_limits<float>::max()) *
             static_cast<double>(std::numeric_limits<float>::max()) * 256.0;
  return terms;
}

ExactSum sum_of(const std::vector<double>& terms) {
  ExactSum s;
  for (const double t : terms) s.add(t);
  return s;
}

TEST(ExactSumTest, AnyOrderAndAnyGroupingGiveTheSameBits) {
  std::vector<double> terms = wide_squares(5000, 1);
  const ExactSum forward = sum_of(terms);
  std::mt19937_64 shuffle(2);
  for (int trial = 0; trial < 5; ++trial) {
    std::shuffle(terms.begin(), terms.end(), shuffle);
    // Split into 1..7 "ranks" at random points, each summed apart, then merged in reverse.
    const int parts = 1 + trial;
    std::vector<ExactSum> partial(static_cast<std::size_t>(parts));
    for (std::size_t i = 0; i < terms.size(); ++i) {
      partial[(i * 7919) % static_cast<std::size_t>(parts)].add(terms[i]);
    }
    ExactSum merged;
    for (auto it = partial.rbegin(); it != partial.rend(); ++it) merged += *it;
    EXPECT_TRUE(merged == forward) << "trial " << trial;
    EXPECT_EQ(std::bit_cast<std::uint64_t>(merged.value()),
              std::bit_cast<std::uint64_t>(forward.value()));
  }
}

TEST(ExactSumTest, TheValueIsTheSumToADoublesPrecision) {
  // Terms of a narrow range, where long double sums them with little error of its own.
  Rng rng(3);
  std::vector<double> terms(10000);
  for (double& t : terms)
    t = std::ldexp(rng.uniform(), -20 + static_cast<int>(rng.next_u64() % 40));
  long double reference = 0;
  std::vector<double> sorted = terms;
  std::sort(sorted.begin(), sorted.end());
  for (const double t : sorted) reference += t;
  const double v = sum_of(terms).value();
  // Rounding the exact sum's 20 limbs high to low errs by at most a few ulps of the result; the
  // reference's own error (10^4 additions in a 64-bit mantissa) is far below that.
  EXPECT_NEAR(v, static_cast<double>(reference), 4 * std::ldexp(1.0, std::ilogb(v) - 52));
  // Exact where every partial sum fits a double: small integers.
  ExactSum ints;
  for (int i = 1; i <= 1000; ++i) ints.add(static_cast<double>(i));
  EXPECT_EQ(ints.value(), 500500.0);
  EXPECT_EQ(ExactSum{}.value(), 0.0);
}

TEST(ExactSumTest, NonFiniteTermsStay) {
  ExactSum s;
  s.add(1.0);
  s.add(std::numeric_limits<double>::infinity());
  EXPECT_EQ(s.value(), std::numeric_limits<double>::infinity());
  s.add(std::numeric_limits<double>::quiet_NaN());
  EXPECT_TRUE(std::isnan(s.value()));
  // Beyond the range it is built for: infinity, never a wrapped number.
  ExactSum huge;
  huge.add(std::ldexp(1.0, ExactSum::kHighBit));
  EXPECT_EQ(huge.value(), std::numeric_limits<double>::infinity());
}

TEST(ExactSumTest, LimbsSurviveAnAllReduceOfTheirDoubles) {
  // Four "ranks" with a quarter of the terms each; their doubles added elementwise in two
  // different orders (as two all-reduce algorithms would) give the whole sum.
  const std::vector<double> terms = wide_squares(4000, 4);
  std::vector<std::vector<double>> doubles(4, std::vector<double>(ExactSum::kDoubles));
  for (int r = 0; r < 4; ++r) {
    ExactSum part;
    for (std::size_t i = static_cast<std::size_t>(r); i < terms.size(); i += 4) part.add(terms[i]);
    part.to_doubles(doubles[static_cast<std::size_t>(r)].data());
  }
  std::vector<double> ring(ExactSum::kDoubles, 0.0), tree(ExactSum::kDoubles, 0.0);
  for (int i = 0; i < ExactSum::kDoubles; ++i) {
    const auto k = static_cast<std::size_t>(i);
    ring[k] = ((doubles[2][k] + doubles[3][k]) + doubles[0][k]) + doubles[1][k];
    tree[k] = (doubles[0][k] + doubles[1][k]) + (doubles[2][k] + doubles[3][k]);
  }
  const ExactSum whole = sum_of(terms);
  EXPECT_TRUE(ExactSum::from_doubles(ring.data()) == whole);
  EXPECT_TRUE(ExactSum::from_doubles(tree.data()) == whole);
}

}  // namespace
}  // namespace strata
