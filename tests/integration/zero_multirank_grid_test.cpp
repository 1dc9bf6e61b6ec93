// Tensor parallelism over ZeRO under mpirun: split layers train the losses and weights of one
// rank in every tier, their checkpoints resume on another grid, a split that cannot be is
// refused, and every family's biases and q/k norms shard and split like any tensor.

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "strata/build_config.h"
#include "strata/core/file.h"
#include "strata/core/json.h"
#include "strata/device/nf4.h"
#include "strata/model/hf_checkpoint.h"
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

// LoRA over split layers (NeMo's layout: B split over a column-parallel base, A over a
// row-parallel one), dropout included: 2 ranks (with and without sequence parallelism) and 4
// (each kv head on two) train the losses and adapters of one rank; the split run's PEFT
// checkpoint holds whole tensors, and a checkpoint resumes on the other grid (split from whole,
// whole from split) to the one-rank run's next step.
TEST(ZeroTensorParallel, LoraOverSplitLayersTrainsTheAdaptersOfOneRank) {
  if (!STRATA_HAVE_MPI) GTEST_SKIP() << "built without MPI";
  TempDir dir;
  const auto configured = [&](const std::string& name, int tensor, int steps) {
    Json k = config(dir, name);
    k["finetune"] = {{"method", "lora"},
                     {"r", 4},
                     {"alpha", 8},
                     {"dropout", 0.1},
                     {"target_modules", "all-linear"}};
    k["offload_optimizer"] = "cpu";
    k["tensor_parallel_size"] = tensor;
    k["max_steps"] = steps;
    k["save_every"] = 3;
    return k;
  };
  const auto adapters = [&](const std::string& name, int step) {
    return tensors(dir.file(name + "/ckpt/step-0000000" + std::to_string(step) +
                            "/adapter_model.safetensors"));
  };
  ASSERT_EQ(run_train(dir, configured("l1", 1, 4), "l1", 1), 0)
      << std::ifstream(dir.file("l1/err.txt")).rdbuf();
  const auto ref_loss = losses(dir.file("l1/metrics.jsonl"));
  ASSERT_EQ(ref_loss.size(), 4u);
  const double lr = configured("l1", 1, 4)["optimizer"]["lr"].get<double>();
  struct Run {
    int np, tensor;
    bool sequence_parallel;
  };
  for (const Run& r : {Run{2, 2, false}, Run{2, 2, true}, Run{4, 4, false}}) {
    const std::string name = "l" + std::to_string(r.np) + (r.sequence_parallel ? "sp" : "");
    SCOPED_TRACE(name);
    Json k = configured(name, r.tensor, 3);
    k["sequence_parallel"] = r.sequence_parallel;
    ASSERT_EQ(run_train(dir, k, name, r.np), 0)
        << std::ifstream(dir.file(name + "/err.txt")).rdbuf();
    expect_close(losses(dir.file(name + "/metrics.jsonl")),
                 std::vector<double>(ref_loss.begin(), ref_loss.begin() + 3), 1e-5);
    expect_weights_close(adapters(name, 3), adapters("l1", 3), lr, 3);
  }
  // Resumed on the other grid for the fourth step.
  for (const auto& [from, np, tensor] : {std::tuple{"l2", 1, 1}, std::tuple{"l1", 2, 2}}) {
    const std::string name = std::string("resume-") + from + "-on-" + std::to_string(np);
    SCOPED_TRACE(name);
    const std::string ckpt = dir.file(std::string(from) + "/ckpt/step-00000003");
    ASSERT_EQ(run_train(dir, configured(name, tensor, 4), name, np, "--resume " + ckpt), 0)
        << std::ifstream(dir.file(name + "/err.txt")).rdbuf();
    const auto resumed = losses(dir.file(name + "/metrics.jsonl"));
    ASSERT_FALSE(resumed.empty());
    EXPECT_NEAR(resumed.back(), ref_loss[3], 1e-5 * ref_loss[3]);
    expect_weights_close(adapters(name, 4), adapters("l1", 4), lr, 4);
  }
}

// QLoRA over split layers: each rank quantizes its own slice of every projection, so a split
// QLoRA run is a split LoRA run on the base whose projections are each slice's NF4 round trip,
// to the bit (as one rank's QLoRA is LoRA on its decoded base). Its quantized_cache keeps each
// rank's slice in a file of its own, which the next run reads instead of writing again.
TEST(ZeroTensorParallel, QloraOverSplitLayersIsLoraOnEachSlicesDecodedBase) {
  if (!STRATA_HAVE_MPI) GTEST_SKIP() << "built without MPI";
  TempDir dir;
  const Json j = config(dir, "q");
  auto parsed = model::LlamaConfig::from_json(j["model"], "config");
  ASSERT_TRUE(parsed.is_ok()) << parsed.status().message();
  const model::LlamaConfig& c = *parsed;
  constexpr int kSplit = 2;
  const model::LoraConfig lora;
  // The seeded base, and the same with every NF4 projection replaced, slice by slice, by what
  // the rank holding that slice decodes.
  const auto write_base = [&](const std::string& out, bool decoded) {
    const model::ParamLayout whole = model::ParamLayout::build(c);
    return model::write_hf_checkpoint(
        out, c, whole, DType::kF32, [&](const model::ParamGroup& g, float* dst) -> Status {
          model::init_group(c, g, 11, dst);
          if (!decoded) return Status::ok();
          for (int r = 0; r < kSplit; ++r) {
            const model::ParamLayout mine = model::ParamLayout::build(c, lora, true, {kSplit, r});
            for (const auto& grp : mine.groups()) {
              for (const auto& t : grp.tensors) {
                if (t.format != model::TensorFormat::kNf4) continue;
                const auto at = whole.find(t.name);
                if (!at || whole.group(at->group).name != g.name) continue;
                float* full = dst + at->tensor->offset_elems;
                std::vector<float> slice(static_cast<std::size_t>(t.num_elems));
                t.for_each_run(0, t.num_elems, [&](std::int64_t i, std::int64_t f, std::int64_t n) {
                  std::copy_n(full + f, n, slice.data() + i);
                });
                std::vector<std::byte> packed(device::nf4_bytes(t.num_elems));
                STRATA_RETURN_IF_ERROR(
                    device::nf4_quantize(slice.data(), t.num_elems, packed.data(), "test"));
                device::nf4_dequantize_reference(packed.data(), t.num_elems, slice.data());
                t.for_each_run(0, t.num_elems, [&](std::int64_t i, std::int64_t f, std::int64_t n) {
                  std::copy_n(slice.data() + i, n, full + f);
                });
              }
            }
          }
          return Status::ok();
        });
  };
  ASSERT_TRUE(write_base(dir.file("base"), false).is_ok());
  ASSERT_TRUE(write_base(dir.file("decoded"), true).is_ok());
  const auto configured = [&](const std::string& name, const char* method,
                              const std::string& base) {
    Json k = config(dir, name);
    k["model"] = base;
    k["finetune"] = {{"method", method},
                     {"r", 4},
                     {"alpha", 8},
                     {"dropout", 0.1},
                     {"target_modules", "all-linear"}};
    k["tensor_parallel_size"] = kSplit;
    k["offload_optimizer"] = "cpu";
    return k;
  };
  const auto trained = [&](const std::string& name, const Json& k) {
    EXPECT_EQ(run_train(dir, k, name, kSplit), 0)
        << std::ifstream(dir.file(name + "/err.txt")).rdbuf();
    return std::pair{losses(dir.file(name + "/metrics.jsonl")),
                     tensors(dir.file(name + "/ckpt/step-00000003/adapter_model.safetensors"))};
  };
  const auto want = trained("lora", configured("lora", "lora", dir.file("decoded")));
  ASSERT_EQ(want.first.size(), 3u);
  Json q = configured("qlora", "qlora", dir.file("base"));
  q["finetune"]["quantized_cache"] = dir.file("nf4");
  EXPECT_EQ(trained("qlora", q), want) << "losses and adapters";

  const fs::path cache = dir.file("nf4");
  std::vector<fs::path> files;
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    for (int r = 0; r < kSplit; ++r) {
      files.push_back(cache / ("layers." + std::to_string(l) + ".tensor-" + std::to_string(r) +
                               "-of-" + std::to_string(kSplit) + ".nf4"));
    }
  }
  std::vector<std::uint64_t> written;  // a rewrite renames a new file over the old: a new inode
  for (const auto& f : files) {
    struct stat st {};
    ASSERT_EQ(::stat(f.c_str(), &st), 0) << f;
    written.push_back(st.st_ino);
  }
  q["metrics_file"] = dir.file("again/metrics.jsonl");
  q["save_dir"] = dir.file("again/ckpt");
  EXPECT_EQ(trained("again", q), want);
  std::stringstream out;
  out << std::ifstream(dir.file("again/out.txt")).rdbuf()
      << std::ifstream(dir.file("again/err.txt")).rdbuf();
  EXPECT_NE(
      out.str().find("NF4 base: " + std::to_string(c.num_hidden_layers) + " groups read from"),
      std::string::npos)
      << out.str();
  for (std::size_t i = 0; i < files.size(); ++i) {
    struct stat st {};
    ASSERT_EQ(::stat(files[i].c_str(), &st), 0) << files[i];
    EXPECT_EQ(st.st_ino, written[i]) << files[i] << " was written again";
  }
}

// A split the model or the rank count cannot take is refused, naming the value.
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
  EXPECT_EQ(
      message({{"tensor_parallel_size", 2}, {"save_dir", ""}, {"finetune", {{"method", "lora"}}}}),
      "");
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

}  // namespace
}  // namespace strata
