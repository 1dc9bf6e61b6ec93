// The CUDA device's arena allocator (pure bookkeeping, so it runs without a GPU): first fit,
// 256-byte rounding, coalescing, and exhaustion without overrun.
#include "strata/build_config.h"
#if STRATA_HAVE_CUDA

#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "src/device/cuda/cuda_arena.h"
#include "strata/core/rng.h"

namespace strata::device::cuda {
namespace {

TEST(CudaArenaTest, RoundsToAlignmentAndFillsExactly) {
  ArenaAllocator a(4096 + 100);  // capacity rounds down to 4096
  EXPECT_EQ(a.capacity(), 4096u);
  auto x = a.allocate(1);
  auto y = a.allocate(257);
  ASSERT_TRUE(x && y);
  EXPECT_EQ(*x, 0u);
  EXPECT_EQ(*y, 256u);
  EXPECT_EQ(a.free_bytes(), 4096u - 256 - 512);
  auto z = a.allocate(4096 - 768);
  ASSERT_TRUE(z);
  EXPECT_EQ(a.free_bytes(), 0u);
  EXPECT_FALSE(a.allocate(1));  // full: an error, never an overlap
}

TEST(CudaArenaTest, FirstFitReusesTheLowestHole) {
  ArenaAllocator a(16 * 256);
  std::vector<std::size_t> offs;
  for (int i = 0; i < 8; ++i) offs.push_back(*a.allocate(2 * 256));
  a.free(offs[1]);
  a.free(offs[5]);
  EXPECT_EQ(*a.allocate(256), offs[1]);
  EXPECT_EQ(*a.allocate(2 * 256), offs[5]);  // does not fit the rest of hole 1
}

TEST(CudaArenaTest, CoalescesBothNeighbours) {
  ArenaAllocator a(3 * 256);
  const auto x = *a.allocate(256), y = *a.allocate(256), z = *a.allocate(256);
  a.free(x);
  a.free(z);
  EXPECT_EQ(a.num_free_blocks(), 2u);
  EXPECT_FALSE(a.allocate(2 * 256));  // fragmented
  a.free(y);
  EXPECT_EQ(a.num_free_blocks(), 1u);
  EXPECT_EQ(a.largest_free_block(), 3u * 256);
  EXPECT_EQ(*a.allocate(3 * 256), 0u);
}

// Random allocate/free against a model of the arena: blocks never overlap, stay inside it,
// and freeing everything gives back one block of the whole capacity.
TEST(CudaArenaTest, RandomChurnKeepsBlocksDisjoint) {
  constexpr std::size_t kCap = 1 << 20;
  ArenaAllocator a(kCap);
  Rng rng(41);
  struct Block {
    std::size_t off, size;
  };
  std::vector<Block> live;
  for (int step = 0; step < 20000; ++step) {
    if (!live.empty() && rng.uniform() < 0.45) {
      const std::size_t i = rng.uniform_int(live.size());
      a.free(live[i].off);
      live[i] = live.back();
      live.pop_back();
      continue;
    }
    const std::size_t size = 1 + rng.uniform_int(20000);
    auto off = a.allocate(size);
    if (!off) continue;
    ASSERT_EQ(*off % ArenaAllocator::kAlignBytes, 0u);
    ASSERT_LE(*off + ArenaAllocator::round(size), kCap);
    live.push_back({*off, ArenaAllocator::round(size)});
  }
  std::sort(live.begin(), live.end(), [](const Block& x, const Block& y) { return x.off < y.off; });
  std::size_t used = 0;
  for (std::size_t i = 0; i < live.size(); ++i) {
    used += live[i].size;
    if (i > 0) {
      ASSERT_LE(live[i - 1].off + live[i - 1].size, live[i].off);
    }
  }
  EXPECT_EQ(a.free_bytes(), kCap - used);
  for (const Block& b : live) a.free(b.off);
  EXPECT_EQ(a.num_free_blocks(), 1u);
  EXPECT_EQ(a.largest_free_block(), kCap);
}

}  // namespace
}  // namespace strata::device::cuda

#endif  // STRATA_HAVE_CUDA
