// ZeroProvider over in-process ranks (threads, dist::make_in_process_group), without mpirun: the
// bucket checks of tests/testing/zero_bucket_checks.h at 2 to 4 ranks for every stage, and
// stage 3's gather-ahead decided alike on every rank.
#include <gtest/gtest.h>

#include <functional>
#include <memory>
#include <string>
#include <tuple>

#include "strata/dist/process_grid.h"
#include "tests/testing/in_process_ranks.h"
#include "tests/testing/zero_bucket_checks.h"

namespace strata::zero {
namespace {

// Runs check(rank) on each of `world` in-process ranks, each with its data-parallel grid.
void on_ranks(int world, const std::function<void(bucket_checks::Rank&)>& check) {
  ::strata::testing::InProcessRanks ranks = ::strata::testing::make_in_process_ranks(world);
  ASSERT_EQ(static_cast<int>(ranks.comms.size()), world);
  ranks.run([&](int r) {
    const auto i = static_cast<std::size_t>(r);
    dist::GridShape shape;
    shape.data = world;
    auto grid = dist::ProcessGrid::create(*ranks.comms[i], shape, *ranks.devices[i]);
    ASSERT_TRUE(grid.is_ok()) << grid.status().to_string();
    bucket_checks::Rank rank{*ranks.devices[i], **grid};
    check(rank);
  });
}

class ZeroInProcess : public ::testing::TestWithParam<std::tuple<int, int>> {};

TEST_P(ZeroInProcess, SameValuesAndVolumeAtEveryBucketSize) {
  const auto [world, stage] = GetParam();
  on_ranks(world, [stage](bucket_checks::Rank& r) { bucket_checks::check_bucket_sizes(r, stage); });
}

INSTANTIATE_TEST_SUITE_P(RanksAndStages, ZeroInProcess,
                         ::testing::Combine(::testing::Values(2, 3, 4), ::testing::Values(1, 2, 3)),
                         [](const auto& info) {
                           return "ranks" + std::to_string(std::get<0>(info.param)) + "_stage" +
                                  std::to_string(std::get<1>(info.param));
                         });

TEST(ZeroInProcessGatherAhead, DecidedAlikeOnEveryRankUnderATightDeviceBudget) {
  on_ranks(3, [](bucket_checks::Rank& r) { bucket_checks::check_gather_ahead(r); });
}

}  // namespace
}  // namespace strata::zero
