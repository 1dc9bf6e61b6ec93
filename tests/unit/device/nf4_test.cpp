// NF4 with double quantization (strata/device/nf4.h) against tools/golden/nf4_golden.py, written
// from the QLoRA paper: the 256 block-max codes, the packed bytes, the decoded block maxima and
// the decoded weights, bit for bit; every SIMD path of the CPU kernel and the CPU op give the
// reference's bits; the size is 4 bits a weight plus the scales; non-finite weights are refused.
#include "strata/device/nf4.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "src/device/cpu/cpu_kernels.h"
#include "strata/core/dtype.h"
#include "strata/core/json.h"
#include "strata/core/rng.h"
#include "strata/device/device.h"
#include "strata/sys/cpu_features.h"
#include "tests/unit/device/ops_test_util.h"

namespace strata::device {
namespace {

std::vector<std::uint8_t> from_hex(const std::string& hex) {
  std::vector<std::uint8_t> out(hex.size() / 2);
  for (std::size_t i = 0; i < out.size(); ++i) {
    out[i] = static_cast<std::uint8_t>(std::stoul(hex.substr(2 * i, 2), nullptr, 16));
  }
  return out;
}

// Big-endian words of `bytes` each: "%08x" of f32 bits, "%04x" of bf16 bits.
std::vector<std::uint32_t> words(const std::string& hex, std::size_t chars) {
  std::vector<std::uint32_t> out(hex.size() / chars);
  for (std::size_t i = 0; i < out.size(); ++i) {
    out[i] = static_cast<std::uint32_t>(std::stoul(hex.substr(chars * i, chars), nullptr, 16));
  }
  return out;
}

// The golden's inputs: u = (top 24 bits of splitmix64_at(seed, i) - 2^23) / 2^23,
// x = 0.05 * u^3 in float32; every 997th element 0.75; elements 64..127 zero.
std::vector<float> inputs(std::int64_t n, std::uint64_t seed) {
  std::vector<float> x(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) {
    const auto top =
        static_cast<std::int64_t>(splitmix64_at(seed, static_cast<std::uint64_t>(i)) >> 40) -
        (std::int64_t{1} << 23);
    const auto u = static_cast<float>(static_cast<double>(top) / static_cast<double>(1 << 23));
    x[static_cast<std::size_t>(i)] = ((u * u) * u) * 0.05f;
    if (i % 997 == 0) x[static_cast<std::size_t>(i)] = 0.75f;
    if (i >= 64 && i < 128) x[static_cast<std::size_t>(i)] = 0.0f;
  }
  return x;
}

Json golden() {
  auto g = read_json_file(std::string(STRATA_TEST_DATA_DIR) + "/nf4/nf4.json");
  STRATA_CHECK(g.is_ok(), g.status().to_string());
  return *g;
}

TEST(Nf4Test, AbsmaxCodeIsTheDynamicMap) {
  const auto want = words(golden().at("absmax_code").get<std::string>(), 8);
  const auto& code = nf4_absmax_code();
  ASSERT_EQ(want.size(), code.size());
  for (std::size_t j = 0; j < code.size(); ++j) {
    EXPECT_EQ(std::bit_cast<std::uint32_t>(code[j]), want[j]) << j;
  }
  EXPECT_EQ(code.back(), 1.0f);
  for (std::size_t j = 0; j + 1 < code.size(); ++j) EXPECT_LT(code[j], code[j + 1]) << j;
}

TEST(Nf4Test, QuantizeAndDequantizeMatchThePaperBitForBit) {
  const Json g = golden();
  for (const auto& [name, c] : g.at("cases").items()) {
    SCOPED_TRACE(name);
    const std::int64_t n = c.at("n").get<std::int64_t>();
    const std::vector<float> x = inputs(n, c.at("seed").get<std::uint64_t>());
    const Nf4Layout l = nf4_layout(n);
    std::vector<std::uint8_t> packed(l.total_bytes, 0xAB);
    ASSERT_TRUE(nf4_quantize(x.data(), n, packed.data(), name.c_str()).is_ok());
    const auto want_packed = from_hex(c.at("packed").get<std::string>());
    ASSERT_EQ(packed.size(), want_packed.size());
    for (std::size_t i = 0; i < packed.size(); ++i) ASSERT_EQ(packed[i], want_packed[i]) << i;

    std::vector<float> block_max(static_cast<std::size_t>(l.blocks));
    nf4_block_absmax(packed.data(), n, 0, l.blocks, block_max.data());
    const auto want_max = words(c.at("block_max").get<std::string>(), 8);
    for (std::int64_t b = 0; b < l.blocks; ++b) {
      ASSERT_EQ(std::bit_cast<std::uint32_t>(block_max[static_cast<std::size_t>(b)]),
                want_max[static_cast<std::size_t>(b)])
          << b;
    }

    std::vector<float> ref(static_cast<std::size_t>(n));
    nf4_dequantize_reference(packed.data(), n, ref.data());
    const auto want_bf16 = words(c.at("bf16").get<std::string>(), 4);
    for (std::int64_t i = 0; i < n; ++i) {
      ASSERT_EQ(f32_to_bf16(ref[static_cast<std::size_t>(i)]).bits,
                want_bf16[static_cast<std::size_t>(i)])
          << i;
    }
    if (c.contains("f32")) {
      const auto want_f32 = words(c.at("f32").get<std::string>(), 8);
      for (std::int64_t i = 0; i < n; ++i) {
        ASSERT_EQ(std::bit_cast<std::uint32_t>(ref[static_cast<std::size_t>(i)]),
                  want_f32[static_cast<std::size_t>(i)])
            << i;
      }
    }
    // Each element is within half the widest gap between levels (0.3038 / 2) of its block's
    // true maximum, which the stored maximum misses by at most half the widest step of the
    // 8-bit map (0.9 / 128 below 1) times its group's scale, plus the f32 roundings.
    for (std::int64_t i = 0; i < n; ++i) {
      float scale = 0;
      std::memcpy(&scale, packed.data() + l.scales + static_cast<std::size_t>(i / 64 / 256) * 4,
                  sizeof scale);
      const double e = (0.9 / 128) * scale * (1 + 1e-6) + 1e-7;
      const double a = std::fabs(block_max[static_cast<std::size_t>(i / 64)]);
      EXPECT_LE(std::fabs(ref[static_cast<std::size_t>(i)] - x[static_cast<std::size_t>(i)]),
                (0.3038 / 2 + 1e-6) * (a + e) + e)
          << i;
    }
  }
}

TEST(Nf4Test, CpuKernelsAndTheOpGiveTheReferenceBits) {
  const std::int64_t n = 3 * 16384 + 64 * 7 + 13;  // several groups, a partial block, odd
  std::vector<float> x = inputs(n, 99);
  std::vector<std::uint8_t> packed(nf4_bytes(n));
  ASSERT_TRUE(nf4_quantize(x.data(), n, packed.data(), "x").is_ok());
  std::vector<float> ref(static_cast<std::size_t>(n));
  nf4_dequantize_reference(packed.data(), n, ref.data());
  const Nf4Layout l = nf4_layout(n);
  std::vector<float> absmax(static_cast<std::size_t>(l.blocks));
  nf4_block_absmax(packed.data(), n, 0, l.blocks, absmax.data());
  for (sys::SimdPath path :
       {sys::SimdPath::kScalar, sys::SimdPath::kAvx2, sys::SimdPath::kAvx512}) {
    if (!sys::cpu_supports(path)) continue;
    SCOPED_TRACE(std::string(sys::simd_path_name(path)));
    const cpu::CpuKernels& k = cpu::cpu_kernels_for(path);
    std::vector<float> f(static_cast<std::size_t>(n), std::numeric_limits<float>::quiet_NaN());
    k.nf4_decode[cpu::kKernelF32](packed.data() + l.codes, absmax.data(), kNf4Levels.data(),
                                  f.data(), n);
    EXPECT_EQ(std::memcmp(f.data(), ref.data(), f.size() * sizeof(float)), 0);
    std::vector<std::uint16_t> h(static_cast<std::size_t>(n), 0xFFFF);
    k.nf4_decode[cpu::kKernelBF16](packed.data() + l.codes, absmax.data(), kNf4Levels.data(),
                                   h.data(), n);
    for (std::int64_t i = 0; i < n; ++i) {
      ASSERT_EQ(h[static_cast<std::size_t>(i)], f32_to_bf16(ref[static_cast<std::size_t>(i)]).bits)
          << i;
    }
  }
  auto dev = testing::make_device(2);
  for (DType dt : {DType::kF32, DType::kBF16}) {
    testing::HostTensor out(dt, n), want(dt, n);
    out.poison();
    convert(ref.data(), DType::kF32, want.data(), dt, static_cast<std::size_t>(n));
    dev->ops().dequantize_nf4(packed.data(), n, out.data(), dt);
    EXPECT_TRUE(out.bitwise_equal(want)) << dtype_name(dt);
  }
}

TEST(Nf4Test, TakesFourBitsAWeightPlusTheScales) {
  for (std::int64_t n : {std::int64_t{4096} * 4096, std::int64_t{14336} * 4096}) {
    const double per = static_cast<double>(nf4_bytes(n)) / static_cast<double>(n);
    EXPECT_LT(per, 0.5 + 1.0 / 64 + 4.0 / (64 * 256) + 1e-6) << n;
    EXPECT_GT(per, 0.5 + 1.0 / 64) << n;
  }
  const Nf4Layout l = nf4_layout(129);
  EXPECT_EQ(l.blocks, 3);
  EXPECT_EQ(l.groups, 1);
  EXPECT_EQ(l.absmax, 80u);  // 65 code bytes, to 16
  EXPECT_EQ(l.scales, 96u);
  EXPECT_EQ(l.mean, 100u);
  EXPECT_EQ(l.total_bytes, 112u);
}

TEST(Nf4Test, RefusesWeightsThatAreNotFinite) {
  std::vector<float> x(300, 0.5f);
  x[201] = std::numeric_limits<float>::infinity();
  std::vector<std::uint8_t> packed(nf4_bytes(300));
  const Status s = nf4_quantize(x.data(), 300, packed.data(), "model.layers.0.mlp.up_proj.weight");
  ASSERT_FALSE(s.is_ok());
  EXPECT_NE(s.message().find("model.layers.0.mlp.up_proj.weight: element 201 is inf"),
            std::string::npos)
      << s.message();
  x[201] = 0.5f;
  x[7] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_NE(nf4_quantize(x.data(), 300, packed.data(), "w").message().find("element 7"),
            std::string::npos);
}

}  // namespace
}  // namespace strata::device
