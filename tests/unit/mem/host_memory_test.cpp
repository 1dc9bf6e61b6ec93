// Pinned host memory: the staging pool hands out each buffer once, and the size-class cache
// reuses blocks exactly, so a repeating pattern allocates only in its first round.
#include "strata/mem/host_memory.h"

#include <gtest/gtest.h>

#include <cstring>
#include <set>

#include "tests/unit/mem/store_test_util.h"

namespace strata::mem {
namespace {

TEST(StagingPool, EveryBufferOnceThenNone) {
  auto device = testing::make_cpu_device();
  auto alloc = make_device_host_allocator(*device);
  auto pool = StagingPool::create(*alloc, 8192, 3);
  ASSERT_TRUE(pool.is_ok());
  std::set<int> taken;
  for (int i = 0; i < 3; ++i) taken.insert((*pool)->take());
  EXPECT_EQ(taken, (std::set<int>{0, 1, 2}));
  EXPECT_EQ((*pool)->take(), -1);
  for (int i : taken) {
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>((*pool)->data(i)) % 4096, 0u);
    std::memset((*pool)->data(i), i, 8192);  // writable, no overlap with the others
  }
  for (int i : taken) EXPECT_EQ(static_cast<int>((*pool)->data(i)[8191]), i);
  for (int i : taken) (*pool)->give(i);
  EXPECT_EQ((*pool)->num_free(), 3);
  EXPECT_EQ((*pool)->total_bytes(), 3u * 8192);
}

TEST(StagingPool, RejectsUnalignedBuffers) {
  auto device = testing::make_cpu_device();
  auto alloc = make_device_host_allocator(*device);
  EXPECT_EQ(StagingPool::create(*alloc, 5000, 2).status().code(), StatusCode::kInvalidArgument);
}

TEST(HostBlockCache, RepeatingPatternAllocatesOnlyOnce) {
  auto device = testing::make_cpu_device();
  auto alloc = make_device_host_allocator(*device);
  HostBlockCache cache(*alloc);
  const std::size_t sizes[] = {10000, 123456, 10000, 4096, 123456};
  std::uint64_t held_after_first = 0;
  for (int round = 0; round < 5; ++round) {
    std::vector<std::pair<void*, std::size_t>> blocks;
    for (std::size_t s : sizes) {
      auto b = cache.take(s);
      ASSERT_TRUE(b.is_ok());
      std::memset(*b, 1, s);
      blocks.emplace_back(*b, s);
    }
    if (round == 0) held_after_first = cache.held_bytes();
    EXPECT_EQ(cache.held_bytes(), held_after_first) << "round " << round;
    for (auto [p, s] : blocks) cache.give(p, s);
  }
  EXPECT_EQ(held_after_first, 2u * 12288 + 2u * 126976 + 4096);
  EXPECT_EQ(cache.cached_bytes(), cache.held_bytes());
  EXPECT_EQ(cache.growth_for(10000), 0u);
  EXPECT_EQ(cache.growth_for(20000), 20480u);
  // Trimming never touches the kept class and releases whole blocks.
  const std::uint64_t released = cache.trim(1, HostBlockCache::class_bytes(10000));
  EXPECT_EQ(released, 4096u);  // the smallest other class goes first
  const std::uint64_t rest = cache.held_bytes();
  EXPECT_EQ(cache.trim(std::uint64_t{1} << 30), rest);
  EXPECT_EQ(cache.held_bytes(), 0u);
}

}  // namespace
}  // namespace strata::mem
