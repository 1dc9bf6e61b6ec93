// deterministic_reduction: ZeroProvider on 1, 2 and 4 in-process ranks, fed the same global
// batch (rank r's micro-batch k is the batch's k * ranks + r), gives the same gradient norm and
// the same master weights to the bit, step after step, in fp32 and bf16 (whose gradients the
// ranks sum into f32, as one rank's accumulator does), at every stage, with the optimizer on the
// device, in host memory and on NVMe, gradients summed on the device or in host memory, and a group
// that some micro-batches bring no gradient (an expert no token chose). Without it (a running sum)
// the bits differ.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "strata/core/rng.h"
#include "strata/dist/process_grid.h"
#include "strata/zero/zero_provider.h"
#include "tests/testing/backends.h"
#include "tests/testing/in_process_ranks.h"
#include "tests/testing/zero_bucket_checks.h"

namespace strata::zero {
namespace {

constexpr int kMicroBatches = 4;  // the global batch's
constexpr int kSteps = 2;
// Large groups sharded over the ranks (their shard boundaries move with the rank count), one
// below the persistence threshold (whole on every rank), odd sizes.
const std::vector<std::int64_t> kElems = {5000, 70, 1301, 12000, 600};
constexpr std::int64_t kPersistenceThreshold = 100;
constexpr int kSparseGroup = 2;  // no gradient in the global batch's first two micro-batches

using bucket_checks::param_value;
// The gradient of global micro-batch `micro` of step `step`: wide exponents, so that the order
// of every sum shows in its bits.
float grad_value(int step, int micro, int group, std::int64_t i) {
  Rng rng(static_cast<std::uint64_t>(step) * 1000003u + static_cast<std::uint64_t>(micro) * 7u +
          static_cast<std::uint64_t>(group) * 65537u * 31u + static_cast<std::uint64_t>(i) * 131u);
  return static_cast<float>(std::ldexp(rng.normal(), static_cast<int>(rng.next_u64() % 24) - 12));
}

struct Placement {
  const char* name;
  Tier optimizer;
  GradAccumulation accumulation;
  int stage;
  DType dtype = DType::kF32;  // the model's gradients'
};

void PrintTo(const Placement& p, std::ostream* os) { *os << p.name; }

struct Outcome {
  std::vector<std::uint64_t> norms;        // each step's, as bits
  std::vector<std::vector<float>> master;  // by group, whole (rank 0's gather)
};

Outcome train(int world, const Placement& p, bool tree) {
  Outcome out;
  ::strata::testing::InProcessRanks ranks = ::strata::testing::make_in_process_ranks(world);
  std::vector<model::ParamGroup> groups;
  for (std::size_t g = 0; g < kElems.size(); ++g) {
    model::ParamGroup pg;
    pg.name = "g" + std::to_string(g);
    pg.num_elems = kElems[g];
    groups.push_back(std::move(pg));
  }
  const model::ParamLayout layout = model::ParamLayout::from_groups(std::move(groups));
  ranks.run([&](int rank) {
    const auto ri = static_cast<std::size_t>(rank);
    dist::GridShape shape;
    shape.data = world;
    auto grid = dist::ProcessGrid::create(*ranks.comms[ri], shape, *ranks.devices[ri]);
    ASSERT_TRUE(grid.is_ok()) << grid.status().to_string();
    auto swap = p.optimizer == Tier::kNvme ? ::strata::testing::make_swap() : nullptr;
    ShardOptions so;
    so.offload_optimizer = p.optimizer;
    so.offload_param = p.stage == 3 ? p.optimizer : Tier::kDevice;
    so.accumulation_steps = kMicroBatches / world;
    so.grad_accumulation = p.accumulation;
    so.tree_sums = tree;
    so.compute_dtype = p.dtype;
    ZeroOptions zo;
    zo.stage = p.stage;
    zo.compute_dtype = p.dtype;
    // 16-bit gradients summed over the ranks into f32, as one rank's accumulator sums them (the
    // trainer's choice: zero_options).
    zo.wide_gradients = tree && world > 1 && p.dtype != DType::kF32;
    zo.reduce_bucket_bytes = 8 << 10;  // buckets that split and coalesce groups
    auto made = ZeroProvider::create(layout, kPersistenceThreshold, *ranks.devices[ri], swap.get(),
                                     **grid, zo, so);
    ASSERT_TRUE(made.is_ok()) << made.status().to_string();
    ZeroProvider& zp = **made;
    ASSERT_TRUE(zp.load_master([](const model::ParamGroup& g, float* dst) {
                    for (std::int64_t i = 0; i < g.num_elems; ++i) dst[i] = param_value(g.id, i);
                    return Status::ok();
                  }).is_ok());
    for (int step = 1; step <= kSteps; ++step) {
      for (int k = 0; k < kMicroBatches / world; ++k) {
        const int micro = k * world + rank;
        zp.set_micro_batch(k);
        for (int g = layout.num_groups() - 1; g >= 0; --g) {
          // The sparse group: no gradient in global micro-batches 0 and 1. A rank whose own
          // micro-batch has none joins its peers' reduction with zeros, as an MoE layer does
          // for an expert only other ranks' tokens chose; where no rank has one, none is made.
          const bool absent = g == kSparseGroup && micro < 2;
          const bool peers_have = [&] {
            for (int r = 0; r < world; ++r) {
              if (k * world + r >= 2) return true;
            }
            return false;
          }();
          if (absent && (world == 1 || !peers_have)) continue;
          auto buf = zp.acquire_grads(
              g, absent ? model::GradientWrite::kAdd : model::GradientWrite::kWrite);
          ASSERT_TRUE(buf.is_ok()) << buf.status().to_string();
          if (!absent) {
            for (std::int64_t i = 0; i < kElems[static_cast<std::size_t>(g)]; ++i) {
              const float v = grad_value(step, micro, g, i);
              if (p.dtype == DType::kF32) {
                static_cast<float*>(*buf)[i] = v;
              } else {
                static_cast<bf16*>(*buf)[i] = f32_to_bf16(v);
              }
            }
          }
          ASSERT_TRUE(zp.release_grads(g).is_ok());
        }
        ASSERT_TRUE(zp.finish_micro_batch().is_ok());
      }
      auto norm = zp.grad_norm();
      ASSERT_TRUE(norm.is_ok()) << norm.status().to_string();
      // Clipping that triggers: the step scaled to a norm of a third of the gradients'.
      const auto scale = static_cast<float>(1.0 / 3.0);
      ASSERT_TRUE(zp.step(1e-2, step, scale).is_ok());
      ASSERT_TRUE(zp.finish_step().is_ok());
      if (rank == 0) out.norms.push_back(std::bit_cast<std::uint64_t>(*norm));
    }
    for (int g = 0; g < layout.num_groups(); ++g) {
      std::vector<float> master(rank == 0 ? static_cast<std::size_t>(kElems[g]) : 0);
      ASSERT_TRUE(zp.gather_master(g, master.data()).is_ok());
      if (rank == 0) out.master.push_back(std::move(master));
    }
  });
  return out;
}

class DeterministicReduction : public ::testing::TestWithParam<Placement> {};

TEST_P(DeterministicReduction, OneTwoAndFourRanksGiveTheSameBits) {
  const Outcome one = train(1, GetParam(), /*tree=*/true);
  ASSERT_EQ(one.norms.size(), static_cast<std::size_t>(kSteps));
  for (const int world : {2, 4}) {
    SCOPED_TRACE(std::to_string(world) + " ranks");
    const Outcome many = train(world, GetParam(), /*tree=*/true);
    EXPECT_EQ(many.norms, one.norms) << "the gradient norm's bits";
    ASSERT_EQ(many.master.size(), one.master.size());
    for (std::size_t g = 0; g < one.master.size(); ++g) {
      EXPECT_TRUE(many.master[g] == one.master[g]) << "master weights of group " << g;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Placements, DeterministicReduction,
    ::testing::Values(
        Placement{"stage1_device", Tier::kDevice, GradAccumulation::kAuto, 1},
        Placement{"stage2_host_sums_on_host", Tier::kHost, GradAccumulation::kHost, 2},
        Placement{"stage2_host_sums_on_device", Tier::kHost, GradAccumulation::kDevice, 2},
        Placement{"stage3_host", Tier::kHost, GradAccumulation::kHost, 3},
        Placement{"stage3_nvme", Tier::kNvme, GradAccumulation::kHost, 3},
        Placement{"stage1_device_bf16", Tier::kDevice, GradAccumulation::kAuto, 1, DType::kBF16},
        Placement{"stage2_host_bf16", Tier::kHost, GradAccumulation::kHost, 2, DType::kBF16},
        Placement{"stage2_host_sums_on_device_bf16", Tier::kHost, GradAccumulation::kDevice, 2,
                  DType::kBF16},
        Placement{"stage3_nvme_bf16", Tier::kNvme, GradAccumulation::kHost, 3, DType::kBF16}),
    [](const auto& info) { return std::string(info.param.name); });

// The running sum it replaces folds each rank's micro-batches in turn and the ranks in turn: on
// these gradients, four ranks do not give one rank's bits (the test above would prove nothing
// if they did).
TEST(DeterministicReductionOff, ARunningSumDiffersAcrossRankCounts) {
  const Placement p{"stage2_host", Tier::kHost, GradAccumulation::kHost, 2};
  const Outcome one = train(1, p, /*tree=*/false), four = train(4, p, /*tree=*/false);
  bool differs = one.norms != four.norms;
  for (std::size_t g = 0; g < one.master.size(); ++g) differs |= one.master[g] != four.master[g];
  EXPECT_TRUE(differs);
}

}  // namespace
}  // namespace strata::zero
