// LoRA adapters over a tensor-parallel base (NeMo's layout: over a column-parallel projection
// lora_B splits by rows and lora_A is whole, over a row-parallel one lora_A splits by columns and
// lora_B is whole) against the float64 PyTorch LoRA goldens (tests/data/lora/): each rank of T
// holds its slices of the golden's base and adapters and runs one step, dropout included, with the
// others over in-process communicators, at T = 2 and T = 4 (kv heads whole on two ranks each),
// with and without sequence parallelism. The loss and each rank's slice of every adapter gradient
// must land where a correct f32 computation of the whole model lands, and the whole copies (A over
// a column-parallel base, B over a row-parallel one) must be the same bits on every rank.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "strata/core/json.h"
#include "strata/model/llama.h"
#include "strata/model/lora.h"
#include "strata/model/peft_adapter.h"
#include "strata/zero/tensor_group.h"
#include "tests/integration/tensor_parallel_golden.h"
#include "tests/testing/in_process_ranks.h"
#include "tests/testing/test_name.h"

namespace strata::model {
namespace {

using testing::kTensorParallelF32Factor;
using testing::TestProvider;

struct LoraGolden {
  Json g;
  LlamaConfig config;
  LoraConfig lora;
  testing::GoldenBatch batch;
};

bool load(const std::string& name, LoraGolden* out) {
  const std::string path = std::string(STRATA_TEST_DATA_DIR) + "/lora/" + name + ".json";
  if (!testing::read_golden(path, &out->g, &out->config)) return false;
  auto lora = lora_config_from_peft(out->g.at("lora"), "golden lora");
  EXPECT_TRUE(lora.is_ok()) << lora.status().to_string();
  if (!lora.is_ok()) return false;
  out->lora = *lora;
  out->batch = testing::batch_of(out->g);
  return true;
}

// What one rank got: its failures ("" when none), and its gradients of the tensors it holds whole
// (name -> values) for the cross-rank comparison.
struct RankRun {
  std::string failures;
  std::vector<std::pair<std::string, std::vector<float>>> whole_grads;
};

RankRun rank_step(const LoraGolden& golden, device::Device& device, TensorGroup& group,
                  bool sequence_parallel) {
  RankRun run;
  std::string& fail = run.failures;
  const Json& g = golden.g;
  const int size = group.size(), rank = group.rank();
  const ParamLayout layout = ParamLayout::build(golden.config, golden.lora, false, {size, rank});
  TestProvider provider(layout, device, DType::kF32);
  const Json& trained = g.at("adapters");
  for (const auto& grp : layout.groups()) {
    for (const auto& t : grp.tensors) {
      const Json& w = trained.contains(t.name) ? trained.at(t.name) : g.at("weights").at(t.name);
      float* p = provider.param(t.name);
      t.for_each_run(0, t.num_elems, [&](std::int64_t first, std::int64_t full, std::int64_t n) {
        for (std::int64_t i = 0; i < n; ++i) p[first + i] = w[full + i].get<float>();
      });
    }
  }
  ModelOptions options{DType::kF32, false, golden.lora};
  options.tensor_parallel = {size, rank};
  options.tensor_group = &group;
  options.sequence_parallel = sequence_parallel;
  LlamaModel model(golden.config, layout, device, options);
  const testing::GoldenBatch& b = golden.batch;
  const std::uint64_t key = std::stoull(g.at("dropout_key").get<std::string>());
  auto loss = model.forward_backward(provider, b.inputs.data(), b.targets.data(), b.batch, b.seq,
                                     1.0f, key);
  if (!loss.is_ok()) return {loss.status().to_string(), {}};
  const double want = g.at("loss");
  const double loss_bound =
      kTensorParallelF32Factor * g.at("f32_loss_error").get<double>() + 0x1p-24 * std::abs(want);
  if (!(std::abs(*loss - want) <= loss_bound)) {
    fail += "loss " + std::to_string(*loss) + ", want " + std::to_string(want) + "\n";
  }
  for (const auto& [name, grads] : g.at("grads").items()) {
    const auto loc = layout.find(name);
    if (!loc) {
      fail += name + " is not in the layout\n";
      continue;
    }
    const TensorSpec& t = *loc->tensor;
    const double bound = kTensorParallelF32Factor * g.at("f32_grad_error").at(name).get<double>();
    const float* got = provider.grad(name);
    int bad = 0;
    t.for_each_run(0, t.num_elems, [&](std::int64_t first, std::int64_t full, std::int64_t n) {
      for (std::int64_t i = 0; i < n; ++i) {
        const double w = grads[full + i].get<double>();
        if (!(std::abs(got[first + i] - w) <= bound) && ++bad <= 2) {
          fail += name + "[" + std::to_string(full + i) + "]: got " +
                  std::to_string(got[first + i]) + ", want " + std::to_string(w) + "\n";
        }
      }
    });
    if (t.slice.parts == 1)
      run.whole_grads.emplace_back(name, std::vector<float>(got, got + t.num_elems));
  }
  return run;
}

class LoraTensorParallelTest : public ::testing::TestWithParam<std::tuple<std::string, int, bool>> {
};

TEST_P(LoraTensorParallelTest, EachRanksSliceOfTheAdapterGradientsMatchesPyTorch) {
  const auto& [name, size, sequence_parallel] = GetParam();
  LoraGolden golden;
  ASSERT_TRUE(load(name, &golden));
  ASSERT_TRUE(tensor_parallel_problems(golden.config, size).empty());
  auto ranks = strata::testing::make_in_process_ranks(size);
  std::vector<RankRun> runs(static_cast<std::size_t>(size));
  ranks.run([&](int rank) {
    const auto r = static_cast<std::size_t>(rank);
    auto group = zero::make_tensor_group(*ranks.comms[r], *ranks.devices[r],
                                         golden.config.num_key_value_heads);
    if (!group.is_ok()) {
      runs[r].failures = group.status().to_string();
      return;
    }
    runs[r] = rank_step(golden, *ranks.devices[r], **group, sequence_parallel);
  });
  for (int r = 0; r < size; ++r) {
    EXPECT_EQ(runs[static_cast<std::size_t>(r)].failures, "") << "rank " << r;
  }
  // A whole adapter is one tensor on every rank: its gradient the same bits everywhere, or the
  // copies would drift apart.
  for (int r = 1; r < size; ++r) {
    const auto& mine = runs[static_cast<std::size_t>(r)].whole_grads;
    ASSERT_EQ(mine.size(), runs[0].whole_grads.size()) << "rank " << r;
    for (std::size_t i = 0; i < mine.size(); ++i) {
      EXPECT_EQ(mine[i].first, runs[0].whole_grads[i].first);
      EXPECT_TRUE(mine[i].second == runs[0].whole_grads[i].second)
          << mine[i].first << " differs between rank 0 and rank " << r;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cases, LoraTensorParallelTest,
    ::testing::Combine(::testing::Values("llama3-all", "llama3-all-dropout", "qwen2-all-dropout",
                                         "qwen3-all-rslora", "mistral-mlp-dropout"),
                       ::testing::Values(2, 4), ::testing::Bool()),
    [](const auto& info) {
      return strata::testing::test_name(std::get<0>(info.param) + "_T" +
                                        std::to_string(std::get<1>(info.param))) +
             (std::get<2>(info.param) ? "SequenceParallel" : "");
    });

// The adapters' initial values do not depend on the split: each rank's slice of a seeded layout
// is the whole (one-rank) layout's values at the slice's places, for A (uniform, by fan-in of the
// whole tensor) and B (zeros).
TEST(LoraTensorParallelInit, EachRanksSliceOfASeededAdapterIsTheWholeOnesValues) {
  LoraGolden golden;
  ASSERT_TRUE(load("llama3-all", &golden));
  const ParamLayout whole = ParamLayout::build(golden.config, golden.lora);
  for (const int size : {2, 4}) {
    for (int rank = 0; rank < size; ++rank) {
      const ParamLayout split = ParamLayout::build(golden.config, golden.lora, false, {size, rank});
      for (const auto& grp : split.groups()) {
        if (grp.name.find(".lora") == std::string::npos) continue;
        const ParamGroup& wg = whole.group(grp.id);
        std::vector<float> w(static_cast<std::size_t>(wg.num_elems));
        std::vector<float> s(static_cast<std::size_t>(grp.num_elems));
        init_group(golden.config, wg, 7, w.data());
        init_group(golden.config, grp, 7, s.data());
        for (const auto& t : grp.tensors) {
          const auto wt = whole.find(t.name);
          ASSERT_TRUE(wt.has_value()) << t.name;
          t.for_each_run(
              0, t.num_elems, [&](std::int64_t first, std::int64_t full, std::int64_t n) {
                for (std::int64_t i = 0; i < n; ++i) {
                  ASSERT_EQ(s[static_cast<std::size_t>(t.offset_elems + first + i)],
                            w[static_cast<std::size_t>(wt->tensor->offset_elems + full + i)])
                      << t.name << " element " << full + i << ", rank " << rank << " of " << size;
                }
              });
        }
      }
    }
  }
}

}  // namespace
}  // namespace strata::model
