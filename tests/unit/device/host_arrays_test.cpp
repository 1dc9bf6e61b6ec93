// HostArrays: every SIMD path this CPU has and several thread counts give exactly the bits of the
// scalar references in core/dtype.h (strata::convert, strata::sum_squares_chunk of each chunk,
// the chunks added exactly): conversions over every f16 bit pattern and a sweep of f32 ones, sums
// of squares and gradient accumulation over lengths around the vector width and the chunk size.
#include "strata/device/host_arrays.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "strata/core/dtype.h"
#include "strata/core/rng.h"

namespace strata::device {
namespace {

using sys::SimdPath;

struct Case {
  SimdPath path;
  int threads;
};

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  return std::string(sys::simd_path_name(info.param.path)) + "_" +
         std::to_string(info.param.threads) + "threads";
}

class HostArraysTest : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    if (!sys::cpu_supports(GetParam().path)) {
      GTEST_SKIP() << "this CPU lacks " << sys::simd_path_name(GetParam().path)
                   << " (CPUID), so that path cannot run here";
    }
    HostArrayOptions o;
    o.simd = std::string(sys::simd_path_name(GetParam().path));
    o.threads = GetParam().threads;
    auto a = HostArrays::create(o);
    ASSERT_TRUE(a.is_ok()) << a.status().to_string();
    arrays_.emplace(std::move(*a));
    ASSERT_EQ(arrays_->simd(), GetParam().path);
  }
  std::optional<HostArrays> arrays_;
};

// Random floats of every kind a gradient or a weight can hold: ordinary magnitudes, signed
// zeros, f32 and f16 subnormals, values around the f16 range's ends, huge values, infinities and
// NaNs with payloads.
std::vector<float> hard_floats(std::size_t n, std::uint64_t seed, bool finite_only) {
  Rng rng(seed);
  std::vector<float> v(n);
  for (float& x : v) {
    const double u = rng.uniform();
    if (u < 0.6) {
      x = static_cast<float>(rng.normal() * std::pow(10.0, rng.uniform() * 6.0 - 4.0));
    } else if (u < 0.65) {
      x = u < 0.625 ? 0.0f : -0.0f;
    } else if (u < 0.72) {  // f32 subnormal
      x = std::bit_cast<float>(static_cast<std::uint32_t>(rng.next_u64()) & 0x807fffffu);
    } else if (u < 0.80) {  // around f16's subnormals and smallest normals
      x = static_cast<float>(rng.normal() * 6e-8 * std::pow(2.0, rng.uniform() * 12.0));
    } else if (u < 0.88) {  // around f16's largest finite value and its rounding boundary
      x = static_cast<float>((65504.0 + rng.normal() * 32.0) * (rng.uniform() < 0.5 ? -1 : 1));
    } else if (u < 0.94) {
      x = static_cast<float>(rng.normal() * 1e30);
    } else if (finite_only) {
      x = static_cast<float>(rng.normal());
    } else if (u < 0.97) {
      x = u < 0.955 ? INFINITY : -INFINITY;
    } else {  // NaN with a random payload and sign
      x = std::bit_cast<float>((static_cast<std::uint32_t>(rng.next_u64()) & 0x803fffffu) |
                               0x7fc00000u);
    }
  }
  return v;
}

std::vector<std::byte> as_dtype(const std::vector<float>& f, DType dtype) {
  std::vector<std::byte> out(f.size() * dtype_size(dtype));
  convert(f.data(), DType::kF32, out.data(), dtype, f.size());
  return out;
}

// The definition the kernels must match: sum_squares_chunk per chunk, the chunks' sums added
// exactly.
ExactSum reference_sum_squares(const void* x, DType dtype, std::size_t n) {
  const auto* bytes = static_cast<const std::byte*>(x);
  ExactSum total;
  for (std::size_t i = 0; i < n; i += kSumSquaresChunkElems) {
    const std::size_t m = std::min(kSumSquaresChunkElems, n - i);
    total.add(sum_squares_chunk(bytes + i * dtype_size(dtype), dtype, m));
  }
  return total;
}

constexpr DType kFloatTypes[] = {DType::kF32, DType::kBF16, DType::kF16};
constexpr std::size_t kLengths[] = {0, 1, 7, 8, 9, 31, 513, 4099, 65535, 65536, 65537, 200003};

TEST_P(HostArraysTest, ConversionsMatchTheReferenceBitForBit) {
  std::uint64_t seed = 1;
  for (const std::size_t n : kLengths) {
    const std::vector<float> f = hard_floats(n, ++seed, /*finite_only=*/false);
    for (const DType from : kFloatTypes) {
      const std::vector<std::byte> src = as_dtype(f, from);
      for (const DType to : kFloatTypes) {
        SCOPED_TRACE(std::string(dtype_name(from)) + " -> " + std::string(dtype_name(to)) +
                     ", n=" + std::to_string(n));
        std::vector<std::byte> want(n * dtype_size(to) + 1), got(want.size(), std::byte{0x5a});
        convert(src.data(), from, want.data(), to, n);
        want.back() = std::byte{0x5a};  // the byte past the end stays as it was
        arrays_->convert(src.data(), from, got.data(), to, static_cast<std::int64_t>(n));
        ASSERT_EQ(std::memcmp(got.data(), want.data(), want.size()), 0);
      }
    }
  }
}

TEST_P(HostArraysTest, HalfPrecisionConversionsOverEveryPattern) {
  // Every f16 and bf16 bit pattern widened...
  std::vector<std::uint16_t> halves(65536);
  for (std::size_t i = 0; i < halves.size(); ++i) halves[i] = static_cast<std::uint16_t>(i);
  for (const DType half : {DType::kF16, DType::kBF16}) {
    std::vector<float> want(halves.size()), got(halves.size());
    convert(halves.data(), half, want.data(), DType::kF32, halves.size());
    arrays_->convert(halves.data(), half, got.data(), DType::kF32, 65536);
    ASSERT_EQ(std::memcmp(got.data(), want.data(), got.size() * sizeof(float)), 0)
        << dtype_name(half);
  }
  // ...and f32 patterns narrowed: a stride through all 2^32, plus every pattern around the f16
  // subnormal, normal and overflow thresholds.
  std::vector<std::uint32_t> bits;
  for (std::uint64_t u = 0; u < (std::uint64_t{1} << 32); u += 65521) {
    bits.push_back(static_cast<std::uint32_t>(u));
  }
  for (const std::uint32_t edge : {0x33000000u, 0x387fc000u, 0x38800000u, 0x477fe000u, 0x477ff000u,
                                   0x7f800000u, 0x7f7fffffu}) {
    for (std::uint32_t d = 0; d < 8192; ++d) {
      bits.push_back(edge - 4096 + d);
      bits.push_back((edge - 4096 + d) | 0x80000000u);
    }
  }
  for (const DType half : {DType::kF16, DType::kBF16}) {
    std::vector<std::uint16_t> want(bits.size()), got(bits.size());
    convert(bits.data(), DType::kF32, want.data(), half, bits.size());
    arrays_->convert(bits.data(), DType::kF32, got.data(), half,
                     static_cast<std::int64_t>(bits.size()));
    for (std::size_t i = 0; i < bits.size(); ++i) {
      ASSERT_EQ(got[i], want[i]) << dtype_name(half) << " of f32 bits 0x" << std::hex << bits[i];
    }
  }
}

TEST_P(HostArraysTest, SumsOfSquaresMatchTheReferenceBitForBit) {
  std::uint64_t seed = 100;
  for (const std::size_t n : kLengths) {
    const std::vector<float> f = hard_floats(n, ++seed, /*finite_only=*/true);
    for (const DType dtype : kFloatTypes) {
      const std::vector<std::byte> x = as_dtype(f, dtype);
      const ExactSum want = reference_sum_squares(x.data(), dtype, n);
      const ExactSum got = arrays_->sum_squares(x.data(), dtype, static_cast<std::int64_t>(n));
      ASSERT_TRUE(got == want) << dtype_name(dtype) << " n=" << n << ": " << got.value() << " vs "
                               << want.value();
    }
  }
}

// acc = acc + widen(grad) (fresh: 0 + widen(grad)) element by element, and the returned sum of
// squares is the reference's over the result's first `counted` elements (all, or cut inside a
// chunk, as a tensor-parallel group's duplicates are left out).
TEST_P(HostArraysTest, AccumulationMatchesTheReferenceBitForBit) {
  std::uint64_t seed = 200;
  for (const std::size_t n : kLengths) {
    for (const DType dtype : kFloatTypes) {
      for (const bool fresh : {true, false}) {
        SCOPED_TRACE(std::string(dtype_name(dtype)) + " n=" + std::to_string(n) +
                     (fresh ? " fresh" : " into earlier sums"));
        const std::vector<std::byte> grad =
            as_dtype(hard_floats(n, ++seed, /*finite_only=*/true), dtype);
        std::vector<float> want = hard_floats(n, ++seed, /*finite_only=*/true);
        std::vector<float> got = want;
        std::vector<float> wide(n);
        convert(grad.data(), dtype, wide.data(), DType::kF32, n);
        for (std::size_t i = 0; i < n; ++i) want[i] = (fresh ? 0.0f : want[i]) + wide[i];
        const std::size_t counted = fresh ? n : n * 2 / 3;
        const ExactSum sum =
            arrays_->accumulate(got.data(), grad.data(), dtype, static_cast<std::int64_t>(n), fresh,
                                static_cast<std::int64_t>(counted));
        ASSERT_EQ(std::memcmp(got.data(), want.data(), n * sizeof(float)), 0);
        ASSERT_TRUE(sum == reference_sum_squares(want.data(), DType::kF32, counted));
      }
    }
  }
}

// A fresh accumulator turns -0 into +0, as adding into zeros does.
TEST_P(HostArraysTest, FreshAccumulatorHasNoNegativeZeros) {
  std::vector<float> grad(1000, -0.0f), acc(1000, 7.0f);
  EXPECT_EQ(arrays_->accumulate(acc.data(), grad.data(), DType::kF32, 1000, true, 1000).value(),
            0.0);
  for (const float a : acc) ASSERT_EQ(std::bit_cast<std::uint32_t>(a), 0u);
}

INSTANTIATE_TEST_SUITE_P(Paths, HostArraysTest,
                         ::testing::Values(Case{SimdPath::kScalar, 1}, Case{SimdPath::kAvx2, 1},
                                           Case{SimdPath::kAvx2, 3}, Case{SimdPath::kAvx512, 1},
                                           Case{SimdPath::kAvx512, 3}),
                         case_name);

TEST(HostArrays, SumOfSquaresIsCloseToTheExactValue) {
  // The lanes change the order of the sum, not its accuracy: within n ulps of the exact sum.
  const std::size_t n = 300000;
  const std::vector<float> f = hard_floats(n, 9, /*finite_only=*/true);
  long double exact = 0;
  for (const float x : f) exact += static_cast<long double>(x) * x;
  const double got = reference_sum_squares(f.data(), DType::kF32, n).value();
  EXPECT_LE(std::fabs(static_cast<long double>(got) - exact),
            exact * static_cast<long double>(n) * 0x1p-53L);
}

TEST(HostArrays, RejectsAnUnknownPath) {
  HostArrayOptions o;
  o.simd = "sse9";
  const auto a = HostArrays::create(o);
  ASSERT_FALSE(a.is_ok());
  EXPECT_NE(a.status().message().find("sse9"), std::string::npos) << a.status().message();
}

}  // namespace
}  // namespace strata::device
