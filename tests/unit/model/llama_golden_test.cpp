// LlamaModel against PyTorch: loss and gradients of a tiny model computed in float64 by
// tools/golden/llama_golden.py (tests/data/llama_tiny_golden.json).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "strata/core/json.h"
#include "strata/model/llama.h"
#include "tests/testing/test_name.h"
#include "tests/unit/model/llama_test_util.h"

namespace strata::model {
namespace {

using testing::make_device;
using testing::TestProvider;

const char* const kGoldenPath = STRATA_TEST_DATA_DIR "/llama_tiny_golden.json";

struct GoldenRun {
  float loss = 0;
  double aux_loss = 0;                              // MoE families: the load-balancing loss
  std::map<std::string, std::vector<float>> grads;  // by HF tensor name
};

// Loads the config and weights of one case into a fresh model and runs one step.
GoldenRun run_case(const Json& golden, const Json& config_json, DType dtype, bool checkpointing) {
  auto config = LlamaConfig::from_json(config_json, kGoldenPath);
  STRATA_CHECK(config.is_ok(), config.status().to_string());
  const ParamLayout layout = ParamLayout::build(*config);
  auto device = make_device();
  TestProvider provider(layout, *device, dtype);
  // Every tensor of the layout comes from the file (a missing name throws from at()).
  for (const auto& group : layout.groups()) {
    for (const auto& t : group.tensors) {
      const Json& w = golden.at("weights").at(t.name);
      STRATA_CHECK(static_cast<std::int64_t>(w.size()) == t.num_elems, "size mismatch", t.name);
      float* p = provider.param(t.name);
      for (std::int64_t i = 0; i < t.num_elems; ++i) p[i] = w[i].get<float>();
    }
  }
  const testing::GoldenBatch b = testing::batch_of(golden);
  LlamaModel model(*config, layout, *device, ModelOptions{dtype, checkpointing, std::nullopt});
  auto r =
      model.forward_backward(provider, b.inputs.data(), b.targets.data(), b.batch, b.seq, 1.0f);
  STRATA_CHECK(r.is_ok(), r.status().to_string());
  GoldenRun run;
  run.loss = *r;
  run.aux_loss = model.last_aux_loss();
  for (const auto& group : layout.groups()) {
    for (const auto& t : group.tensors) {
      const float* g = provider.grad(t.name);
      run.grads[t.name].assign(g, g + t.num_elems);
    }
  }
  return run;
}

// A plain f32 implementation of the same model (torch's, in the golden file) lands within
// f32_error of float64 on every element of a tensor; Strata's f32 sums in other orders (OpenBLAS
// kernels, blocked attention), so it is allowed kF32Factor times that, not a tolerance fitted to
// one machine's rounding. A wrong formula moves gradients by far more than f32 noise.
constexpr double kF32Factor = 8.0;

// Every element within kF32Factor * f32_error of the float64 gradient; prints the worst fraction
// of the bound used.
void expect_grad_close(const std::string& name, const std::vector<float>& got, const Json& want,
                       double f32_error) {
  ASSERT_EQ(got.size(), want.size()) << name;
  ASSERT_GT(f32_error, 0.0) << name << ": the golden file carries no f32 error for it";
  const double bound = kF32Factor * f32_error;
  int bad = 0;
  double worst = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double w = want[i].get<double>();
    const double err = std::abs(got[i] - w);
    worst = std::max(worst, err / bound);
    if (!(err <= bound) && ++bad <= 3) {
      ADD_FAILURE() << name << "[" << i << "]: got " << got[i] << ", want " << w << " (bound "
                    << bound << ")";
    }
  }
  std::printf("  %s: worst %.2f of the bound (%.3g)\n", name.c_str(), worst, bound);
  EXPECT_EQ(bad, 0) << name;
}

class LlamaGoldenTest : public ::testing::TestWithParam<bool> {
 protected:
  static void SetUpTestSuite() {
    auto j = read_json_file(kGoldenPath);
    STRATA_CHECK(j.is_ok(), j.status().to_string());
    golden_ = new Json(std::move(j).value());
  }
  static void TearDownTestSuite() {
    delete golden_;
    golden_ = nullptr;
  }
  static Json* golden_;
};
Json* LlamaGoldenTest::golden_ = nullptr;

TEST_P(LlamaGoldenTest, F32LossAndGradientsMatchPyTorch) {
  const bool checkpointing = GetParam();
  const Json& g = *golden_;
  for (const char* which : {"untied", "tied"}) {
    SCOPED_TRACE(which);
    const Json& c = g.at(which);
    const Json& config_json = c.contains("config") ? c.at("config") : g.at("config");
    const GoldenRun run = run_case(g, config_json, DType::kF32, checkpointing);
    const double want = c.at("loss").get<double>();
    // The loss is also rounded to f32 once more than torch's float64 result is.
    EXPECT_NEAR(run.loss, want,
                kF32Factor * c.at("f32_loss_error").get<double>() + 0x1p-24 * std::abs(want));
    for (const auto& [name, grads] : c.at("grads").items()) {
      ASSERT_TRUE(run.grads.count(name)) << name;
      expect_grad_close(name, run.grads.at(name), grads,
                        c.at("f32_grad_error").at(name).get<double>());
    }
  }
}

TEST_P(LlamaGoldenTest, Bf16LossIsCloseToPyTorch) {
  const Json& g = *golden_;
  const GoldenRun run = run_case(g, g.at("config"), DType::kBF16, GetParam());
  const double want = g.at("untied").at("loss").get<double>();
  EXPECT_NEAR(run.loss, want, 2e-2 * want);
}

// fp16 stores what bf16 does with 3 more mantissa bits: its error, which comes from rounding
// the stored weights and activations, is bf16's bound times the ratio of their unit roundoffs
// (2^-11 / 2^-8).
TEST_P(LlamaGoldenTest, F16LossIsCloseToPyTorch) {
  const Json& g = *golden_;
  const GoldenRun run = run_case(g, g.at("config"), DType::kF16, GetParam());
  const double want = g.at("untied").at("loss").get<double>();
  EXPECT_NEAR(run.loss, want, 2e-2 * (0x1p-11 / 0x1p-8) * want);
}

INSTANTIATE_TEST_SUITE_P(Checkpointing, LlamaGoldenTest, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "Checkpointed" : "Stored"; });

// The families (tools/golden/family_golden.py, tests/data/families/): Llama 3 (llama3 rope
// scaling, explicit head_dim, attention and MLP biases), Llama with linear rope scaling, Qwen2
// (q/k/v biases, tied), Qwen2 with sliding windows from layer 1, Qwen3 (q/k norms) and Mistral
// (sliding window), Qwen3-MoE (a dense layer between two of 4 experts, top 2 renormalized) and
// Mixtral (every layer 4 experts, sliding window): the loss (with the MoE families' load-balancing
// loss) and every gradient, the routers' included, of one step against float64 PyTorch.
class FamilyGoldenTest : public ::testing::TestWithParam<std::tuple<std::string, bool>> {};

TEST_P(FamilyGoldenTest, F32LossAndGradientsMatchPyTorch) {
  const auto& [name, checkpointing] = GetParam();
  const std::string path = std::string(STRATA_TEST_DATA_DIR) + "/families/" + name + ".json";
  auto golden = read_json_file(path);
  ASSERT_TRUE(golden.is_ok()) << golden.status().to_string();
  const Json& g = golden.value();
  const GoldenRun run = run_case(g, g.at("config"), DType::kF32, checkpointing);
  const double want = g.at("loss").get<double>();
  // MoE families: the training loss adds router_aux_loss_coef times the load-balancing loss to
  // the language model's, which the model reports apart. The aux loss is sums of products of
  // f32 probabilities (each a few roundings off) over routing choices that agree (the golden's
  // min_route_gap is far above f32 noise): 1e-5 of it holds.
  double total = run.loss;
  if (g.contains("aux_loss")) {
    const double aux = g.at("aux_loss").get<double>();
    EXPECT_NEAR(run.aux_loss, aux, 1e-5 * aux);
    total += g.at("config").at("router_aux_loss_coef").get<double>() * run.aux_loss;
    EXPECT_NEAR(run.loss, g.at("lm_loss").get<double>(),
                kF32Factor * g.at("f32_loss_error").get<double>() + 0x1p-24 * std::abs(want));
  }
  EXPECT_NEAR(total, want,
              kF32Factor * g.at("f32_loss_error").get<double>() + 0x1p-24 * std::abs(want));
  ASSERT_EQ(g.at("grads").size(), run.grads.size()) << "every tensor of the layout has a golden";
  for (const auto& [tensor, grads] : g.at("grads").items()) {
    ASSERT_TRUE(run.grads.count(tensor)) << tensor;
    expect_grad_close(tensor, run.grads.at(tensor), grads,
                      g.at("f32_grad_error").at(tensor).get<double>());
  }
}

INSTANTIATE_TEST_SUITE_P(Families, FamilyGoldenTest,
                         ::testing::Combine(::testing::Values("llama3", "llama-linear", "qwen2",
                                                              "qwen2-window", "qwen3", "mistral",
                                                              "qwen3-moe", "mixtral"),
                                            ::testing::Bool()),
                         [](const auto& info) {
                           return strata::testing::test_name(std::get<0>(info.param)) +
                                  (std::get<1>(info.param) ? "Checkpointed" : "Stored");
                         });

}  // namespace
}  // namespace strata::model
