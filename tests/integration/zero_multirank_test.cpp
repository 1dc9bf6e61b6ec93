// Multi-rank ZeRO under mpirun: 2 and 4 ranks train the same losses and weights as 1 rank with
// the same global batch, for every stage and offload placement; checkpoints reshard across rank
// counts; a dead rank ends the run instead of hanging it.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "strata/build_config.h"
#include "strata/core/file.h"
#include "strata/core/json.h"
#include "strata/model/safetensors.h"
#include "strata/train/config.h"
#include "strata/train/estimate.h"
#include "strata/train/trainer.h"
#include "tests/testing/family_models.h"
#include "tests/testing/multirank_runs.h"
#include "tests/testing/temp_dir.h"

namespace strata {
namespace {

using namespace testing;  // NOLINT: the multi-rank run helpers
namespace fs = std::filesystem;

struct Case {
  int stage;
  std::string offload;
  // Buckets of a few KB: large groups are reduced and gathered in several collectives whose
  // pieces straddle group boundaries, so small remainders share a collective.
  bool small_buckets = false;
};
void PrintTo(const Case& c, std::ostream* os) {
  *os << "stage " << c.stage << ", offload " << c.offload
      << (c.small_buckets ? ", small buckets" : "");
}

class ZeroEquivalence : public ::testing::TestWithParam<Case> {};

TEST_P(ZeroEquivalence, SameLossesAndWeightsAsOneRank) {
  if (!STRATA_HAVE_MPI) GTEST_SKIP() << "built without MPI";
  TempDir dir;
  Json j = config(dir, "w1");
  j["zero_stage"] = GetParam().stage;
  j["offload_optimizer"] = GetParam().offload;
  if (GetParam().stage == 3) j["offload_param"] = GetParam().offload;
  if (GetParam().small_buckets) {
    j["reduce_bucket_bytes"] = "6KB";
    j["allgather_bucket_bytes"] = "5KB";
  }
  ASSERT_EQ(run_train(dir, j, "w1", 1), 0) << fs::path(dir.file("w1/err.txt"));
  const auto ref_loss = losses(dir.file("w1/metrics.jsonl"));
  const auto ref_w = weights(dir.file("w1/ckpt/step-00000003/model"));
  ASSERT_EQ(ref_loss.size(), 3u);
  for (int np : {2, 4}) {
    SCOPED_TRACE("world size " + std::to_string(np));
    expect_same_run_as(dir, j, "w" + std::to_string(np), np, ref_loss, ref_w);
  }
}

INSTANTIATE_TEST_SUITE_P(StagesAndOffload, ZeroEquivalence,
                         ::testing::Values(Case{1, "none"}, Case{1, "cpu"}, Case{1, "nvme"},
                                           Case{2, "none"}, Case{2, "cpu"}, Case{2, "nvme"},
                                           Case{3, "none"}, Case{3, "cpu"}, Case{3, "nvme"},
                                           Case{1, "none", true}, Case{2, "cpu", true},
                                           Case{3, "none", true}, Case{3, "nvme", true}),
                         [](const auto& info) {
                           return "stage" + std::to_string(info.param.stage) + "_" +
                                  info.param.offload +
                                  (info.param.small_buckets ? "_small_buckets" : "");
                         });

// A loss mask (strata tokenize's, for supervised data) and eval_data across rank counts: every
// rank counts the global batch's marked targets itself, so each micro-batch on each rank is
// weighted by its share and the losses, weights and held-out loss are those of one rank.
TEST(ZeroLossMask, SameLossesWeightsAndEvalLossOnEveryRankCount) {
  if (!STRATA_HAVE_MPI) GTEST_SKIP() << "built without MPI";
  TempDir dir;
  for (const char* name : {"sft.u16", "heldout.u16"}) {
    std::string data, mask;
    std::uint64_t x = name[0];
    for (int i = 0; i < 16 * 24 + 1; ++i) {
      x = x * 6364136223846793005ull + 1442695040888963407ull;
      const int t = (i * 5 + static_cast<int>(x >> 61)) % 256;
      data += static_cast<char>(t);
      data += '\0';
      mask += static_cast<char>((i % 16) >= static_cast<int>((x >> 40) % 12) ? 1 : 0);
    }
    dir.write(name, data);
    dir.write(std::string(name) + ".mask", mask);
  }
  Json j = config(dir, "m1");
  j["data"] = {{"path", dir.file("sft.u16")}, {"format", "u16"}};
  j["eval_data"] = {{"path", dir.file("heldout.u16")}, {"format", "u16"}};
  j["offload_optimizer"] = "cpu";
  j["offload_param"] = "cpu";
  ASSERT_EQ(run_train(dir, j, "m1", 1), 0) << std::ifstream(dir.file("m1/err.txt")).rdbuf();
  const auto ref_loss = losses(dir.file("m1/metrics.jsonl"));
  const auto ref_w = weights(dir.file("m1/ckpt/step-00000003/model"));
  auto eval_loss = [](const std::string& metrics) {
    std::ifstream in(metrics);
    std::string line, last;
    while (std::getline(in, line)) last = line;
    return Json::parse(last)["eval_loss"].get<double>();
  };
  const double ref_eval = eval_loss(dir.file("m1/metrics.jsonl"));
  for (const auto& [np, micro] : {std::pair{2, 2}, std::pair{2, 1}, std::pair{4, 1}}) {
    SCOPED_TRACE(std::to_string(np) + " ranks, micro-batch " + std::to_string(micro));
    const std::string name = "m" + std::to_string(np) + "x" + std::to_string(micro);
    Json k = j;
    k["micro_batch_size"] = micro;
    expect_same_run_as(dir, k, name, np, ref_loss, ref_w);
    EXPECT_NEAR(eval_loss(dir.file(name + "/metrics.jsonl")), ref_eval, 1e-5 * ref_eval);
  }
}

// LoRA and QLoRA over ranks: the adapters and the modules saved whole beside them are sharded
// like any trainable group (ZeRO-3 here), the frozen base is read by every rank (QLoRA's NF4
// groups whole on each); 2 and 4 ranks train the losses and adapters of one rank.
TEST(ZeroAdapters, LoraAndQloraTrainTheSameAdaptersOnEveryRankCount) {
  if (!STRATA_HAVE_MPI) GTEST_SKIP() << "built without MPI";
  for (const auto& [method, saved] :
       {std::pair{"lora", Json{"lm_head", "post_attention_layernorm"}},
        std::pair{"qlora", Json{"embed_tokens", "norm", "input_layernorm"}}}) {
    SCOPED_TRACE(method);
    TempDir dir;
    Json j = config(dir, "a1");
    j["finetune"] = {{"method", method},
                     {"r", 4},
                     {"alpha", 8},
                     {"target_modules", "all-linear"},
                     {"modules_to_save", saved}};
    j["offload_param"] = "cpu";
    j["offload_optimizer"] = "cpu";
    j["zero_stage"] = 3;
    const auto adapters = [&](const std::string& name) {
      return tensors(dir.file(name + "/ckpt/step-00000003/adapter_model.safetensors"));
    };
    ASSERT_EQ(run_train(dir, j, "a1", 1), 0) << std::ifstream(dir.file("a1/err.txt")).rdbuf();
    const auto ref_loss = losses(dir.file("a1/metrics.jsonl"));
    const auto ref_a = adapters("a1");
    ASSERT_FALSE(ref_a.empty());
    for (const auto& [np, micro] : {std::pair{2, 2}, std::pair{4, 1}}) {
      SCOPED_TRACE(std::to_string(np) + " ranks");
      const std::string name = "a" + std::to_string(np);
      Json k = j;
      k["micro_batch_size"] = micro;
      k["save_dir"] = dir.file(name + "/ckpt");
      k["metrics_file"] = dir.file(name + "/metrics.jsonl");
      k["swap_paths"] = {dir.file(name + "/swap-{rank}")};
      ASSERT_EQ(run_train(dir, k, name, np), 0)
          << std::ifstream(dir.file(name + "/err.txt")).rdbuf();
      expect_close(losses(dir.file(name + "/metrics.jsonl")), ref_loss, 1e-5);
      expect_weights_close(adapters(name), ref_a, j["optimizer"]["lr"].get<double>(), 3);
    }
  }
}

// Tensor parallelism inside ZeRO: 2 ranks splitting every layer (at every ZeRO stage, with
// parameters and optimizer states on the device, the host or NVMe), 2 x 2 (data x tensor,
// offloaded to the host) and 4 ranks splitting every layer (each of the 2 kv heads on 2 ranks),
// with and without sequence parallelism,
// train the losses and the 3-step weights of one rank, gradient clipping included (each duplicate
// counted once in the norm), and their checkpoints hold the same whole tensors. The bounds are the
// data-parallel runs': a split sums each product in another order, as ranks and BLAS kernels do.
TEST(ZeroTensorParallel, SplitLayersTrainTheLossesAndWeightsOfOneRank) {
  if (!STRATA_HAVE_MPI) GTEST_SKIP() << "built without MPI";
  TempDir dir;
  Json j = config(dir, "t1");
  ASSERT_EQ(run_train(dir, j, "t1", 1), 0) << std::ifstream(dir.file("t1/err.txt")).rdbuf();
  const auto ref_loss = losses(dir.file("t1/metrics.jsonl"));
  const auto ref_w = weights(dir.file("t1/ckpt/step-00000003/model"));
  ASSERT_EQ(ref_loss.size(), 3u);
  struct Run {
    int np, tensor, stage;
    const char* offload;
    bool sequence_parallel = false;
  };
  for (const Run& r :
       {Run{2, 2, 3, "none"}, Run{2, 2, 1, "none"}, Run{2, 2, 2, "cpu"}, Run{2, 2, 3, "nvme"},
        Run{4, 2, 3, "cpu"}, Run{4, 4, 3, "none"}, Run{2, 2, 3, "none", true},
        Run{4, 2, 2, "cpu", true}, Run{4, 4, 3, "nvme", true}}) {
    const std::string name = "t" + std::to_string(r.np) + "x" + std::to_string(r.tensor) +
                             "-stage" + std::to_string(r.stage) + "-" + r.offload +
                             (r.sequence_parallel ? "-sp" : "");
    SCOPED_TRACE(name);
    Json k = j;
    k["tensor_parallel_size"] = r.tensor;
    k["sequence_parallel"] = r.sequence_parallel;
    k["zero_stage"] = r.stage;
    k["offload_param"] = r.stage == 3 ? r.offload : "none";
    k["offload_optimizer"] = r.offload;
    expect_same_run_as(dir, k, name, r.np, ref_loss, ref_w);
    std::stringstream said;
    said << std::ifstream(dir.file(name + "/out.txt")).rdbuf();
    const std::string out = said.str();
    EXPECT_NE(out.find("each layer split over " + std::to_string(r.tensor)), std::string::npos)
        << out;
  }
}

// bf16: a split run's losses are the same bits whatever tier holds its state, and track the
// unsplit run's. Splitting a row-parallel product rounds each rank's partial sum to bf16 before
// the all-reduce adds them (then rounds the sum): one more rounding of 2^-8 relative per block
// output, 2 per layer plus the embedding's and the head's, moving the loss by at most that
// relative amount per rounding the first step, and compounding over the steps after it.
TEST(ZeroTensorParallel, Bf16SplitRunsAreTheSameInEveryTierAndTrackTheUnsplitOne) {
  if (!STRATA_HAVE_MPI) GTEST_SKIP() << "built without MPI";
  TempDir dir;
  const auto run_named = [&](const std::string& name, int np, int tensor, const char* offload) {
    Json k = config(dir, name);
    k["precision"] = "bf16";
    k["save_dir"] = "";
    k["tensor_parallel_size"] = tensor;
    k["offload_param"] = offload;
    k["offload_optimizer"] = offload;
    EXPECT_EQ(run_train(dir, k, name, np), 0) << std::ifstream(dir.file(name + "/err.txt")).rdbuf();
    return losses(dir.file(name + "/metrics.jsonl"));
  };
  const auto whole = run_named("whole", 1, 1, "none");
  const auto split = run_named("split", 2, 2, "none");
  ASSERT_EQ(whole.size(), 3u);
  EXPECT_EQ(run_named("split-cpu", 2, 2, "cpu"), split);
  EXPECT_EQ(run_named("split-nvme", 2, 2, "nvme"), split);
  const int layers = config(dir, "x")["model"]["num_hidden_layers"];
  const double per_step = (2 * layers + 2) * 0x1p-8;
  ASSERT_EQ(split.size(), whole.size());
  for (std::size_t i = 0; i < whole.size(); ++i) {
    EXPECT_NEAR(split[i], whole[i], static_cast<double>(i + 1) * per_step * whole[i])
        << "step " << i + 1;
  }
}

// A checkpoint records its grid and resumes on another: 2 tensor-parallel ranks on one, one
// rank on 2 tensor-parallel ranks, 2 x 2 (data x tensor) on 4 tensor-parallel ranks and on 4
// data-parallel ranks, each continuing like the uninterrupted run (its losses at 1e-5, its final
// weights within the bound above for 5 steps).
TEST(ZeroTensorParallel, CheckpointsResumeOnAnotherGrid) {
  if (!STRATA_HAVE_MPI) GTEST_SKIP() << "built without MPI";
  TempDir dir;
  const auto configured = [&](const std::string& name, int tensor) {
    Json k = config(dir, name);
    k["max_steps"] = 5;
    k["offload_optimizer"] = "cpu";
    k["tensor_parallel_size"] = tensor;
    return k;
  };
  ASSERT_EQ(run_train(dir, configured("full", 1), "full", 1), 0)
      << std::ifstream(dir.file("full/err.txt")).rdbuf();
  const auto full = losses(dir.file("full/metrics.jsonl"));
  const auto full_w = weights(dir.file("full/ckpt/step-00000005/model"));
  ASSERT_EQ(full.size(), 5u);
  const double lr = configured("full", 1)["optimizer"]["lr"].get<double>();

  struct Saved {
    int np, tensor;
  };
  struct Resumed {
    Saved from;
    int np, tensor;
  };
  for (const Saved& s : {Saved{2, 2}, Saved{1, 1}, Saved{4, 2}}) {
    const std::string name = "save" + std::to_string(s.np) + "x" + std::to_string(s.tensor);
    Json k = configured(name, s.tensor);
    k["save_every"] = 3;
    ASSERT_EQ(run_train(dir, k, name, s.np), 0)
        << std::ifstream(dir.file(name + "/err.txt")).rdbuf();
    const auto state = read_json_file(dir.file(name + "/ckpt/step-00000003/trainer_state.json"));
    ASSERT_TRUE(state.is_ok()) << state.status().message();
    EXPECT_EQ((*state)["world_size"], s.np);
    EXPECT_EQ((*state)["tensor_parallel_size"], s.tensor);
  }
  for (const Resumed& r : {Resumed{{2, 2}, 1, 1}, Resumed{{1, 1}, 2, 2}, Resumed{{4, 2}, 4, 4},
                           Resumed{{4, 2}, 4, 1}}) {
    const std::string from =
        "save" + std::to_string(r.from.np) + "x" + std::to_string(r.from.tensor);
    const std::string name = from + "-on-" + std::to_string(r.np) + "x" + std::to_string(r.tensor);
    SCOPED_TRACE(name);
    ASSERT_EQ(run_train(dir, configured(name, r.tensor), name, r.np,
                        "--resume " + dir.file(from + "/ckpt/step-00000003")),
              0)
        << std::ifstream(dir.file(name + "/err.txt")).rdbuf();
    expect_close(losses(dir.file(name + "/metrics.jsonl")), {full[3], full[4]}, 1e-5);
    expect_weights_close(weights(dir.file(name + "/ckpt/step-00000005/model")), full_w, lr, 5);
  }
  // The whole tensors of a split run's checkpoint generate like any model.
  EXPECT_EQ(run(std::string(STRATA_CLI) + " generate --model " +
                dir.file("save2x2/ckpt/step-00000003/model") +
                " --prompt-ids 1,2,3 --max-new-tokens 8 >" + dir.file("gen.txt") + " 2>&1"),
            0)
      << std::ifstream(dir.file("gen.txt")).rdbuf();

  // A grid that cannot have saved this model is refused, naming the file and the value.
  const std::string ckpt = dir.file("save1x1/ckpt/step-00000003");
  const std::string state_file = ckpt + "/trainer_state.json";
  auto state = read_json_file(state_file);
  ASSERT_TRUE(state.is_ok());
  for (const auto& [tensor, want] :
       {std::pair{3, "tensor_parallel_size 3 cannot split this model"},
        std::pair{2, "tensor_parallel_size 2 does not divide world_size 1"}}) {
    Json edited = *state;
    edited["tensor_parallel_size"] = tensor;
    ASSERT_TRUE(write_json_file(state_file, edited).is_ok());
    const std::string name = "refused" + std::to_string(tensor);
    EXPECT_NE(run_train(dir, configured(name, 1), name, 1, "--resume " + ckpt), 0);
    std::stringstream err;
    err << std::ifstream(dir.file(name + "/err.txt")).rdbuf();
    EXPECT_NE(err.str().find(want), std::string::npos) << err.str();
    EXPECT_NE(err.str().find(state_file), std::string::npos) << err.str();
  }
}

// A split the model, the method or the rank count cannot take is refused, naming the value.
TEST(ZeroTensorParallel, ASplitThatCannotBeIsRefusedNamingTheValue) {
  TempDir dir;
  Json j = config(dir, "r");
  const auto message = [&](const Json& changes) {
    Json k = j;
    k.merge_patch(changes);
    auto c = train::parse_train_config(k, "cfg.json");
    return c.is_ok() ? std::string() : c.status().message();
  };
  EXPECT_NE(message({{"tensor_parallel_size", 3}, {"save_dir", ""}})
                .find("tensor_parallel_size 3 must divide num_attention_heads (4)"),
            std::string::npos);
  EXPECT_NE(
      message({{"tensor_parallel_size", 2}, {"save_dir", ""}, {"finetune", {{"method", "lora"}}}})
          .find("LoRA and QLoRA do not split"),
      std::string::npos);
  EXPECT_NE(message({{"tensor_parallel_size", 0}}).find("tensor_parallel_size"), std::string::npos);
  EXPECT_NE(message({{"sequence_parallel", true}}).find("needs tensor_parallel_size above 1"),
            std::string::npos);
  // A micro-batch of 1 x 6 tokens does not split over 4 ranks.
  EXPECT_NE(message({{"tensor_parallel_size", 4},
                     {"sequence_parallel", true},
                     {"micro_batch_size", 1},
                     {"batch_size", 8},
                     {"seq_len", 6}})
                .find("tensor_parallel_size 4 must divide the 6 tokens of a micro-batch"),
            std::string::npos);
  // Two ranks' split on one rank.
  Json k = j;
  k["tensor_parallel_size"] = 2;
  k["save_dir"] = "";
  auto c = train::parse_train_config(k, "cfg.json");
  ASSERT_TRUE(c.is_ok()) << c.status().message();
  auto t = train::Trainer::create(*c, train::TrainOptions{});
  ASSERT_FALSE(t.is_ok());
  EXPECT_NE(t.status().message().find("tensor_parallel_size 2 must divide the 1 ranks"),
            std::string::npos)
      << t.status().message();
}

// The families' own tensors (biases, Qwen3's q/k norms, a q_proj wider than the hidden size, a
// tied embedding, sliding windows, Llama 3's rope scaling) are partitioned, gathered and reduced
// like every other, and split the same way: 2 data-parallel ranks at stage 3, 2 tensor-parallel
// ranks, and 4 with sequence parallelism train the losses and 3-step weights of 1.
TEST(ZeroFamilies, BiasesAndQkNormsShardAndSplitLikeAnyTensor) {
  if (!STRATA_HAVE_MPI) GTEST_SKIP() << "built without MPI";
  for (const std::string family : {"qwen2", "mistral", "qwen3", "llama3"}) {
    TempDir dir;
    Json j = config(dir, "f1");
    j["model"] = family_model(family, 2);
    if (family == "qwen2") j["model"]["tie_word_embeddings"] = true;  // the tied embedding
    SCOPED_TRACE(family);
    // The weight bound (expect_weights_close) holds while Adam's first step, lr g / (|g| + eps),
    // moves by at most 1% of lr for the gradient's rounding dg: lr dg / (4 eps) near g = 0, so
    // dg <= 0.04 eps. A split sums each weight gradient's terms (here up to about 1e-3) in
    // another order, rounding by about 1e-10: an element whose gradient all but cancels (one v_proj
    // weight of this Qwen3 does) exceeds 0.04 x 1e-8, not 0.04 x 1e-6.
    j["optimizer"]["eps"] = 1e-6;
    j["offload_optimizer"] = "cpu";
    j["offload_param"] = "cpu";
    ASSERT_EQ(run_train(dir, j, "f1", 1), 0) << std::ifstream(dir.file("f1/err.txt")).rdbuf();
    const auto ref_loss = losses(dir.file("f1/metrics.jsonl"));
    const auto ref_w = weights(dir.file("f1/ckpt/step-00000003/model"));
    expect_same_run_as(dir, j, "f2", 2, ref_loss, ref_w);
    // Split: 2 ranks, and 4 (each kv head on 2 ranks) with sequence parallelism.
    j["tensor_parallel_size"] = 2;
    expect_same_run_as(dir, j, "t2", 2, ref_loss, ref_w);
    j["tensor_parallel_size"] = 4;
    j["sequence_parallel"] = true;
    expect_same_run_as(dir, j, "t4", 4, ref_loss, ref_w);
  }
}

// Counts of steps that the metrics mark guessed (the update started beside backward) and redone.
std::pair<int, int> guessed_and_redone(const std::string& metrics) {
  std::pair<int, int> n{0, 0};
  std::ifstream in(metrics);
  std::string line;
  while (std::getline(in, line)) {
    const Json m = Json::parse(line);
    n.first += m.value("optimizer_guessed", false) ? 1 : 0;
    n.second += m.value("optimizer_redone", false) ? 1 : 0;
  }
  return n;
}

// Trains `changes` on np ranks under every optimizer schedule and expects the serial step's
// losses and weights to the bit, and the backward schedule's guesses and redone steps: all three
// guessed with clipping off, the first redone and the rest not guessed with it triggered.
void expect_every_schedule_bit_identical(const Json& changes, int np) {
  TempDir dir;
  std::vector<std::vector<double>> loss;
  std::vector<std::vector<float>> w;
  for (const char* mode : {"none", "forward", "backward"}) {
    Json j = config(dir, mode);
    j.merge_patch(changes);
    j["optimizer_overlap"] = mode;
    ASSERT_EQ(run_train(dir, j, mode, np), 0)
        << std::ifstream(dir.file(std::string(mode) + "/err.txt")).rdbuf();
    loss.push_back(losses(dir.file(std::string(mode) + "/metrics.jsonl")));
    w.push_back(weights(dir.file(std::string(mode) + "/ckpt/step-00000003/model")));
  }
  ASSERT_EQ(loss[0].size(), 3u);
  EXPECT_EQ(loss[1], loss[0]);
  EXPECT_EQ(loss[2], loss[0]);
  EXPECT_TRUE(w[1] == w[0]) << "weights differ (forward)";
  EXPECT_TRUE(w[2] == w[0]) << "weights differ (backward)";
  const bool clipping = changes.value("grad_clip", 0.0) != 0.0;
  const auto [guessed, redone] = guessed_and_redone(dir.file("backward/metrics.jsonl"));
  EXPECT_EQ(guessed, clipping ? 1 : 3);
  EXPECT_EQ(redone, clipping ? 1 : 0);
}

// The overlapped optimizer steps (each rank updates its shards beside the next forward, or
// beside backward as each reduction completes, guessing no clipping) give the very bits of the
// serial one on 1, 2 and 4 ranks, at every stage, with clipping off (the guess holds on every
// step) and triggered (the first step is redone and the rest not guessed).
TEST(ZeroOverlap, EveryScheduleIsBitIdenticalToTheSerialStepOnEveryRankCount) {
  if (!STRATA_HAVE_MPI) GTEST_SKIP() << "built without MPI";
  for (const Case& c : {Case{1, "cpu"}, Case{2, "cpu"}, Case{3, "cpu"}, Case{3, "nvme"}}) {
    for (int np : {1, 2, 4}) {
      for (const double clip : {0.0, 0.05}) {
        SCOPED_TRACE("stage " + std::to_string(c.stage) + ", offload " + c.offload + ", " +
                     std::to_string(np) + " ranks, grad_clip " + std::to_string(clip));
        Json changes = {
            {"zero_stage", c.stage}, {"offload_optimizer", c.offload}, {"grad_clip", clip}};
        if (c.stage == 3) changes["offload_param"] = c.offload;
        expect_every_schedule_bit_identical(changes, np);
      }
    }
  }
}

// The same with the layers split (2 tensor-parallel ranks, and 2 x 2): the schedules' guesses and
// redone steps rest on a gradient norm that sums every axis, duplicates counted once.
TEST(ZeroOverlap, SplitLayersEveryScheduleIsBitIdenticalToTheSerialStep) {
  if (!STRATA_HAVE_MPI) GTEST_SKIP() << "built without MPI";
  for (int np : {2, 4}) {
    for (const double clip : {0.0, 0.05}) {
      SCOPED_TRACE(std::to_string(np) + " ranks, grad_clip " + std::to_string(clip));
      expect_every_schedule_bit_identical({{"tensor_parallel_size", 2},
                                           {"offload_optimizer", "cpu"},
                                           {"offload_param", "cpu"},
                                           {"grad_clip", clip}},
                                          np);
    }
  }
}

// strata estimate on 2 ranks: rank 0's measured peaks (device, pinned host, NVMe, RSS) within
// 10% of what it predicts, at every stage, over placements and precisions, with buckets that
// hold the whole model and with buckets capped by a device budget; the run's own prediction is
// the one strata estimate makes for the config.
TEST(ZeroEstimate, EveryTierWithinTenPercentOfTheRunAtEveryStage) {
  if (!STRATA_HAVE_MPI) GTEST_SKIP() << "built without MPI";
  struct EstimateCase {
    int stage;
    const char* param;
    const char* optimizer;
    const char* precision;
    const char* device_limit;  // "" = none: one reduction bucket holds every gradient
  };
  const EstimateCase cases[] = {
      {1, "none", "none", "fp32", ""},      {1, "none", "nvme", "bf16", "12MiB"},
      {2, "none", "none", "bf16", "12MiB"}, {2, "none", "cpu", "fp32", ""},
      {3, "none", "none", "fp32", "12MiB"}, {3, "cpu", "cpu", "bf16", ""},
      {3, "cpu", "cpu", "fp32", "12MiB"},   {3, "nvme", "nvme", "fp32", ""},
  };
  for (const EstimateCase& c : cases) {
    const std::string name = "stage" + std::to_string(c.stage) + "-" + c.param + "-" + c.optimizer +
                             "-" + c.precision + "-" + (*c.device_limit != 0 ? "limit" : "nolimit");
    SCOPED_TRACE(name);
    TempDir dir;
    Json j = config(dir, name);
    j["model"]["hidden_size"] = 64;
    j["model"]["intermediate_size"] = 96;
    j["model"]["num_hidden_layers"] = 8;
    j["seq_len"] = 32;
    j["batch_size"] = 12;
    j["zero_stage"] = c.stage;
    j["offload_param"] = c.param;
    j["offload_optimizer"] = c.optimizer;
    j["precision"] = c.precision;
    j["save_dir"] = "";
    if (*c.device_limit != 0) j["device_memory_limit"] = c.device_limit;
    ASSERT_EQ(run_train(dir, j, name, 2), 0) << std::ifstream(dir.file(name + "/err.txt")).rdbuf();
    std::ifstream metrics(dir.file(name + "/metrics.jsonl"));
    std::string line;
    std::uint64_t device = 0, host = 0, nvme = 0, rss = 0;
    Json last;
    while (std::getline(metrics, line)) {
      last = Json::parse(line);
      device = std::max(device, last["peak_device_bytes"].get<std::uint64_t>());
      host = std::max(host, last["peak_host_bytes"].get<std::uint64_t>());
      nvme = std::max(nvme, last["peak_nvme_bytes"].get<std::uint64_t>());
      rss = std::max(rss, last["peak_rss_bytes"].get<std::uint64_t>());
    }
    ASSERT_FALSE(last.is_null());
    const auto near = [](std::uint64_t got, std::uint64_t want, const char* what) {
      EXPECT_LE(static_cast<double>(got), 1.1 * static_cast<double>(want))
          << what << ": measured " << got << ", predicted " << want;
      EXPECT_GE(static_cast<double>(got), 0.9 * static_cast<double>(want))
          << what << ": measured " << got << ", predicted " << want;
    };
    near(device, last["planned_device_bytes"].get<std::uint64_t>(), "device");
    near(host, last["planned_host_bytes"].get<std::uint64_t>(), "host");
    near(nvme, last["planned_nvme_bytes"].get<std::uint64_t>(), "nvme");
    near(rss, last["predicted_rss_bytes"].get<std::uint64_t>(), "rss");
    // The same prediction as strata estimate --ranks 2 for this config.
    auto parsed = train::parse_train_config(j, "test config");
    ASSERT_TRUE(parsed.is_ok()) << parsed.status().message();
    auto e = train::estimate(*parsed, 2);
    ASSERT_TRUE(e.is_ok()) << e.status().message();
    EXPECT_EQ(e->plan.peak(Tier::kDevice), last["planned_device_bytes"].get<std::uint64_t>());
    EXPECT_EQ(e->plan.peak(Tier::kHost), last["planned_host_bytes"].get<std::uint64_t>());
    EXPECT_GT(e->plan.collective_bytes, 0u);
  }
}

TEST(ZeroResharding, CheckpointFromTwoRanksResumesOnOneAndFour) {
  if (!STRATA_HAVE_MPI) GTEST_SKIP() << "built without MPI";
  TempDir dir;
  Json j = config(dir, "full");
  j["max_steps"] = 5;
  j["offload_optimizer"] = "cpu";
  ASSERT_EQ(run_train(dir, j, "full", 1), 0);
  const auto full = losses(dir.file("full/metrics.jsonl"));
  ASSERT_EQ(full.size(), 5u);

  Json first = config(dir, "first");
  first["max_steps"] = 5;
  first["offload_optimizer"] = "cpu";
  first["save_every"] = 3;
  ASSERT_EQ(run_train(dir, first, "first", 2, "--set max_steps=5"), 0);
  const std::string ckpt = dir.file("first/ckpt/step-00000003");
  ASSERT_TRUE(fs::exists(ckpt + "/optimizer-00001-of-00002.safetensors"));
  for (int np : {1, 4}) {
    SCOPED_TRACE("resumed with " + std::to_string(np) + " ranks");
    const std::string name = "resume" + std::to_string(np);
    Json k = config(dir, name);
    k["max_steps"] = 5;
    k["offload_optimizer"] = "cpu";
    ASSERT_EQ(run_train(dir, k, name, np, "--resume " + ckpt), 0)
        << std::ifstream(dir.file(name + "/err.txt")).rdbuf();
    const auto tail = losses(dir.file(name + "/metrics.jsonl"));
    expect_close(tail, {full[3], full[4]}, 1e-5);
  }
}

// Compact optimizer state across ranks: int8 moments and bf16 master weights with Kahan
// compensation, sharded by ZeRO 3 with the optimizer on the host and on NVMe. Shards start on
// 256-element boundaries, so each rank's 8-bit blocks are one rank's blocks; the data-parallel
// sum adds the gradients in another order, which can move a byte of the code, so the losses track
// one rank's within the 1% the compact state itself keeps to fp32 state (CompactStates tests),
// and a checkpoint of 2 ranks resumes on 1.
TEST(ZeroCompactStates, Int8MomentsAndKahanMastersShardAndReshard) {
  if (!STRATA_HAVE_MPI) GTEST_SKIP() << "built without MPI";
  TempDir dir;
  const auto compact = [&](const std::string& name, const char* offload) {
    Json j = config(dir, name);
    j["max_steps"] = 4;
    j["offload_optimizer"] = offload;
    j["optimizer"]["state_dtype"] = "int8";
    j["optimizer"]["master_dtype"] = "bf16";
    j["optimizer"]["master_rounding"] = "kahan";
    return j;
  };
  ASSERT_EQ(run_train(dir, compact("one", "cpu"), "one", 1), 0);
  const auto one = losses(dir.file("one/metrics.jsonl"));
  ASSERT_EQ(one.size(), 4u);
  for (const char* offload : {"cpu", "nvme"}) {
    SCOPED_TRACE(std::string("offload_optimizer ") + offload);
    const std::string name = std::string("two-") + offload;
    Json j = compact(name, offload);
    j["save_every"] = 2;
    ASSERT_EQ(run_train(dir, j, name, 2), 0) << std::ifstream(dir.file(name + "/err.txt")).rdbuf();
    expect_close(losses(dir.file(name + "/metrics.jsonl")), one, 1e-2);
  }
  Json back = compact("back", "cpu");
  ASSERT_EQ(run_train(dir, back, "back", 1, "--resume " + dir.file("two-cpu/ckpt/step-00000002")),
            0)
      << std::ifstream(dir.file("back/err.txt")).rdbuf();
  expect_close(losses(dir.file("back/metrics.jsonl")), {one[2], one[3]}, 1e-2);
}

// save_async on 2 ranks (ZeRO 3, the optimizer on NVMe and on the host): the saves' gathers run
// on a grid of their own beside training's collectives, and every file of each checkpoint equals
// the synchronous save's byte for byte (trainer_state.json as JSON, less the two keys the runs
// differ in).
TEST(ZeroAsyncSaves, TwoRanksWriteTheSynchronousBytes) {
  if (!STRATA_HAVE_MPI) GTEST_SKIP() << "built without MPI";
  for (const char* offload : {"nvme", "cpu"}) {
    SCOPED_TRACE(std::string("offload_optimizer ") + offload);
    TempDir dir;
    for (const bool async : {false, true}) {
      const std::string name = async ? "async" : "sync";
      Json j = config(dir, name);
      j["max_steps"] = 4;
      j["save_every"] = 1;
      j["zero_stage"] = 3;
      j["offload_optimizer"] = offload;
      j["save_async"] = async;
      ASSERT_EQ(run_train(dir, j, name, 2), 0)
          << std::ifstream(dir.file(name + "/err.txt")).rdbuf();
    }
    EXPECT_EQ(losses(dir.file("async/metrics.jsonl")), losses(dir.file("sync/metrics.jsonl")));
    for (const char* step : {"step-00000002", "step-00000004"}) {
      const std::string a = dir.file(std::string("async/ckpt/") + step);
      const std::string b = dir.file(std::string("sync/ckpt/") + step);
      // The model, both ranks' moments, the trainer state.
      EXPECT_GE(
          expect_same_checkpoint(a, b, {"save_async", "save_dir", "metrics_file", "swap_paths"}),
          5);
    }
  }
}

// A micro-batch that does not fit the rank count: the error says which one does.
TEST(ZeroFailures, MicroBatchThatDoesNotFitTheRanksSuggestsOneThatDoes) {
  if (!STRATA_HAVE_MPI) GTEST_SKIP() << "built without MPI";
  TempDir dir;
  Json j = config(dir, "fit");
  j["micro_batch_size"] = 8;  // batch_size 8 on 2 ranks: 4 per rank at most
  fs::create_directories(dir.file("fit"));
  dir.write("fit/config.json", j.dump());
  const int rc = run(mpirun(dir, 2) + STRATA_CLI + " train " + dir.file("fit/config.json") +
                     " >/dev/null 2>" + dir.file("fit/err.txt"));
  std::stringstream err;
  err << std::ifstream(dir.file("fit/err.txt")).rdbuf();
  EXPECT_NE(rc, 0);
  EXPECT_NE(err.str().find("batch_size 8 must be a multiple of micro_batch_size 8 x 2 ranks; "
                           "with 2 ranks use --set micro_batch_size=4"),
            std::string::npos)
      << err.str();
}

// Rank 1 kills itself (SIGKILL) when step 3 starts.
TEST(ZeroFailures, DeadRankEndsTheRunWithinTheTimeout) {
  if (!STRATA_HAVE_MPI) GTEST_SKIP() << "built without MPI";
  TempDir dir;
  const FaultedRun r = run_with_fault(dir, "dead", "kill", 10);
  EXPECT_NE(r.rc, 0);
  EXPECT_LT(r.seconds, 10 + 30) << "the surviving rank did not give up within dist_timeout_s";
  EXPECT_NE(r.err.find("rank"), std::string::npos) << r.err;
}

// A rank that is alive but stuck (rank 1 stops for good as step 3 starts): the other rank's
// collective times out after dist_timeout_s, it says which rank and operation, makes no MPI call
// after that (a late completion could write into buffers already freed), and the job ends.
TEST(ZeroFailures, StuckRankEndsTheRunWithATimeoutNamingTheOperation) {
  if (!STRATA_HAVE_MPI) GTEST_SKIP() << "built without MPI";
  TempDir dir;
  const FaultedRun r = run_with_fault(dir, "stuck", "stall", 3);
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.err.find("rank 0: "), std::string::npos) << r.err;
  // Each rank prints its own error; the line says whose it is.
  EXPECT_NE(r.err.find("strata train [rank 0]: "), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("did not complete in time; a peer rank may have died or be stuck"),
            std::string::npos)
      << r.err;
  // One timeout, reported once: nothing after it waited out another timeout.
  EXPECT_LT(r.seconds, 2 * 3 + 20) << r.err;
}

// The same with the layers split over both ranks: the tensor-parallel collective the other rank
// waits in ends it, named (the first of a step is the vocabulary-parallel embedding's sum).
TEST(ZeroFailures, StuckTensorParallelRankEndsTheRunNamingTheOperation) {
  if (!STRATA_HAVE_MPI) GTEST_SKIP() << "built without MPI";
  TempDir dir;
  const FaultedRun r =
      run_with_fault(dir, "stuck-tp", "stall", 3, {{"tensor_parallel_size", 2}, {"save_dir", ""}});
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.err.find("rank 0: all_reduce 'embedding'"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("did not complete in time; a peer rank may have died or be stuck"),
            std::string::npos)
      << r.err;
  EXPECT_LT(r.seconds, 2 * 3 + 20) << r.err;
}

// A device budget that runs out in backward, with collectives queued (prefetched gathers, a
// gradient bucket): every rank ends with the out-of-memory error, and tearing down does not
// free buffers that a queued collective then writes into (it did: heap corruption and SIGABRT
// after the error).
TEST(ZeroFailures, OutOfDeviceMemoryWithCollectivesInFlightEndsCleanly) {
  if (!STRATA_HAVE_MPI) GTEST_SKIP() << "built without MPI";
  TempDir dir;
  Json j = config(dir, "oom");
  j["model"] = Json::parse(R"({"vocab_size": 256, "hidden_size": 256, "intermediate_size": 688,
      "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
      "max_position_embeddings": 256})");
  j["seq_len"] = 128;
  j["micro_batch_size"] = 1;
  j["activation_checkpointing"] = true;
  j["offload_param"] = "cpu";
  j["offload_optimizer"] = "cpu";
  j["device_memory_limit"] = "20MiB";
  fs::create_directories(dir.file("oom"));
  dir.write("oom/config.json", j.dump());
  const int rc = run(mpirun(dir, 2) + STRATA_CLI + " train " + dir.file("oom/config.json") + " >" +
                     dir.file("oom/out.txt") + " 2>" + dir.file("oom/err.txt"));
  std::stringstream err;
  err << std::ifstream(dir.file("oom/err.txt")).rdbuf()
      << std::ifstream(dir.file("oom/out.txt")).rdbuf();
  EXPECT_NE(rc, 0) << "the budget no longer runs out; pick a smaller device_memory_limit";
  EXPECT_NE(err.str().find("no room on the device"), std::string::npos) << err.str();
  for (const char* crash : {"Signal:", "corrupted", "AddressSanitizer", "double free"}) {
    EXPECT_EQ(err.str().find(crash), std::string::npos) << err.str();
  }
}

}  // namespace
}  // namespace strata

namespace strata {
namespace {

using namespace testing;  // NOLINT: the multi-rank run helpers

std::string read_text(const std::string& path) {
  auto text = read_file(path);
  return text.is_ok() ? *text : "cannot read " + path;
}

// strata launch: rank 1 of 4 is killed (SIGKILL) as step 3 starts; the launcher restarts from the
// latest complete checkpoint (step 2) with the ranks left, 3, of which 2 run (a global batch of 4
// micro-batches of 2 does not split over 3), and the job finishes. The metrics hold each step
// once (1 and 2 from the first attempt, 3 to 5 from the second: the data continues with the next
// unseen batch), and steps 3-5 are the losses of a run resumed by hand from that checkpoint on 2
// ranks. A config that fits no rank count at or above --min-ranks is given up on, saying why.
TEST(ZeroElastic, LaunchRestartsOnTheRanksLeftAndContinuesAsAResumeByHand) {
  if (!STRATA_HAVE_MPI) GTEST_SKIP() << "built without MPI";
  TempDir dir;
  Json j = config(dir, "elastic");
  j["max_steps"] = 5;
  j["save_every"] = 1;
  j["dist_timeout_s"] = 30;
  dir.write("elastic.json", j.dump());
  const std::string mpirun_args =
      " --mpirun-args '--oversubscribe --bind-to none --mca btl self,vader'";
  const std::string env = "OMPI_MCA_orte_tmpdir_base=" + dir.path() + " ";
  const int rc =
      run(env + STRATA_CLI + " launch --ranks 4" + mpirun_args + " -- " + dir.file("elastic.json") +
          " --inject-fault kill:1:3 >" + dir.file("launch.out") + " 2>&1");
  const std::string out = read_text(dir.file("launch.out"));
  ASSERT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("rank(s) 1 died"), std::string::npos) << out;
  EXPECT_NE(out.find("does not split over 3, so 2 of them run"), std::string::npos) << out;
  EXPECT_NE(out.find("attempt 2: 2 rank(s), resuming from " + dir.file("elastic/ckpt") + "/latest"),
            std::string::npos)
      << out;
  std::vector<std::int64_t> steps;
  {
    std::ifstream in(dir.file("elastic/metrics.jsonl"));
    std::string line;
    while (std::getline(in, line)) steps.push_back(Json::parse(line)["step"].get<std::int64_t>());
  }
  EXPECT_EQ(steps, (std::vector<std::int64_t>{1, 2, 3, 4, 5}));
  const std::vector<double> launched = losses(dir.file("elastic/metrics.jsonl"));
  ASSERT_EQ(launched.size(), 5u);

  Json by_hand = config(dir, "by-hand");
  by_hand["max_steps"] = 5;
  dir.write("by-hand.json", by_hand.dump());
  ASSERT_EQ(run(mpirun(dir, 2) + STRATA_CLI + " train " + dir.file("by-hand.json") + " --resume " +
                dir.file("elastic/ckpt/step-00000002") + " >/dev/null 2>&1"),
            0);
  EXPECT_EQ(losses(dir.file("by-hand/metrics.jsonl")),
            std::vector<double>(launched.begin() + 2, launched.end()));

  // Nothing from 3 (--min-ranks) to 3 ranks splits the batch: no attempt runs.
  const int refused =
      run(env + STRATA_CLI + " launch --ranks 3 --min-ranks 3" + mpirun_args + " -- " +
          dir.file("elastic.json") + " >" + dir.file("refused.out") + " 2>&1");
  EXPECT_NE(refused, 0);
  EXPECT_NE(read_text(dir.file("refused.out")).find("giving up"), std::string::npos)
      << read_text(dir.file("refused.out"));

  // A hostfile's slots bound the ranks: 2 listed, 2 run.
  dir.write("hosts", "localhost slots=2  # this machine\n");
  Json listed = config(dir, "listed");
  listed["max_steps"] = 1;
  dir.write("listed.json", listed.dump());
  const int hosted =
      run(env + STRATA_CLI + " launch --ranks 4 --hostfile " + dir.file("hosts") + mpirun_args +
          " -- " + dir.file("listed.json") + " >" + dir.file("listed.out") + " 2>&1");
  EXPECT_EQ(hosted, 0) << read_text(dir.file("listed.out"));
  EXPECT_NE(read_text(dir.file("listed.out")).find("attempt 1: 2 rank(s)"), std::string::npos)
      << read_text(dir.file("listed.out"));
}

}  // namespace
}  // namespace strata
