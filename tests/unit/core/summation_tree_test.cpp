// SummationTree: the canonical tree's sum of M micro-batches has the same bits whether one rank
// sums all M or D ranks (D a power of two dividing M) each fold their D-leaf subtrees per step
// and sum their M / D steps, zero leaves (missing gradients) included; the running sum it
// replaces is a left fold in one buffer; the buffers it needs are the binary counter's.
#include "strata/core/summation_tree.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <optional>
#include <vector>

#include "strata/core/rng.h"

namespace strata {
namespace {

using Leaf = std::optional<float>;  // nullopt: the micro-batch brought no gradient

// Runs the tree's ops on scalar "buffers": the sum of `leaves` in the tree's order.
Leaf run(const std::vector<Leaf>& leaves, bool canonical) {
  SummationTree tree(static_cast<std::int64_t>(leaves.size()), canonical);
  std::vector<float> buf(static_cast<std::size_t>(
      SummationTree::buffers_needed(static_cast<std::int64_t>(leaves.size()), canonical)));
  const auto apply = [&](const std::vector<SummationTree::Op>& ops, float x) {
    for (const SummationTree::Op& op : ops) {
      float& into = buf.at(static_cast<std::size_t>(op.into));
      switch (op.kind) {
        case SummationTree::Op::Kind::kStore:
          into = 0.0f + x;
          break;
        case SummationTree::Op::Kind::kAdd:
          into = into + x;
          break;
        case SummationTree::Op::Kind::kMerge:
          into = into + buf.at(static_cast<std::size_t>(op.from));
          break;
      }
    }
  };
  for (std::size_t i = 0; i < leaves.size(); ++i) {
    if (leaves[i]) apply(tree.arrive(static_cast<std::int64_t>(i)), *leaves[i]);
  }
  apply(tree.finish(), 0.0f);
  if (tree.result() < 0) return std::nullopt;
  return buf[static_cast<std::size_t>(tree.result())];
}

// The definition, written directly: blocks by the binary digits of n, largest first, each a
// perfect tree, their sums left to right; zero leaves add nothing.
Leaf perfect(const std::vector<Leaf>& x, std::size_t begin, std::size_t size) {
  if (size == 1) return x[begin] ? Leaf(0.0f + *x[begin]) : std::nullopt;
  const Leaf a = perfect(x, begin, size / 2), b = perfect(x, begin + size / 2, size / 2);
  if (!a) return b;
  if (!b) return a;
  return *a + *b;
}
Leaf definition(const std::vector<Leaf>& x) {
  Leaf sum;
  std::size_t begin = 0;
  for (int level = 62; level >= 0; --level) {
    const std::size_t size = std::size_t{1} << level;
    if ((x.size() & size) == 0) continue;
    const Leaf block = perfect(x, begin, size);
    begin += size;
    if (!block) continue;
    sum = sum ? Leaf(*sum + *block) : block;
  }
  return sum;
}

std::vector<Leaf> random_leaves(std::size_t n, Rng& rng, double zeros) {
  std::vector<Leaf> x(n);
  for (Leaf& v : x) {
    if (rng.uniform() < zeros) continue;
    // Wide exponents and both signs: additions round, and their order shows in the bits.
    v = static_cast<float>(std::ldexp(rng.uniform() - 0.5, static_cast<int>(rng.next_u64() % 30)));
  }
  return x;
}

std::uint32_t bits(Leaf x) { return x ? std::bit_cast<std::uint32_t>(*x) : 0xffffffffu; }

TEST(SummationTreeTest, ItsOpsSumAsTheDefinitionSays) {
  Rng rng(1);
  for (std::size_t n = 1; n <= 40; ++n) {
    for (const double zeros : {0.0, 0.3, 0.9}) {
      const std::vector<Leaf> x = random_leaves(n, rng, zeros);
      EXPECT_EQ(bits(run(x, true)), bits(definition(x))) << "n=" << n << " zeros " << zeros;
    }
  }
}

TEST(SummationTreeTest, AnyPowerOfTwoRankCountDividingTheLeavesGivesTheSameBits) {
  Rng rng(2);
  int differs_from_running_sum = 0;
  for (const std::size_t m : {2, 4, 6, 8, 12, 16, 24, 32, 40}) {
    for (const double zeros : {0.0, 0.25, 0.75}) {
      const std::vector<Leaf> x = random_leaves(m, rng, zeros);
      const std::uint32_t one_rank = bits(run(x, true));
      for (std::size_t ranks = 2; ranks <= m; ranks *= 2) {
        if (m % ranks != 0) continue;
        // Rank r runs micro-batches r, ranks + r, ...: at local step j the ranks' leaves are
        // j * ranks .. j * ranks + ranks - 1, folded as the tree over `ranks` leaves (what the
        // communicators do); each rank's sum over its steps is the tree over m / ranks leaves.
        std::vector<Leaf> steps;
        for (std::size_t j = 0; j < m / ranks; ++j) {
          steps.push_back(
              run(std::vector<Leaf>(x.begin() + static_cast<std::ptrdiff_t>(j * ranks),
                                    x.begin() + static_cast<std::ptrdiff_t>((j + 1) * ranks)),
                  true));
        }
        EXPECT_EQ(bits(run(steps, true)), one_rank)
            << m << " leaves on " << ranks << " ranks, zeros " << zeros;
      }
      differs_from_running_sum += bits(run(x, false)) != one_rank ? 1 : 0;
    }
  }
  // The leaves are chosen so that the order shows: the running sum differs somewhere.
  EXPECT_GT(differs_from_running_sum, 0);
}

TEST(SummationTreeTest, TheRunningSumIsALeftFoldInOneBuffer) {
  Rng rng(3);
  const std::vector<Leaf> x = random_leaves(9, rng, 0.2);
  Leaf want;
  for (const Leaf& v : x) {
    if (v) want = want ? Leaf(*want + *v) : Leaf(0.0f + *v);
  }
  EXPECT_EQ(bits(run(x, false)), bits(want));
  EXPECT_EQ(SummationTree::buffers_needed(9, false), 1);
}

TEST(SummationTreeTest, BuffersAreTheBinaryCountersDepth) {
  // Two leaves pair in one buffer; a third joins the sum directly; four hold one pair while the
  // next is made; eight hold three partial sums at once (4 + 2 + the pair being stored).
  EXPECT_EQ(SummationTree::buffers_needed(1, true), 1);
  EXPECT_EQ(SummationTree::buffers_needed(2, true), 1);
  EXPECT_EQ(SummationTree::buffers_needed(3, true), 1);
  EXPECT_EQ(SummationTree::buffers_needed(4, true), 2);
  EXPECT_EQ(SummationTree::buffers_needed(6, true), 2);
  EXPECT_EQ(SummationTree::buffers_needed(8, true), 3);
  EXPECT_EQ(SummationTree::buffers_needed(16, true), 4);
  // A step again from the start after reset(), with the same buffers.
  SummationTree tree(4, true);
  for (int step = 0; step < 2; ++step) {
    tree.reset();
    for (std::int64_t leaf = 0; leaf < 4; ++leaf) (void)tree.arrive(leaf);
    EXPECT_TRUE(tree.finish().empty());
    EXPECT_EQ(tree.result(), 0);
  }
}

}  // namespace
}  // namespace strata

namespace strata {
namespace {

TEST(SummationTreeTest, CanonicalSumOfLeavesAtHandIsTheTreesSum) {
  Rng rng(4);
  for (std::size_t n = 1; n <= 70; ++n) {
    const std::vector<Leaf> x = random_leaves(n, rng, 0.0);
    const float got =
        canonical_sum(static_cast<std::int64_t>(n), [&](std::int64_t i) { return *x[i]; });
    EXPECT_EQ(std::bit_cast<std::uint32_t>(got), bits(run(x, true))) << "n=" << n;
  }
  // Leaves start from +0: -0 leaves sum to +0, as a fresh accumulator makes them.
  EXPECT_EQ(std::bit_cast<std::uint32_t>(canonical_sum(3, [](std::int64_t) { return -0.0f; })), 0u);
}

}  // namespace
}  // namespace strata

namespace strata {
namespace {

// The sum always ends in buffer 0, whatever leaves are zeros: a reader may hold that buffer's
// handle from the step's start (a guessed optimizer update does).
TEST(SummationTreeTest, TheSumEndsInTheFirstBuffer) {
  for (std::int64_t n = 1; n <= 20; ++n) {
    for (std::uint32_t present = 0; present < (1u << std::min<std::int64_t>(n, 10)); ++present) {
      SummationTree tree(n, true);
      for (std::int64_t leaf = 0; leaf < n; ++leaf) {
        if (leaf < 10 ? (present >> leaf) & 1 : leaf % 3 == 0) (void)tree.arrive(leaf);
      }
      (void)tree.finish();
      ASSERT_LE(tree.result(), 0) << n << " leaves, present " << present;
      if (present != 0) {
        ASSERT_EQ(tree.result(), 0) << n << " leaves, present " << present;
      }
    }
  }
}

}  // namespace
}  // namespace strata
