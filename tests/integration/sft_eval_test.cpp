// Supervised fine-tuning masks and evaluation through the trainer: the loss is the mean over
// the targets the mask marks across the whole global batch, however it is split, and eval_data
// is scored on the weights of the step.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "strata/core/file.h"
#include "strata/core/token_files.h"
#include "strata/train/config.h"
#include "strata/train/trainer.h"
#include "tests/testing/temp_dir.h"

namespace strata::train {
namespace {

namespace fs = std::filesystem;
using testing::TempDir;

// u16 tokens below 256 in a repetitive pattern a tiny model can learn, and a mask whose density
// differs from sequence to sequence, as prompts and completions of different lengths give.
void write_data(const TempDir& dir, const std::string& name, std::size_t tokens,
                bool all_ones = false) {
  std::string data, mask;
  std::uint64_t x = 42;
  for (std::size_t i = 0; i < tokens; ++i) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    const auto t = static_cast<std::uint16_t>((i * 7 + (x >> 60)) % 256);
    data += static_cast<char>(t & 0xFF);
    data += static_cast<char>(t >> 8);
    // A "prompt" of (x >> 40) % 12 tokens, then the "completion" up to the next 16-token block.
    mask += static_cast<char>(all_ones || (i % 16) >= (x >> 40) % 12 ? 1 : 0);
  }
  dir.write(name, data);
  dir.write(name + ".mask", mask);
}

Json config(const TempDir& dir) {
  Json j = Json::parse(R"({
    "model": {"vocab_size": 256, "hidden_size": 32, "intermediate_size": 48,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 64},
    "seq_len": 16, "batch_size": 4, "micro_batch_size": 4, "max_steps": 1,
    "precision": "fp32", "optimizer": {"lr": 0.01, "weight_decay": 0.1}, "grad_clip": 0,
    "threads": 1, "save_dir": ""
  })");
  if (!fs::exists(dir.file("train.u16"))) write_data(dir, "train.u16", 16 * 40 + 1);
  j["data"] = {{"path", dir.file("train.u16")}, {"format", "u16"}};
  return j;
}

std::unique_ptr<Trainer> make(const Json& j) {
  auto c = parse_train_config(j, "test config");
  EXPECT_TRUE(c.is_ok()) << c.status().message();
  auto t = Trainer::create(*c, TrainOptions{});
  EXPECT_TRUE(t.is_ok()) << t.status().message();
  return t.is_ok() ? std::move(t).value() : nullptr;
}

StepMetrics first_step(const Json& j) {
  auto t = make(j);
  if (!t) return {};
  EXPECT_TRUE(t->run_steps(1).is_ok());
  return t->history().at(0);
}

TEST(LossMask, AMaskOfOnesChangesNothing) {
  TempDir dir;
  Json j = config(dir);
  write_data(dir, "ones.u16", 16 * 40 + 1, /*all_ones=*/true);
  j["data"]["path"] = dir.file("ones.u16");
  const StepMetrics masked = first_step(j);
  fs::remove(dir.file("ones.u16.mask"));
  const StepMetrics plain = first_step(j);
  EXPECT_EQ(masked.loss, plain.loss);
  EXPECT_EQ(masked.grad_norm, plain.grad_norm);
  EXPECT_EQ(plain.loss_tokens, 4 * 16);
}

TEST(LossMask, TheLossAndGradientDoNotDependOnHowTheBatchIsSplit) {
  TempDir dir;
  Json j = config(dir);
  const StepMetrics whole = first_step(j);
  EXPECT_LT(whole.loss_tokens, 4 * 16) << "the mask leaves targets out";
  EXPECT_GT(whole.loss_tokens, 0);
  // Each micro-batch's mean is weighted by its share of the batch's targets. Splitting changes
  // only the order of fp32 sums of at most 4 terms (relative error a few 2^-24); weighting the
  // micro-batches equally instead would move both by the spread of the masks' densities (tens
  // of percent here).
  for (int micro : {2, 1}) {
    Json k = j;
    k["micro_batch_size"] = micro;
    const StepMetrics split = first_step(k);
    EXPECT_EQ(split.loss_tokens, whole.loss_tokens);
    EXPECT_NEAR(split.loss, whole.loss, 1e-5 * whole.loss) << micro;
    EXPECT_NEAR(split.grad_norm, whole.grad_norm, 1e-5 * whole.grad_norm) << micro;
  }
}

TEST(LossMask, AMaskOfTheWrongLengthNamesBothFiles) {
  TempDir dir;
  Json j = config(dir);
  dir.write("train.u16.mask", std::string(10, '\1'));
  auto c = parse_train_config(j, "test config");
  ASSERT_TRUE(c.is_ok());
  auto t = Trainer::create(*c, TrainOptions{});
  ASSERT_FALSE(t.is_ok());
  EXPECT_NE(t.status().message().find("train.u16.mask has 10 entries but token file"),
            std::string::npos)
      << t.status().message();
}

TEST(LossMask, ABatchWithNoTargetIsSkipped) {
  TempDir dir;
  Json j = config(dir);
  write_data(dir, "none.u16", 16 * 40 + 1);
  dir.write("none.u16.mask", std::string(16 * 40 + 1, '\0'));
  j["data"]["path"] = dir.file("none.u16");
  const StepMetrics m = first_step(j);
  EXPECT_TRUE(m.skipped) << "no update from a batch that holds no data";
  EXPECT_EQ(m.loss_tokens, 0);
}

TEST(Eval, ABadTokenInEvalDataIsFoundBeforeTraining) {
  TempDir dir;
  Json j = config(dir);
  std::string bad(2 * (16 * 4 + 1), '\0');
  bad[2 * 20] = static_cast<char>(0xFF);
  bad[2 * 20 + 1] = static_cast<char>(0x7F);  // token 32767, outside the 256-token vocabulary
  dir.write("bad.u16", bad);
  j["eval_data"] = {{"path", dir.file("bad.u16")}, {"format", "u16"}};
  auto c = parse_train_config(j, "test config");
  ASSERT_TRUE(c.is_ok());
  auto t = Trainer::create(*c, TrainOptions{});
  ASSERT_FALSE(t.is_ok());
  EXPECT_NE(t.status().message().find("eval_data"), std::string::npos) << t.status().message();
  EXPECT_NE(t.status().message().find("32767"), std::string::npos) << t.status().message();
}

TEST(Eval, ScoresTheSameSequencesAsTrainingWithTheSameLoss) {
  TempDir dir;
  Json j = config(dir);
  // lr 0: the weights after the step are those the step's loss was computed with, and the
  // evaluation's first batch is the training batch of step 1 (the same seed, the same order).
  j["optimizer"]["lr"] = 0.0;
  j["eval_data"] = j["data"];
  j["eval_batches"] = 1;
  auto t = make(j);
  ASSERT_TRUE(t);
  ASSERT_TRUE(t->run_steps(1).is_ok());
  const StepMetrics& m = t->history().at(0);
  ASSERT_TRUE(m.eval_loss.has_value());
  EXPECT_EQ(m.eval_tokens, m.loss_tokens);
  // Both are the same fp32 means combined in double; only the order differs.
  EXPECT_NEAR(*m.eval_loss, m.loss, 1e-6 * m.loss);
  EXPECT_NEAR(*m.eval_ppl, std::exp(*m.eval_loss), 1e-9 * *m.eval_ppl);
}

TEST(Eval, RunsEveryNStepsAndAtTheEndAndGoesToTheMetrics) {
  TempDir dir;
  Json j = config(dir);
  write_data(dir, "heldout.u16", 16 * 10 + 1);
  j["eval_data"] = {{"path", dir.file("heldout.u16")}, {"format", "u16"}};
  j["eval_every"] = 2;
  j["max_steps"] = 5;
  j["micro_batch_size"] = 2;
  j["metrics_file"] = dir.file("metrics.jsonl");
  auto t = make(j);
  ASSERT_TRUE(t);
  ASSERT_TRUE(t->run().is_ok());
  std::vector<std::int64_t> evaluated;
  std::ifstream in(dir.file("metrics.jsonl"));
  std::string line;
  double first = 0, last = 0;
  while (std::getline(in, line)) {
    const Json m = Json::parse(line);
    if (!m.contains("eval_loss")) continue;
    evaluated.push_back(m["step"].get<std::int64_t>());
    // The whole file once: 10 windows in batches of 2 sequences, each with its masked targets.
    EXPECT_GT(m["eval_tokens"].get<std::int64_t>(), 0);
    EXPECT_LT(m["eval_tokens"].get<std::int64_t>(), 10 * 16);
    (first == 0 ? first : last) = m["eval_loss"].get<double>();
  }
  EXPECT_EQ(evaluated, (std::vector<std::int64_t>{2, 4, 5}));
  EXPECT_LT(last, first) << "the model learns the pattern, so held-out loss falls";
}

TEST(Eval, SettingsWithoutEvalDataAreAnError) {
  TempDir dir;
  Json j = config(dir);
  j["eval_every"] = 10;
  auto c = parse_train_config(j, "test config");
  ASSERT_FALSE(c.is_ok());
  EXPECT_NE(c.status().message().find("'eval_every': needs eval_data"), std::string::npos)
      << c.status().message();
}

}  // namespace
}  // namespace strata::train
