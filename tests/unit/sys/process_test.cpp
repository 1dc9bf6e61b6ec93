// Process memory and topology readings track reality.
#include "strata/sys/process.h"

#include <gtest/gtest.h>

#include <cstring>
#include <memory>

namespace strata::sys {
namespace {

TEST(ProcessTest, PeakRssGrowsWhenMemoryIsTouched) {
  auto before = read_process_memory();
  ASSERT_TRUE(before.is_ok());
  EXPECT_GT(before->rss_bytes, 0u);
  EXPECT_GE(before->peak_rss_bytes, before->rss_bytes);
  const std::size_t bytes = 64 << 20;
  auto block = std::make_unique<char[]>(bytes);
  std::memset(block.get(), 1, bytes);
  auto after = read_process_memory();
  ASSERT_TRUE(after.is_ok());
  EXPECT_GE(after->peak_rss_bytes, before->peak_rss_bytes + bytes / 2);
  EXPECT_EQ(block[bytes - 1], 1);
}

TEST(ProcessTest, TopologyIsConsistent) {
  const CpuTopology t = cpu_topology();
  EXPECT_GE(t.cores, 1);
  EXPECT_GE(t.pus, t.cores);
  EXPECT_GE(t.numa_nodes, 1);
}

}  // namespace
}  // namespace strata::sys
