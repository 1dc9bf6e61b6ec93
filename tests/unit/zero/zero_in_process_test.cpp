// ZeroProvider over in-process ranks (threads, dist::make_in_process_group), without mpirun: the
// bucket checks of tests/testing/zero_bucket_checks.h at 2 to 4 ranks for every stage, frozen
// groups among partitioned ones, and stage 3's gather-ahead decided alike on every rank.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

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

// Frozen groups partitioned over three ranks at every stage: their parameters gather whole, their
// gradients are refused by name, the reductions of the trainable groups around them still give
// exp_avg = the sum of every rank's gradient / 2, and the frozen weights stay as loaded.
TEST(ZeroInProcessFrozen, FrozenGroupsGatherAndNeverReduce) {
  for (int stage = 1; stage <= 3; ++stage) {
    SCOPED_TRACE("stage " + std::to_string(stage));
    constexpr int kWorld = 3;
    on_ranks(kWorld, [stage](bucket_checks::Rank& r) {
      std::vector<model::ParamGroup> groups = bucket_checks::make_layout().groups();
      for (std::size_t g : {std::size_t{0}, std::size_t{5}}) groups[g].frozen = true;
      const model::ParamLayout layout = model::ParamLayout::from_groups(std::move(groups));
      ShardOptions so;
      so.adam.beta1 = 0.5;  // the first step's exp_avg is then exactly half the gradient
      so.adam.weight_decay = 0.0;
      ZeroOptions zo;
      zo.stage = stage;
      auto made = ZeroProvider::create(layout, bucket_checks::kPersistenceThreshold, r.device,
                                       nullptr, r.grid, zo, so);
      ASSERT_TRUE(made.is_ok()) << made.status().to_string();
      ZeroProvider& zp = **made;
      ASSERT_TRUE(zp.load_master([](const model::ParamGroup& g, float* dst) {
                      for (std::int64_t i = 0; i < g.num_elems; ++i) {
                        dst[i] = bucket_checks::param_value(g.id, i);
                      }
                      return Status::ok();
                    }).is_ok());
      const int rank = r.grid.data().rank();
      for (int g = layout.num_groups() - 1; g >= 0; --g) {
        auto buf = zp.acquire_grads(g, model::GradientWrite::kWrite);
        if (layout.group(g).frozen) {
          ASSERT_FALSE(buf.is_ok());
          EXPECT_NE(buf.status().message().find("'" + layout.group(g).name + "' is frozen"),
                    std::string::npos)
              << buf.status().message();
          continue;
        }
        ASSERT_TRUE(buf.is_ok()) << buf.status().to_string();
        auto* grad = static_cast<float*>(*buf);
        for (std::int64_t i = 0; i < layout.group(g).num_elems; ++i) {
          grad[i] = bucket_checks::grad_value(0, rank, g, i);
        }
        ASSERT_TRUE(zp.release_grads(g).is_ok());
      }
      ASSERT_TRUE(zp.finish_micro_batch().is_ok());
      ASSERT_TRUE(zp.step(1e-3, 1, 1.0f).is_ok());
      for (int g = 0; g < layout.num_groups(); ++g) {
        const GroupPartition& p = zp.partition().group(g);
        std::vector<float> m(static_cast<std::size_t>(p.shard_elems)), v(m.size());
        ASSERT_TRUE(zp.read_moment_slice(g, m.data(), v.data()).is_ok());
        for (std::int64_t i = 0; i < p.shard_elems; ++i) {
          const std::int64_t j = static_cast<std::int64_t>(rank) * p.shard_elems + i;
          float want = 0.0f;
          double abs_sum = 0.0;
          if (!layout.group(g).frozen && j < p.full_elems) {
            for (int q = 0; q < kWorld; ++q) {
              want += bucket_checks::grad_value(0, q, g, j);
              abs_sum += std::abs(bucket_checks::grad_value(0, q, g, j));
            }
          }
          // Three ranks may pair their sums differently: each side rounds twice, each at most
          // 2^-24 of sum |terms|.
          const double tol = 2.0 * 2 * 0x1p-24 * abs_sum;
          ASSERT_NEAR(2.0 * m[static_cast<std::size_t>(i)], want, tol)
              << "group " << g << " element " << j;
        }
        // The whole group, on rank 0: the frozen ones as loaded.
        std::vector<float> full(rank == 0 ? static_cast<std::size_t>(p.full_elems) : 0);
        ASSERT_TRUE(zp.gather_master(g, full.data()).is_ok());
        if (rank == 0 && layout.group(g).frozen) {
          for (std::int64_t i = 0; i < p.full_elems; ++i) {
            ASSERT_EQ(full[static_cast<std::size_t>(i)], bucket_checks::param_value(g, i))
                << "frozen group " << g << " element " << i;
          }
        }
      }
    });
  }
}

TEST(ZeroInProcessGatherAhead, DecidedAlikeOnEveryRankUnderATightDeviceBudget) {
  on_ranks(3, [](bucket_checks::Rank& r) { bucket_checks::check_gather_ahead(r); });
}

}  // namespace
}  // namespace strata::zero
