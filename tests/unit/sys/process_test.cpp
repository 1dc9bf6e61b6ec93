// Process memory and topology readings track reality.
#include "strata/sys/process.h"

#include <gtest/gtest.h>
#include <sched.h>

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
  EXPECT_GE(t.machine_cores, t.cores);
}

// Bound to one CPU (as mpirun --bind-to core does), the process counts one core; the thread
// counts that default to "all cores" follow, so TBB is never asked for workers it cannot have.
TEST(ProcessTest, TopologyCountsTheCoresTheProcessIsBoundTo) {
  cpu_set_t old_set;
  ASSERT_EQ(sched_getaffinity(0, sizeof(old_set), &old_set), 0);
  int first = -1;
  for (int c = 0; c < CPU_SETSIZE && first < 0; ++c) {
    if (CPU_ISSET(c, &old_set)) first = c;
  }
  ASSERT_GE(first, 0);
  const CpuTopology whole = cpu_topology();
  // Bind this thread (threads it starts would inherit the binding), then restore.
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(first, &one);
  ASSERT_EQ(sched_setaffinity(0, sizeof(one), &one), 0);
  const CpuTopology bound = cpu_topology();
  ASSERT_EQ(sched_setaffinity(0, sizeof(old_set), &old_set), 0);
  EXPECT_EQ(bound.cores, 1);
  EXPECT_EQ(bound.pus, 1);
  EXPECT_EQ(bound.machine_cores, whole.machine_cores);
}

}  // namespace
}  // namespace strata::sys
