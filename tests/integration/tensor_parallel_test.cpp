// Tensor parallelism (Megatron's split layers) against float64 PyTorch: each rank of T holds its
// slices of the family goldens' weights (tests/data/families/, tools/golden/family_golden.py)
// and runs one step with the others over in-process communicators, at T = 2 and at T = 4 (each
// of the two kv heads whole on two ranks), with and without sequence parallelism; the loss and
// each rank's slice of every gradient must land where a correct f32 computation of the whole
// model lands. Decoding a split model (the vocabulary-parallel embedding's sum, the row-parallel
// sums, the logits gathered whole) greedily gives PyTorch's tokens.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

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

// Each rank holds its slices of the golden's trained weights and decodes its greedy prompt, the
// prompt at once and then a token at a time (sequence parallelism asked for at T = 2, which
// decoding leaves off): every rank picks PyTorch's tokens, the golden's smallest gap between the
// best two logits (min_top2_gap) being far above the f32 rounding of a reordered sum.
class TensorParallelDecodeTest : public ::testing::TestWithParam<std::tuple<std::string, int>> {};

TEST_P(TensorParallelDecodeTest, EveryRankDecodesPyTorchsGreedyTokens) {
  const auto& [name, size] = GetParam();
  testing::expect_every_rank_matches(
      name, size,
      [&](const testing::TensorParallelGolden& golden, int rank,
          strata::testing::InProcessRanks& ranks) -> std::string {
        const auto r = static_cast<std::size_t>(rank);
        device::Device& device = *ranks.devices[r];
        auto group =
            zero::make_tensor_group(*ranks.comms[r], device, golden.config.num_key_value_heads);
        if (!group.is_ok()) return group.status().to_string();
        const Json& g = golden.g;
        const ParamLayout layout =
            ParamLayout::build(golden.config, std::nullopt, false, {size, rank}).all_frozen();
        testing::TestProvider provider(layout, device, DType::kF32);
        for (const auto& grp : layout.groups()) {
          for (const auto& t : grp.tensors) {
            const Json& w = g.at("trained_weights").at(t.name);
            float* p = provider.param(t.name);
            t.for_each_run(0, t.num_elems,
                           [&](std::int64_t first, std::int64_t full, std::int64_t n) {
                             for (std::int64_t i = 0; i < n; ++i) {
                               p[first + i] = w[full + i].get<float>();
                             }
                           });
          }
        }
        ModelOptions options{DType::kF32, false, std::nullopt};
        options.tensor_parallel = {size, rank};
        options.tensor_group = group->get();
        options.sequence_parallel = size == 2;
        LlamaModel model(golden.config, layout, device, options);
        const auto prompt = g.at("greedy").at("prompt").get<std::vector<std::int32_t>>();
        const auto want = g.at("greedy").at("generated").get<std::vector<std::int32_t>>();
        const auto n = static_cast<std::int64_t>(prompt.size());
        const Status begun =
            model.begin_decode(provider, n + static_cast<std::int64_t>(want.size()), n);
        if (!begun.is_ok()) return begun.to_string();
        std::vector<std::int32_t> got;
        auto logits = model.decode(provider, prompt.data(), n);
        while (logits.is_ok()) {
          const float* l = *logits;
          got.push_back(
              static_cast<std::int32_t>(std::max_element(l, l + golden.config.vocab_size) - l));
          if (got.size() == want.size()) break;
          logits = model.decode(provider, &got.back(), 1);
        }
        if (!logits.is_ok()) return logits.status().to_string();
        return got == want ? std::string() : "decoded tokens differ from PyTorch's";
      });
}

INSTANTIATE_TEST_SUITE_P(Families, TensorParallelDecodeTest,
                         ::testing::Combine(::testing::Values("llama3", "llama-linear", "qwen2",
                                                              "qwen2-window", "qwen3", "mistral"),
                                            ::testing::Values(2, 4)),
                         [](const auto& info) {
                           return strata::testing::test_name(
                               std::get<0>(info.param) + "_T" +
                               std::to_string(std::get<1>(info.param)));
                         });

}  // namespace
}  // namespace strata::model
