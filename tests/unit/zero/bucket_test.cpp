// Bucket planning for bucketed collectives: coalescing, splitting, and a packed reduce-scatter
// that gives every rank the same shards as one reduce-scatter per group.
#include "strata/zero/bucket.h"

#include <gtest/gtest.h>

#include <cmath>
#include <numeric>
#include <vector>

#include "strata/core/rng.h"

namespace strata::zero {
namespace {

using Groups = std::vector<std::pair<int, std::int64_t>>;

void expect_piece(const BucketPiece& p, int group, std::int64_t begin, std::int64_t count,
                  std::int64_t offset, bool last) {
  EXPECT_EQ(p.group, group);
  EXPECT_EQ(p.begin, begin);
  EXPECT_EQ(p.count, count);
  EXPECT_EQ(p.offset, offset);
  EXPECT_EQ(p.last, last);
}

TEST(BucketCap, BytesToElementsPerRankBlock) {
  EXPECT_EQ(bucket_cap_elems(1000, 4, 1), 250);
  EXPECT_EQ(bucket_cap_elems(1000, 4, 2), 125);
  EXPECT_EQ(bucket_cap_elems(1000, 2, 3), 166);  // rounds down: 3 * 166 * 2 = 996 <= 1000
  EXPECT_EQ(bucket_cap_elems(3, 4, 4), 1);       // never below one element
  EXPECT_EQ(bucket_cap_elems(std::uint64_t{512} << 20, 2, 8), (std::int64_t{512} << 20) / 16);
}

TEST(BucketPlan, SmallGroupsShareOneBucket) {
  const auto b = plan_buckets({{5, 3}, {4, 4}, {3, 1}}, 100);
  ASSERT_EQ(b.size(), 1u);
  EXPECT_EQ(b[0].block_elems, 8);
  ASSERT_EQ(b[0].pieces.size(), 3u);
  expect_piece(b[0].pieces[0], 5, 0, 3, 0, true);
  expect_piece(b[0].pieces[1], 4, 0, 4, 3, true);
  expect_piece(b[0].pieces[2], 3, 0, 1, 7, true);
}

TEST(BucketPlan, GroupThatDoesNotFitClosesTheBucket) {
  const auto b = plan_buckets({{0, 3}, {1, 4}, {2, 5}}, 8);
  ASSERT_EQ(b.size(), 2u);
  EXPECT_EQ(b[0].block_elems, 7);
  ASSERT_EQ(b[0].pieces.size(), 2u);
  EXPECT_EQ(b[1].block_elems, 5);
  ASSERT_EQ(b[1].pieces.size(), 1u);
  expect_piece(b[1].pieces[0], 2, 0, 5, 0, true);  // not split to fill the first bucket
}

TEST(BucketPlan, LargeGroupIsSplitAndItsRemainderOpensTheNextBucket) {
  const auto b = plan_buckets({{0, 5}, {1, 20}, {2, 3}}, 8);
  ASSERT_EQ(b.size(), 4u);
  ASSERT_EQ(b[0].pieces.size(), 1u);
  expect_piece(b[0].pieces[0], 0, 0, 5, 0, true);
  expect_piece(b[1].pieces[0], 1, 0, 8, 0, false);
  expect_piece(b[2].pieces[0], 1, 8, 8, 0, false);
  ASSERT_EQ(b[3].pieces.size(), 2u);
  expect_piece(b[3].pieces[0], 1, 16, 4, 0, true);
  expect_piece(b[3].pieces[1], 2, 0, 3, 4, true);
  EXPECT_EQ(b[3].block_elems, 7);
}

TEST(BucketPacker, HandsOutABucketAsSoonAsItIsFull) {
  BucketPacker p(8);
  EXPECT_TRUE(p.add(0, 4).empty());
  EXPECT_TRUE(p.has_open());
  const auto full = p.add(1, 4);
  ASSERT_EQ(full.size(), 1u);
  EXPECT_EQ(full[0].block_elems, 8);
  EXPECT_FALSE(p.has_open());
  EXPECT_FALSE(p.flush().has_value());
  const auto split = p.add(2, 16);  // exactly two caps: nothing left open
  ASSERT_EQ(split.size(), 2u);
  EXPECT_TRUE(split[1].pieces[0].last);
  EXPECT_FALSE(p.has_open());
}

// Random group sizes and caps: every bucket within the cap, pieces contiguous within a bucket,
// each group covered exactly once in order, and no more buckets than coalescing needs.
TEST(BucketPlan, InvariantsOverRandomGroups) {
  Rng rng(42);
  for (int trial = 0; trial < 200; ++trial) {
    Groups groups;
    const int n = 1 + static_cast<int>(rng.uniform_int(12));
    for (int g = 0; g < n; ++g)
      groups.emplace_back(n - 1 - g, 1 + static_cast<std::int64_t>(rng.uniform_int(300)));
    const std::int64_t cap = 1 + static_cast<std::int64_t>(rng.uniform_int(400));
    const auto buckets = plan_buckets(groups, cap);
    std::vector<std::int64_t> covered(static_cast<std::size_t>(n), 0);
    std::size_t next_group = 0;
    std::int64_t total = 0;
    for (const auto& b : buckets) {
      ASSERT_FALSE(b.pieces.empty());
      ASSERT_LE(b.block_elems, cap);
      std::int64_t offset = 0;
      for (const auto& p : b.pieces) {
        ASSERT_EQ(p.offset, offset);
        ASSERT_GT(p.count, 0);
        ASSERT_LT(next_group, groups.size());
        ASSERT_EQ(p.group, groups[next_group].first);
        auto& c = covered[static_cast<std::size_t>(p.group)];
        ASSERT_EQ(p.begin, c);
        c += p.count;
        ASSERT_EQ(p.last, c == groups[next_group].second);
        if (p.last) ++next_group;
        offset += p.count;
      }
      ASSERT_EQ(offset, b.block_elems);
      total += b.block_elems;
    }
    ASSERT_EQ(next_group, groups.size());
    ASSERT_EQ(total, std::accumulate(groups.begin(), groups.end(), std::int64_t{0},
                                     [](std::int64_t s, const auto& g) { return s + g.second; }));
    ASSERT_GE(static_cast<std::int64_t>(buckets.size()), (total + cap - 1) / cap);
    // Two neighbours could never have been one bucket unless the first was split off a group.
    for (std::size_t i = 1; i < buckets.size(); ++i) {
      if (buckets[i - 1].pieces.back().last && buckets[i].pieces.front().begin == 0 &&
          buckets[i].pieces.size() == 1 && buckets[i].pieces[0].last) {
        ASSERT_GT(buckets[i - 1].block_elems + buckets[i].block_elems, cap);
      }
    }
  }
}

// The rank-block layout: packing every rank's gradients by the plan, summing the packed buckets
// over ranks and handing rank r its block gives each rank exactly the shard sums that one
// reduce-scatter per group would (same elements, same order of the sum over ranks).
TEST(BucketPlan, PackedReduceScatterMatchesOnePerGroup) {
  const int world = 3;
  const Groups groups = {{3, 5}, {2, 17}, {1, 2}, {0, 40}};   // per-rank shard sizes
  std::vector<std::vector<std::vector<float>>> grads(world);  // [rank][group] full gradient
  Rng rng(7);
  for (int r = 0; r < world; ++r) {
    grads[r].resize(groups.size());
    for (const auto& [g, shard] : groups) {
      auto& v = grads[r][static_cast<std::size_t>(g)];
      v.resize(static_cast<std::size_t>(shard * world));
      for (auto& x : v) x = static_cast<float>(rng.normal());
    }
  }
  auto shard_of = [&](int g) {
    for (const auto& [id, s] : groups)
      if (id == g) return s;
    return std::int64_t{0};
  };
  for (std::int64_t cap : {1, 4, 9, 23, 1000}) {
    SCOPED_TRACE("cap " + std::to_string(cap));
    // got[rank][group]: this rank's reduced shard.
    std::vector<std::vector<std::vector<float>>> got(world);
    for (int r = 0; r < world; ++r) {
      got[r].resize(groups.size());
      for (const auto& [g, s] : groups)
        got[r][static_cast<std::size_t>(g)].assign(static_cast<std::size_t>(s), NAN);
    }
    for (const auto& b : plan_buckets(groups, cap)) {
      std::vector<float> sum(static_cast<std::size_t>(b.block_elems * world), 0.0f);
      for (int src = 0; src < world; ++src) {
        for (int blk = 0; blk < world; ++blk) {
          for (const auto& p : b.pieces) {
            for (std::int64_t i = 0; i < p.count; ++i) {
              sum[static_cast<std::size_t>(blk * b.block_elems + p.offset + i)] +=
                  grads[src][static_cast<std::size_t>(p.group)]
                       [static_cast<std::size_t>(blk * shard_of(p.group) + p.begin + i)];
            }
          }
        }
      }
      for (int r = 0; r < world; ++r) {
        for (const auto& p : b.pieces) {
          for (std::int64_t i = 0; i < p.count; ++i) {
            got[r][static_cast<std::size_t>(p.group)][static_cast<std::size_t>(p.begin + i)] =
                sum[static_cast<std::size_t>(r * b.block_elems + p.offset + i)];
          }
        }
      }
    }
    for (int r = 0; r < world; ++r) {
      for (const auto& [g, s] : groups) {
        for (std::int64_t i = 0; i < s; ++i) {
          float want = 0.0f;
          for (int src = 0; src < world; ++src)
            want += grads[src][static_cast<std::size_t>(g)][static_cast<std::size_t>(r * s + i)];
          ASSERT_EQ(got[r][static_cast<std::size_t>(g)][static_cast<std::size_t>(i)], want)
              << "rank " << r << " group " << g << " element " << i;
        }
      }
    }
  }
}

// Buckets take at most 1/16 of a device budget; without one the configured size stands.
TEST(BucketPlan, EffectiveBucketBytesFollowTheDeviceBudget) {
  constexpr std::uint64_t kMiB = std::uint64_t{1} << 20;
  EXPECT_EQ(effective_bucket_bytes(64 * kMiB, 0), 64 * kMiB);
  EXPECT_EQ(effective_bucket_bytes(64 * kMiB, 80ull << 30), 64 * kMiB);
  EXPECT_EQ(effective_bucket_bytes(64 * kMiB, 64 * kMiB), 4 * kMiB);
  EXPECT_EQ(effective_bucket_bytes(3000, 64 * kMiB), 3000u);
  EXPECT_EQ(effective_bucket_bytes(64 * kMiB, 8), 1u);  // never zero
}

}  // namespace
}  // namespace strata::zero
