// Tensor parallelism (Megatron's split layers) against float64 PyTorch: each rank of T holds its
// slices of the family goldens' weights (tests/data/families/, tools/golden/family_golden.py)
// and runs one step with the others over in-process communicators, at T = 2 and at T = 4 (each
// of the two kv heads whole on two ranks), with and without sequence parallelism; the loss and
// each rank's slice of every gradient must land where a correct f32 computation of the whole
// model lands.
#include <gtest/gtest.h>

#include <string>

#include "strata/zero/tensor_group.h"
#include "tests/integration/tensor_parallel_golden.h"
#include "tests/testing/test_name.h"

namespace strata::model {
namespace {

class TensorParallelGoldenTest
    : public ::testing::TestWithParam<std::tuple<std::string, int, bool, bool>> {};

TEST_P(TensorParallelGoldenTest, EachRanksSliceOfTheStepMatchesPyTorch) {
  const auto& [name, size, checkpointing, sequence_parallel] = GetParam();
  testing::expect_every_rank_matches(
      name, size,
      [&](const testing::TensorParallelGolden& golden, int rank,
          strata::testing::InProcessRanks& ranks) -> std::string {
        const auto r = static_cast<std::size_t>(rank);
        auto group = zero::make_tensor_group(*ranks.comms[r], *ranks.devices[r],
                                             golden.config.num_key_value_heads);
        if (!group.is_ok()) return group.status().to_string();
        std::string failures = testing::tensor_parallel_golden_step(
            golden, *ranks.devices[r], **group, checkpointing, sequence_parallel);
        // The kv-replica sums are counted where the progress line finds them.
        const std::uint64_t counted = (*group)->replica_stats().all_reduce_bytes;
        if (((*group)->kv_replicas() > 1) != (counted > 0)) {
          failures += "kv-replica sums counted: " + std::to_string(counted) + " bytes\n";
        }
        return failures;
      });
}

INSTANTIATE_TEST_SUITE_P(Families, TensorParallelGoldenTest,
                         ::testing::Combine(::testing::Values("llama3", "llama-linear", "qwen2",
                                                              "qwen2-window", "qwen3", "mistral"),
                                            ::testing::Values(2, 4), ::testing::Bool(),
                                            ::testing::Bool()),
                         [](const auto& info) {
                           return strata::testing::test_name(
                                      std::get<0>(info.param) + "_T" +
                                      std::to_string(std::get<1>(info.param))) +
                                  (std::get<2>(info.param) ? "Checkpointed" : "Stored") +
                                  (std::get<3>(info.param) ? "SequenceParallel" : "");
                         });

}  // namespace
}  // namespace strata::model
