// AccessTrace: positions, next use and byte distances.
#include "strata/sched/access_trace.h"

#include <gtest/gtest.h>

namespace strata::sched {
namespace {

mem::Handle H(std::uint32_t i) { return static_cast<mem::Handle>(i); }

TEST(AccessTrace, NextUseAndBytesBetween) {
  AccessTrace t;
  // Forward 0 1 2, backward 2 1 0; sizes 10, 20, 30.
  const std::uint64_t size[] = {10, 20, 30};
  for (std::uint32_t i : {0u, 1u, 2u, 2u, 1u, 0u}) t.push(H(i), size[i]);
  ASSERT_EQ(t.size(), 6u);
  EXPECT_EQ(t.distinct(), (std::vector<mem::Handle>{H(0), H(1), H(2)}));
  EXPECT_EQ(t.next_use(H(2), 0), 2u);
  EXPECT_EQ(t.next_use(H(2), 3), 3u);
  EXPECT_EQ(t.next_use(H(2), 4), AccessTrace::kNone);
  EXPECT_EQ(t.next_use(H(7), 0), AccessTrace::kNone);
  EXPECT_EQ(t.bytes_between(2, 4), 60u);
  EXPECT_EQ(t.bytes_between(0, 6), 120u);
  EXPECT_EQ(t.bytes_at(4), 20u);
  AccessTrace u = t;
  EXPECT_TRUE(u.same_order(t));
  u.push(H(1), 20);
  EXPECT_FALSE(u.same_order(t));
  u.clear();
  EXPECT_TRUE(u.empty());
  EXPECT_EQ(u.next_use(H(0), 0), AccessTrace::kNone);
}

}  // namespace
}  // namespace strata::sched
