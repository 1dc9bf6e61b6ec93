// Tensor parallelism (Megatron's split layers) against float64 PyTorch: each rank of T holds its
// slices of the family goldens' weights (tests/data/families/, tools/golden/family_golden.py)
// and runs one step with the others over in-process communicators, at T = 2 and at T = 4 (each
// of the two kv heads whole on two ranks); the loss and each rank's slice of every gradient must
// land where a correct f32 computation of the whole model lands.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "strata/core/json.h"
#include "strata/model/llama.h"
#include "strata/zero/tensor_group.h"
#include "tests/testing/in_process_ranks.h"
#include "tests/testing/test_name.h"
#include "tests/unit/model/llama_test_util.h"

namespace strata::model {
namespace {

// As the single-rank golden tests (llama_golden_test.cpp): a plain f32 implementation lands
// within f32_error (the golden's own float32 run) of float64 on every element; Strata's may sum
// in other orders and is allowed kF32Factor times that. Splitting a product over T ranks only
// reorders its sums once more (T partial dot products added by the all-reduce), which a correct
// implementation keeps inside the same bound; a wrong slice or a missing sum is far outside.
constexpr double kF32Factor = 8.0;

class TensorParallelGoldenTest
    : public ::testing::TestWithParam<std::tuple<std::string, int, bool>> {};

TEST_P(TensorParallelGoldenTest, EachRanksSliceOfTheStepMatchesPyTorch) {
  const auto& [name, size, checkpointing] = GetParam();
  const std::string path = std::string(STRATA_TEST_DATA_DIR) + "/families/" + name + ".json";
  auto golden = read_json_file(path);
  ASSERT_TRUE(golden.is_ok()) << golden.status().to_string();
  const Json& g = golden.value();
  auto config = LlamaConfig::from_json(g.at("config"), path);
  ASSERT_TRUE(config.is_ok()) << config.status().to_string();
  ASSERT_TRUE(tensor_parallel_problems(*config, size).empty());

  const testing::GoldenBatch windows = testing::batch_of(g);
  const std::vector<std::int32_t>& inputs = windows.inputs;
  const std::vector<std::int32_t>& targets = windows.targets;
  const std::int64_t seq = windows.seq, batch = windows.batch;
  const double want_loss = g.at("loss");
  const double loss_bound =
      kF32Factor * g.at("f32_loss_error").get<double>() + 0x1p-24 * std::abs(want_loss);

  auto ranks = strata::testing::make_in_process_ranks(size);
  std::vector<std::string> failures(static_cast<std::size_t>(size));
  ranks.run([&](int rank) {
    std::string& fail = failures[static_cast<std::size_t>(rank)];
    device::Device& device = *ranks.devices[static_cast<std::size_t>(rank)];
    auto made = zero::make_tensor_group(*ranks.comms[static_cast<std::size_t>(rank)], device,
                                        config->num_key_value_heads);
    if (!made.is_ok()) {
      fail = made.status().to_string();
      return;
    }
    const auto group = std::move(made).value();
    const ParamLayout layout = ParamLayout::build(*config, std::nullopt, false, {size, rank});
    testing::TestProvider provider(layout, device, DType::kF32);
    for (const auto& grp : layout.groups()) {
      for (const auto& t : grp.tensors) {
        const Json& w = g.at("weights").at(t.name);
        float* p = provider.param(t.name);
        t.for_each_run(0, t.num_elems, [&](std::int64_t first, std::int64_t full, std::int64_t n) {
          for (std::int64_t i = 0; i < n; ++i) p[first + i] = w[full + i].get<float>();
        });
      }
    }
    ModelOptions options{DType::kF32, checkpointing, std::nullopt};
    options.tensor_parallel = {size, rank};
    options.tensor_group = group.get();
    LlamaModel model(*config, layout, device, options);
    auto loss = model.forward_backward(provider, inputs.data(), targets.data(), batch, seq, 1.0f);
    if (!loss.is_ok()) {
      fail = loss.status().to_string();
      return;
    }
    if (!(std::abs(*loss - want_loss) <= loss_bound)) {
      fail += "loss " + std::to_string(*loss) + ", want " + std::to_string(want_loss) + "\n";
    }
    for (const auto& grp : layout.groups()) {
      for (const auto& t : grp.tensors) {
        const Json& want = g.at("grads").at(t.name);
        const double bound = kF32Factor * g.at("f32_grad_error").at(t.name).get<double>();
        const float* got = provider.grad(t.name);
        int bad = 0;
        t.for_each_run(0, t.num_elems, [&](std::int64_t first, std::int64_t full, std::int64_t n) {
          for (std::int64_t i = 0; i < n; ++i) {
            const double w = want[full + i].get<double>();
            if (!(std::abs(got[first + i] - w) <= bound) && ++bad <= 2) {
              fail += t.name + "[" + std::to_string(full + i) + "]: got " +
                      std::to_string(got[first + i]) + ", want " + std::to_string(w) + "\n";
            }
          }
        });
      }
    }
  });
  for (int r = 0; r < size; ++r) {
    EXPECT_EQ(failures[static_cast<std::size_t>(r)], "") << "rank " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(Families, TensorParallelGoldenTest,
                         ::testing::Combine(::testing::Values("llama3", "llama-linear", "qwen2",
                                                              "qwen2-window", "qwen3", "mistral"),
                                            ::testing::Values(2, 4), ::testing::Bool()),
                         [](const auto& info) {
                           return strata::testing::test_name(
                                      std::get<0>(info.param) + "_T" +
                                      std::to_string(std::get<1>(info.param))) +
                                  (std::get<2>(info.param) ? "Checkpointed" : "Stored");
                         });

}  // namespace
}  // namespace strata::model
