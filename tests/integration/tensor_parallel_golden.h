// One rank's share of a tensor-parallel step against the float64 PyTorch family goldens
// (tests/data/families/, tools/golden/family_golden.py): the rank holds its slices of the
// golden's weights, runs one forward and backward with the others over `group`, and its loss and
// its slice of every gradient must land where a correct f32 computation of the whole model
// lands. Shared by the CPU test (in-process ranks) and the CUDA one (ranks on one GPU).
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "strata/core/json.h"
#include "strata/model/llama.h"
#include "strata/model/tensor_group.h"
#include "tests/testing/in_process_ranks.h"
#include "tests/unit/model/llama_test_util.h"

namespace strata::model::testing {

// As the single-rank golden tests (llama_golden_test.cpp): a plain f32 implementation lands
// within f32_error (the golden's own float32 run) of float64 on every element; Strata's may sum
// in other orders and is allowed kF32Factor times that. Splitting a product over T ranks only
// reorders its sums once more (T partial dot products added by the all-reduce), which a correct
// implementation keeps inside the same bound; a wrong slice or a missing sum is far outside.
constexpr double kTensorParallelF32Factor = 8.0;

struct TensorParallelGolden {
  Json g;
  LlamaConfig config;
  GoldenBatch batch;
  double want_loss = 0, loss_bound = 0;
};

// Reads golden file `path` (its JSON and its model config); a failure is a gtest failure and
// `false`.
inline bool read_golden(const std::string& path, Json* g, LlamaConfig* config) {
  auto golden = read_json_file(path);
  EXPECT_TRUE(golden.is_ok()) << golden.status().to_string();
  if (!golden.is_ok()) return false;
  *g = std::move(golden).value();
  auto c = LlamaConfig::from_json(g->at("config"), path);
  EXPECT_TRUE(c.is_ok()) << c.status().to_string();
  if (!c.is_ok()) return false;
  *config = *c;
  return true;
}

// Reads tests/data/families/<name>.json; a failure is a gtest failure and `false`.
inline bool load_tensor_parallel_golden(const std::string& name, TensorParallelGolden* out) {
  const std::string path = std::string(STRATA_TEST_DATA_DIR) + "/families/" + name + ".json";
  if (!read_golden(path, &out->g, &out->config)) return false;
  out->batch = batch_of(out->g);
  out->want_loss = out->g.at("loss");
  out->loss_bound = kTensorParallelF32Factor * out->g.at("f32_loss_error").get<double>() +
                    0x1p-24 * std::abs(out->want_loss);
  return true;
}

// Rank `group.rank()` of `group.size()`: its step on `device` (with sequence parallelism when
// asked); "" when every value is inside its bound, else what is not (at most two elements a
// tensor).
inline std::string tensor_parallel_golden_step(const TensorParallelGolden& golden,
                                               device::Device& device, TensorGroup& group,
                                               bool checkpointing, bool sequence_parallel = false) {
  const Json& g = golden.g;
  const int size = group.size(), rank = group.rank();
  const ParamLayout layout = ParamLayout::build(golden.config, std::nullopt, false, {size, rank});
  TestProvider provider(layout, device, DType::kF32);
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
  options.tensor_group = &group;
  options.sequence_parallel = sequence_parallel;
  LlamaModel model(golden.config, layout, device, options);
  const GoldenBatch& b = golden.batch;
  auto loss =
      model.forward_backward(provider, b.inputs.data(), b.targets.data(), b.batch, b.seq, 1.0f);
  if (!loss.is_ok()) return loss.status().to_string();
  std::string fail;
  if (!(std::abs(*loss - golden.want_loss) <= golden.loss_bound)) {
    fail += "loss " + std::to_string(*loss) + ", want " + std::to_string(golden.want_loss) + "\n";
  }
  for (const auto& grp : layout.groups()) {
    for (const auto& t : grp.tensors) {
      const Json& want = g.at("grads").at(t.name);
      const double bound =
          kTensorParallelF32Factor * g.at("f32_grad_error").at(t.name).get<double>();
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
  return fail;
}

// Golden `name` split over `size` in-process ranks (host communicators, one thread each): each
// rank's `step` (its failures, "" when none) runs the golden step its own way.
inline void expect_every_rank_matches(
    const std::string& name, int size,
    const std::function<std::string(const TensorParallelGolden&, int rank,
                                    strata::testing::InProcessRanks&)>& step) {
  TensorParallelGolden golden;
  ASSERT_TRUE(load_tensor_parallel_golden(name, &golden));
  ASSERT_TRUE(tensor_parallel_problems(golden.config, size).empty());
  auto ranks = strata::testing::make_in_process_ranks(size);
  std::vector<std::string> failures(static_cast<std::size_t>(size));
  ranks.run(
      [&](int rank) { failures[static_cast<std::size_t>(rank)] = step(golden, rank, ranks); });
  for (int r = 0; r < size; ++r) {
    EXPECT_EQ(failures[static_cast<std::size_t>(r)], "") << "rank " << r;
  }
}

}  // namespace strata::model::testing
