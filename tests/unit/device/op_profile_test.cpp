// STRATA_OP_PROFILE=1 times every op of a CPU device created with it, and nothing otherwise.
#include "strata/device/op_profile.h"

#include <gtest/gtest.h>

#include <vector>

#include "strata/device/device.h"
#include "tests/testing/scoped_env.h"

namespace strata::device {
namespace {

const OpTime* find(const std::vector<OpTime>& ops, const std::string& name) {
  for (const OpTime& o : ops) {
    if (o.op == name) return &o;
  }
  return nullptr;
}

TEST(OpProfileTest, ProfiledDeviceTalliesEachOpsCallsBytesAndFlops) {
  reset_op_profile();
  ::strata::testing::ScopedEnv profile("STRATA_OP_PROFILE", "1");
  auto profiled = create_device(DeviceOptions{});
  profile.unset();
  auto plain = create_device(DeviceOptions{});
  ASSERT_TRUE(profiled.is_ok() && plain.is_ok());
  const std::int64_t n = 1000;
  std::vector<float> a(n, 1.0f), b(n, 2.0f), c(n);
  (*profiled)->ops().add(a.data(), b.data(), c.data(), n, DType::kF32);
  (*profiled)->ops().add(a.data(), b.data(), c.data(), n, DType::kF32);
  EXPECT_EQ(c[0], 3.0f);                                              // still the op
  (*plain)->ops().add(a.data(), b.data(), c.data(), n, DType::kF32);  // not tallied
  GemmArgs g;
  g.dtype = DType::kF32;
  g.m = 4;
  g.n = 5;
  g.k = 6;
  g.lda = 6;
  g.ldb = 5;
  g.ldc = 5;
  std::vector<float> ga(24, 1.0f), gb(30, 1.0f), gc(20);
  g.a = ga.data();
  g.b = gb.data();
  g.c = gc.data();
  (*profiled)->ops().gemm(g);
  EXPECT_EQ(gc[0], 6.0f);

  const std::vector<OpTime> ops = op_profile();
  const OpTime* add = find(ops, "add");
  ASSERT_NE(add, nullptr);
  EXPECT_EQ(add->calls, 2u);
  EXPECT_EQ(add->bytes, 2 * 3.0 * n * 4);  // two reads and a write of n floats, twice
  EXPECT_GE(add->seconds, 0.0);
  const OpTime* gemm = find(ops, "gemm");
  ASSERT_NE(gemm, nullptr);
  EXPECT_EQ(gemm->calls, 1u);
  EXPECT_EQ(gemm->flops, 2.0 * 4 * 5 * 6);
  EXPECT_EQ(find(ops, "cast"), nullptr);
  reset_op_profile();
  EXPECT_TRUE(op_profile().empty());
}

}  // namespace
}  // namespace strata::device
