// Bucketed ZeRO collectives under mpirun (ctest runs this with 1-4 ranks): the checks of
// tests/testing/zero_bucket_checks.h over MPI.
#include <gtest/gtest.h>

#include <memory>

#include "strata/dist/process_grid.h"
#include "tests/testing/mpi_env.h"
#include "tests/testing/zero_bucket_checks.h"

namespace strata::zero {
namespace {

bucket_checks::Rank& rank_env() {
  static std::unique_ptr<dist::ProcessGrid> grid = [] {
    ::strata::testing::MpiEnv& e = ::strata::testing::mpi_env();
    dist::GridShape shape;
    shape.data = e.comm->world_size();
    auto g = dist::ProcessGrid::create(*e.comm, shape, *e.device);
    EXPECT_TRUE(g.is_ok()) << g.status().to_string();
    return std::move(*g);
  }();
  static bucket_checks::Rank r{*::strata::testing::mpi_env().device, *grid};
  return r;
}

class ZeroBuckets : public ::testing::TestWithParam<int> {};

TEST_P(ZeroBuckets, SameValuesAndVolumeAtEveryBucketSize) {
  bucket_checks::check_bucket_sizes(rank_env(), GetParam());
}

// Stage 3's gather-ahead under a device budget that holds one group's gather at a time for the
// largest group, but not that and the group before it: every rank must start or skip each
// prefetched all-gather alike.
TEST(ZeroGatherAhead, DecidedAlikeOnEveryRankUnderATightDeviceBudget) {
  if (rank_env().grid.data().world_size() < 2) GTEST_SKIP() << "one rank gathers nothing";
  bucket_checks::check_gather_ahead(rank_env());
}

INSTANTIATE_TEST_SUITE_P(Stages, ZeroBuckets, ::testing::Values(1, 2, 3),
                         [](const auto& info) { return "stage" + std::to_string(info.param); });

}  // namespace
}  // namespace strata::zero

int main(int argc, char** argv) { return strata::testing::run_mpi_tests(argc, argv); }
