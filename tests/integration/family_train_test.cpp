// Each model family trains through strata train's whole path (checkpoint in, trainer, offload
// none / cpu / nvme, checkpoint out) and matches float64 PyTorch: the losses of three AdamW steps
// and the weights after them (tests/data/families/, from tools/golden/family_golden.py); the MoE
// families with their experts as parameter groups of the tiered store like any other.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <string>
#include <tuple>
#include <vector>

#include "strata/core/file.h"
#include "strata/core/json.h"
#include "strata/model/hf_checkpoint.h"
#include "strata/train/config.h"
#include "strata/train/trainer.h"
#include "tests/testing/temp_dir.h"
#include "tests/testing/test_name.h"

namespace strata::train {
namespace {

namespace fs = std::filesystem;
using testing::TempDir;

class FamilyTrainTest : public ::testing::TestWithParam<std::tuple<std::string, std::string>> {};

TEST_P(FamilyTrainTest, LossesAndWeightsMatchPyTorchAtEveryOffload) {
  const auto& [name, offload] = GetParam();
  auto read = read_json_file(std::string(STRATA_TEST_DATA_DIR) + "/families/" + name + ".json");
  ASSERT_TRUE(read.is_ok()) << read.status().to_string();
  const Json& g = read.value();
  TempDir dir;

  // The initial weights as a Hugging Face checkpoint of the family.
  auto config = model::LlamaConfig::from_json(g.at("config"), name);
  ASSERT_TRUE(config.is_ok()) << config.status().to_string();
  const model::ParamLayout layout = model::ParamLayout::build(*config);
  ASSERT_TRUE(model::write_hf_checkpoint(dir.file("init"), *config, layout, DType::kF32,
                                         [&](const model::ParamGroup& group, float* dst) {
                                           std::fill(dst, dst + group.num_elems, 0.0f);
                                           for (const auto& t : group.tensors) {
                                             const Json& w = g.at("weights").at(t.name);
                                             for (std::int64_t i = 0; i < t.num_elems; ++i) {
                                               dst[t.offset_elems + i] =
                                                   w[static_cast<std::size_t>(i)].get<float>();
                                             }
                                           }
                                           return Status::ok();
                                         })
                  .is_ok());
  // The saved config.json is the family's, with its keys.
  auto saved = read_json_file(dir.file("init/config.json"));
  ASSERT_TRUE(saved.is_ok());
  EXPECT_EQ(saved.value().at("model_type"), g.at("config").at("model_type"));
  EXPECT_EQ(saved.value().at("architectures"), g.at("config").at("architectures"));

  // The token sequence as u16; batch_size = the number of windows, so every step trains on all
  // of them, as the reference does.
  std::string tokens;
  for (const auto& t : g.at("tokens")) {
    const auto v = t.get<std::uint16_t>();
    tokens += static_cast<char>(v & 0xFF);
    tokens += static_cast<char>(v >> 8);
  }
  dir.write("tokens.u16", tokens);
  const Json& adamw = g.at("adamw");
  Json j = {{"model", dir.file("init")},
            {"data", {{"path", dir.file("tokens.u16")}, {"format", "u16"}}},
            {"seq_len", g.at("seq")},
            {"batch_size", g.at("windows")},
            // An MoE family's load-balancing loss is each forward's, as transformers computes
            // it: one micro-batch of the whole batch, as the reference runs it.
            {"micro_batch_size", config->has_moe() ? g.at("windows").get<int>() : 2},
            {"max_steps", 3},
            {"precision", "fp32"},
            {"optimizer",
             {{"lr", adamw.at("lr")},
              {"betas", adamw.at("betas")},
              {"eps", adamw.at("eps")},
              {"weight_decay", adamw.at("weight_decay")}}},
            {"grad_clip", 0.0},
            {"threads", 1},
            {"offload_optimizer", offload},
            {"offload_param", offload},
            {"swap_paths", {dir.file("swap")}},
            {"save_dir", dir.file("ckpt")}};
  fs::create_directories(dir.file("swap"));
  auto c = parse_train_config(j, "test config");
  ASSERT_TRUE(c.is_ok()) << c.status().message();
  auto trainer = Trainer::create(*c, TrainOptions{});
  ASSERT_TRUE(trainer.is_ok()) << trainer.status().message();
  ASSERT_TRUE((*trainer)->run().is_ok());

  // Losses: within 1e-4 relative (fp32 against float64; the reference's own f32 run lands within
  // f32_train_loss_error).
  const auto& history = (*trainer)->history();
  const auto& want = g.at("train_losses");
  ASSERT_EQ(history.size(), want.size());
  double worst_loss = 0, worst_weight = 0;
  for (std::size_t i = 0; i < history.size(); ++i) {
    // MoE: the reference's loss is the trained objective, the language model's plus the
    // weighted load-balancing loss, which the metrics carry apart.
    double loss = history[i].loss;
    EXPECT_EQ(history[i].aux_loss.has_value(), config->has_moe());
    if (history[i].aux_loss) loss += config->moe.aux_loss_coef * *history[i].aux_loss;
    EXPECT_NEAR(loss, want[i].get<double>(), 1e-4 * want[i].get<double>()) << "step " << i + 1;
    worst_loss = std::max(worst_loss, std::abs(loss / want[i].get<double>() - 1));
  }
  // Weights after the steps: each within 1e-4 of the tensor's largest weight, far below the
  // 2 * lr a step with a wrong gradient sign would move it; or within 8 times what the
  // reference's own float32 run is off by, where that is larger: a key bias's gradient is
  // nearly zero (softmax ignores a shift shared by all keys; only the rotation breaks it), so
  // rounding noise is a large part of it, and Adam's update follows the noise.
  auto reader = model::HfCheckpointReader::open(dir.file("ckpt/step-00000003/model"));
  ASSERT_TRUE(reader.is_ok()) << reader.status().message();
  EXPECT_EQ(reader->config().family, config->family);
  for (const auto& group : layout.groups()) {
    std::vector<float> got(static_cast<std::size_t>(group.num_elems));
    ASSERT_TRUE(reader->read_group(group, got.data()).is_ok());
    for (const auto& t : group.tensors) {
      const Json& w = g.at("trained_weights").at(t.name);
      double scale = 0;
      for (const auto& x : w) scale = std::max(scale, std::abs(x.get<double>()));
      const double bound =
          std::max(1e-4 * scale, 8 * g.at("f32_trained_weight_error").at(t.name).get<double>());
      int bad = 0;
      for (std::int64_t i = 0; i < t.num_elems; ++i) {
        const double err = std::abs(got[static_cast<std::size_t>(t.offset_elems + i)] -
                                    w[static_cast<std::size_t>(i)].get<double>());
        worst_weight = std::max(worst_weight, err / scale);
        if (!(err <= bound) && ++bad <= 3) {
          ADD_FAILURE() << t.name << "[" << i << "]: off by " << err << " (bound " << bound << ")";
        }
      }
    }
  }
  std::printf(
      "  %s, offload %s: losses within %.2e relative, weights within %.2e of each "
      "tensor's largest\n",
      name.c_str(), offload.c_str(), worst_loss, worst_weight);
}

// What MoE layers do not run with is refused naming the key: sequence parallelism. An
// expert_parallel_size that does not divide the experts, or on a dense model, is refused too;
// pipeline stages and tensor ranks are not.
TEST(MoeTrainConfigTest, WhatMoeLayersDoNotRunWithIsRefusedNamingTheKey) {
  auto read = read_json_file(std::string(STRATA_TEST_DATA_DIR) + "/families/mixtral.json");
  ASSERT_TRUE(read.is_ok());
  Json j = {{"model", read.value().at("config")},
            {"data", {{"path", "unused.txt"}, {"format", "text"}}},
            {"seq_len", 8},
            {"batch_size", 4},
            {"micro_batch_size", 1},
            {"save_dir", ""}};
  const auto error = [&](const Json& changes) {
    Json k = j;
    k.merge_patch(changes);
    auto c = parse_train_config(k, "cfg.json");
    return c.is_ok() ? std::string() : c.status().message();
  };
  ASSERT_EQ(error(Json::object()), "");
  // Cut into pipeline stages, the routing counts travel with the activations.
  EXPECT_EQ(error({{"pipeline_parallel_size", 2}}), "");
  // Tensor parallelism runs the MoE layers whole on every rank of the group, over every token:
  // not with the tokens split (sequence parallelism).
  EXPECT_EQ(error({{"tensor_parallel_size", 2}}), "");
  EXPECT_NE(error({{"tensor_parallel_size", 2}, {"sequence_parallel", true}})
                .find("'sequence_parallel': the mixture-of-experts layers of mixtral run every "
                      "token of a micro-batch on each tensor-parallel rank"),
            std::string::npos)
      << error({{"tensor_parallel_size", 2}, {"sequence_parallel", true}});
  // The experts shared out over ranks: a number that divides them (4 here).
  EXPECT_EQ(error({{"expert_parallel_size", 4}}), "");
  EXPECT_NE(error({{"expert_parallel_size", 3}})
                .find("'expert_parallel_size': 3 must divide the 4 experts of each MoE layer"),
            std::string::npos)
      << error({{"expert_parallel_size", 3}});
  // A dense model has no experts to share out.
  Json dense = j;
  dense["model"].erase("num_local_experts");
  dense["model"]["model_type"] = "mistral";
  dense["expert_parallel_size"] = 2;
  auto c = parse_train_config(dense, "cfg.json");
  ASSERT_FALSE(c.is_ok());
  EXPECT_NE(c.status().message().find("'expert_parallel_size': 2 shares out the experts of "
                                      "mixture-of-experts layers; mistral has none"),
            std::string::npos)
      << c.status().message();
}

INSTANTIATE_TEST_SUITE_P(Families, FamilyTrainTest,
                         ::testing::Combine(::testing::Values("llama3", "llama-linear", "qwen2",
                                                              "qwen2-window", "qwen3", "mistral",
                                                              "qwen3-moe", "mixtral"),
                                            ::testing::Values("none", "cpu", "nvme")),
                         [](const auto& info) {
                           return strata::testing::test_name(std::get<0>(info.param) + "_" +
                                                             std::get<1>(info.param));
                         });

}  // namespace
}  // namespace strata::train
