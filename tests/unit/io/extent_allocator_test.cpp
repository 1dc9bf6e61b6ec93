// Extent allocator and stripe layout: first fit, coalescing, growth, RAID-0 mapping.
#include "src/io/extent_allocator.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "src/io/stripe_layout.h"
#include "strata/core/rng.h"

namespace strata::io {
namespace {

constexpr std::uint64_t kA = kIoAlignBytes;

TEST(ExtentAllocatorTest, RoundsUpAndFailsWithoutCapacity) {
  ExtentAllocator a;
  EXPECT_FALSE(a.allocate(1).has_value());
  EXPECT_EQ(a.growth_needed(1), kA);
  a.grow(10 * kA);
  auto e = a.allocate(1);
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(e->offset, 0u);
  EXPECT_EQ(e->size_bytes, kA);
  EXPECT_EQ(a.used_bytes(), kA);
  EXPECT_FALSE(a.allocate(0).has_value());
}

TEST(ExtentAllocatorTest, FirstFitAndCoalescing) {
  ExtentAllocator a;
  a.grow(100 * kA);
  std::vector<Extent> e;
  for (int i = 0; i < 5; ++i) e.push_back(*a.allocate(10 * kA));
  EXPECT_EQ(e[4].offset, 40 * kA);
  // Free 1 and 3: two holes of 10 blocks; a 5-block request takes the first (lowest) hole.
  a.free(e[1]);
  a.free(e[3]);
  auto small = a.allocate(5 * kA);
  EXPECT_EQ(small->offset, 10 * kA);
  // Freeing 2 merges it with the rest of hole 1 and hole 3 into one 25-block extent.
  a.free(e[2]);
  EXPECT_EQ(a.num_free_extents(), 2u);  // [15,40) and [50,100)
  auto big = a.allocate(25 * kA);
  EXPECT_EQ(big->offset, 15 * kA);
  a.free(*big);
  a.free(*small);
  a.free(e[0]);
  a.free(e[4]);
  EXPECT_EQ(a.num_free_extents(), 1u);
  EXPECT_EQ(a.largest_free(), 100 * kA);
  EXPECT_EQ(a.used_bytes(), 0u);
}

TEST(ExtentAllocatorTest, GrowthExtendsTheFreeTail) {
  ExtentAllocator a;
  a.grow(10 * kA);
  auto first = a.allocate(4 * kA);
  // 6 blocks free at the end: a 10-block request needs only 4 more.
  EXPECT_EQ(a.growth_needed(10 * kA), 4 * kA);
  a.grow(14 * kA);
  EXPECT_EQ(a.num_free_extents(), 1u);
  auto second = a.allocate(10 * kA);
  ASSERT_TRUE(second.has_value());
  EXPECT_EQ(second->offset, 4 * kA);
  // No free tail: the whole request must be added.
  EXPECT_EQ(a.growth_needed(3 * kA), 3 * kA);
  a.free(*first);
  EXPECT_EQ(a.growth_needed(3 * kA), 0u);
}

TEST(ExtentAllocatorTest, IsAllocatedCoversSubranges) {
  ExtentAllocator a;
  a.grow(10 * kA);
  auto e = *a.allocate(4 * kA);
  EXPECT_TRUE(a.is_allocated(e.offset, e.size_bytes));
  EXPECT_TRUE(a.is_allocated(e.offset + kA, kA));
  EXPECT_FALSE(a.is_allocated(e.offset, 5 * kA));
  EXPECT_FALSE(a.is_allocated(5 * kA, kA));
  a.free(e);
  EXPECT_FALSE(a.is_allocated(e.offset, e.size_bytes));
}

TEST(ExtentAllocatorDeathTest, DoubleFreeIsABug) {
  ExtentAllocator a;
  a.grow(4 * kA);
  auto e = *a.allocate(kA);
  a.free(e);
  EXPECT_DEATH(a.free(e), "double free");
}

// Random allocate/free churn: extents never overlap and freeing all restores one free extent.
TEST(ExtentAllocatorTest, RandomChurnKeepsInvariants) {
  Rng rng(7);
  ExtentAllocator a;
  std::vector<Extent> live;
  for (int step = 0; step < 3000; ++step) {
    if (live.empty() || rng.uniform() < 0.55) {
      const std::uint64_t size = 1 + rng.uniform_int(64 * kA);
      auto e = a.allocate(size);
      if (!e) {
        a.grow(a.capacity() + a.growth_needed(size));
        e = a.allocate(size);
      }
      ASSERT_TRUE(e.has_value());
      live.push_back(*e);
    } else {
      const std::size_t i = rng.uniform_int(live.size());
      a.free(live[i]);
      live[i] = live.back();
      live.pop_back();
    }
  }
  std::sort(live.begin(), live.end(),
            [](const Extent& x, const Extent& y) { return x.offset < y.offset; });
  std::uint64_t used = 0;
  for (std::size_t i = 0; i < live.size(); ++i) {
    used += live[i].size_bytes;
    EXPECT_EQ(live[i].offset % kA, 0u);
    if (i > 0) {
      EXPECT_LE(live[i - 1].offset + live[i - 1].size_bytes, live[i].offset);
    }
  }
  EXPECT_EQ(a.used_bytes(), used);
  for (const Extent& e : live) a.free(e);
  EXPECT_EQ(a.num_free_extents(), 1u);
  EXPECT_EQ(a.largest_free(), a.capacity());
}

TEST(StripeLayoutTest, MapsUnitsRoundRobin) {
  const std::uint64_t unit = 16 * kA;
  StripeLayout one(1, unit);
  auto p = one.locate(5 * unit + kA);
  EXPECT_EQ(p.file, 0);
  EXPECT_EQ(p.file_offset, 5 * unit + kA);

  StripeLayout three(3, unit);
  EXPECT_EQ(three.row_bytes(), 3 * unit);
  p = three.locate(7 * unit + 2 * kA);  // unit 7 -> file 1, row 2
  EXPECT_EQ(p.file, 1);
  EXPECT_EQ(p.file_offset, 2 * unit + 2 * kA);
  EXPECT_EQ(p.size_bytes, unit - 2 * kA);

  std::vector<StripeLayout::Piece> pieces;
  three.split(unit - kA, unit + 2 * kA, pieces);  // tail of unit 0, unit 1, head of unit 2
  ASSERT_EQ(pieces.size(), 3u);
  EXPECT_EQ(pieces[0].file, 0);
  EXPECT_EQ(pieces[0].size_bytes, kA);
  EXPECT_EQ(pieces[1].file, 1);
  EXPECT_EQ(pieces[1].file_offset, 0u);
  EXPECT_EQ(pieces[1].size_bytes, unit);
  EXPECT_EQ(pieces[2].file, 2);
  EXPECT_EQ(pieces[2].size_bytes, kA);
  EXPECT_EQ(pieces[2].swap_offset, 2 * unit);
  EXPECT_EQ(three.round_up_to_rows(1), 3 * unit);
  EXPECT_EQ(three.file_bytes(6 * unit), 2 * unit);
}

}  // namespace
}  // namespace strata::io
