// Mixture-of-experts models through whole training runs: the experts are parameter groups of the
// tiered store like any other, so where they live, the optimizer's schedule, recomputed or
// offloaded activations and a resume never change a bit; the metrics count the experts run and
// skipped and the bytes of those run; and data-parallel ranks whose tokens choose different
// experts train the run of one rank, in every ZeRO stage and offload (every rank gathers and
// reduces the experts some rank chose: no rank waits on a collective the others never start).

#include <map>
#include <sstream>

#include "strata/build_config.h"
#include "strata/model/param_layout.h"
#include "strata/model/peft_adapter.h"
#include "strata/model/safetensors.h"
#include "tests/integration/train_runs.h"
#include "tests/testing/family_models.h"
#include "tests/testing/multirank_runs.h"

namespace strata::train {
namespace {

// Four micro-batches of 16 tokens a step: with 16 experts and 2 picks a token, a micro-batch
// leaves some experts unchosen.
Json moe_config(const TempDir& dir, const std::string& family) {
  Json j = tiny_config(dir);
  j["model"] = testing::family_model(family, 2);
  j["micro_batch_size"] = 1;
  return j;
}

struct Placement {
  const char* param;
  const char* opt;
  const char* overlap;
  const char* activations;  // "": no checkpointing; else checkpointed, kept there
};

TEST(MoeTrain, OffloadSchedulesActivationsAndResumeKeepTheBits) {
  const Placement placements[] = {{"cpu", "cpu", "forward", ""},
                                  {"nvme", "nvme", "backward", ""},
                                  {"none", "nvme", "none", "none"},
                                  {"cpu", "cpu", "backward", "cpu"},
                                  {"nvme", "nvme", "forward", "nvme"}};
  for (const std::string& family : testing::moe_families()) {
    for (const std::string precision : {"fp32", "bf16"}) {
      SCOPED_TRACE(family + ", " + precision);
      TempDir dir;
      Json base = moe_config(dir, family);
      base["precision"] = precision;
      base["save_dir"] = dir.file("reference");
      const RunBits reference = run_bits(base);
      ASSERT_EQ(reference.losses.size(), 4u);
      for (const Placement& p : placements) {
        SCOPED_TRACE(std::string("offload_param ") + p.param + ", offload_optimizer " + p.opt +
                     ", optimizer_overlap " + p.overlap + ", activations " + p.activations);
        Json j = base;
        j["offload_param"] = p.param;
        j["offload_optimizer"] = p.opt;
        j["optimizer_overlap"] = p.overlap;
        if (*p.activations != '\0') {
          j["activation_checkpointing"] = true;
          j["activation_offload"] = p.activations;
        }
        j["save_dir"] = dir.file(std::string("run-") + p.param + p.opt + p.overlap);
        expect_same_bits(run_bits(j), reference);
      }

      // Stopped after two steps and resumed: the last two steps to the bit.
      Json first = base;
      first["save_dir"] = dir.file("resume");
      {
        auto stopped = make_trainer(first);
        ASSERT_TRUE(stopped.is_ok()) << stopped.status().message();
        ASSERT_TRUE((*stopped)->run_steps(2).is_ok());
        ASSERT_TRUE((*stopped)->save().is_ok());
      }
      auto t = make_trainer(first, dir.file("resume"));
      ASSERT_TRUE(t.is_ok()) << t.status().message();
      EXPECT_EQ((*t)->step(), 2);
      ASSERT_TRUE((*t)->run().is_ok());
      ASSERT_EQ((*t)->history().size(), 2u);
      for (std::size_t i = 0; i < 2; ++i) {
        EXPECT_EQ(std::bit_cast<std::uint64_t>((*t)->history()[i].loss), reference.losses[2 + i])
            << "resumed step " << 3 + i;
      }
    }
  }
}

// Every step counts, per MoE layer and micro-batch, the experts run and skipped (all of them
// between the two), and the bytes of each expert run once in forward and once in backward (a
// third time where the forward is recomputed).
TEST(MoeTrain, MetricsCountTheExpertsRunAndSkippedAndTheirBytes) {
  for (const bool checkpointing : {false, true}) {
    SCOPED_TRACE(checkpointing ? "activation checkpointing" : "activations kept");
    TempDir dir;
    Json j = moe_config(dir, "qwen3-moe");
    j["offload_param"] = "cpu";
    j["offload_optimizer"] = "cpu";
    j["activation_checkpointing"] = checkpointing;
    auto t = make_trainer(j);
    ASSERT_TRUE(t.is_ok()) << t.status().message();
    ASSERT_TRUE((*t)->run().is_ok());
    auto c = parse_train_config(j, "test config");
    ASSERT_TRUE(c.is_ok());
    const model::ParamLayout layout = model::ParamLayout::build(c->model);
    const std::uint64_t expert_bytes =
        model::working_bytes(layout.group(layout.expert_group(0, 0)), DType::kF32);
    // Layer 0 is an MoE layer, layer 1 dense (mlp_only_layers); 4 micro-batches a step.
    const std::int64_t experts = c->model.moe.num_experts, micro_batches = 4;
    std::int64_t skipped = 0;
    for (const auto& m : (*t)->history()) {
      SCOPED_TRACE("step " + std::to_string(m.step));
      EXPECT_EQ(m.experts_run + m.experts_skipped, micro_batches * experts);
      // A micro-batch's 16 tokens pick 2 experts each: at least 2 run.
      EXPECT_GE(m.experts_run, 2 * micro_batches);
      EXPECT_EQ(m.expert_bytes,
                static_cast<std::uint64_t>(m.experts_run) * expert_bytes * (checkpointing ? 3 : 2));
      const Json json = m.to_json();
      EXPECT_EQ(json.at("experts_run"), m.experts_run);
      EXPECT_EQ(json.at("experts_skipped"), m.experts_skipped);
      EXPECT_EQ(json.at("expert_bytes"), m.expert_bytes);
      EXPECT_NE(progress_line(m, 4).find(" | experts " + std::to_string(m.experts_run) + " run, " +
                                         std::to_string(m.experts_skipped) + " skipped"),
                std::string::npos)
          << progress_line(m, 4);
      skipped += m.experts_skipped;
    }
    EXPECT_GT(skipped, 0) << "no micro-batch left an expert unchosen: the test proves nothing";
  }
}

// Adapters on the experts alone (Mixtral's w1/w2/w3; Qwen3-MoE's gate/up/down, which also adapt
// its dense layer): the MoE layers' own adapter groups are empty and never asked for; the run
// trains, the same bits wherever the base lives, and saves the experts' adapters alone.
TEST(MoeTrain, AdaptersOnTheExpertsAloneTrainInEveryTier) {
  for (const auto& [family, targets] :
       {std::pair{"mixtral", Json{"w1", "w2", "w3"}},
        std::pair{"qwen3-moe", Json{"gate_proj", "up_proj", "down_proj"}}}) {
    SCOPED_TRACE(family);
    TempDir dir;
    Json j = moe_config(dir, family);
    j["finetune"] = {{"method", "lora"}, {"r", 4}, {"alpha", 8}, {"target_modules", targets}};
    j["optimizer"]["lr"] = 0.05;
    std::vector<double> reference;
    for (const char* tier : {"none", "cpu", "nvme"}) {
      SCOPED_TRACE(tier);
      Json k = j;
      k["offload_param"] = tier;
      k["offload_optimizer"] = std::string(tier) == "none" ? "none" : "cpu";
      k["save_dir"] = dir.file(std::string("ckpt-") + tier);
      const std::vector<double> losses = run(k);
      ASSERT_EQ(losses.size(), 4u);
      if (reference.empty()) reference = losses;
      EXPECT_EQ(losses, reference);  // bit for bit
    }
    // B starts at zero: the first step is the base's loss; the adapters then move it.
    EXPECT_NE(reference[0], reference[3]);
    auto saved = model::SafetensorsReader::open(dir.file("ckpt-none/step-00000004/") +
                                                model::kAdapterWeightsFile);
    ASSERT_TRUE(saved.is_ok()) << saved.status().to_string();
    int experts = 0;
    for (const auto& e : saved->entries()) {
      EXPECT_EQ(e.name.find("self_attn"), std::string::npos) << e.name;
      experts += e.name.find(".experts.") != std::string::npos ? 1 : 0;
    }
    EXPECT_GT(experts, 0);
  }
}

// Ranks whose micro-batches choose different experts: each rank gathers (stage 3) and reduces
// every expert some rank chose, so 2 and 4 ranks train the losses and weights of one, in every
// stage and offload, for both MoE families, fully or with LoRA on the experts.
TEST(MoeZero, RanksThatChooseDifferentExpertsTrainTheRunOfOne) {
  if (!STRATA_HAVE_MPI) GTEST_SKIP() << "built without MPI";
  struct Case {
    const char* family;
    int stage;
    const char* offload;
    bool lora = false;  // adapters on the experts (and, for Qwen3-MoE, every other projection)
  };
  for (const Case& c :
       {Case{"qwen3-moe", 3, "none"}, Case{"qwen3-moe", 3, "nvme"}, Case{"qwen3-moe", 2, "cpu"},
        Case{"qwen3-moe", 1, "none"}, Case{"mixtral", 3, "cpu"}, Case{"qwen3-moe", 3, "cpu", true},
        Case{"mixtral", 2, "none", true}}) {
    SCOPED_TRACE(std::string(c.family) + ", stage " + std::to_string(c.stage) + ", offload " +
                 c.offload + (c.lora ? ", LoRA" : ""));
    TempDir dir;
    Json j = testing::config(dir, "w1");
    j["model"] = testing::family_model(c.family, 2);
    j["micro_batch_size"] = 1;
    j["zero_stage"] = c.stage;
    j["offload_optimizer"] = c.offload;
    if (c.stage == 3) j["offload_param"] = c.offload;
    if (c.lora) {
      // Mixtral's experts alone (its layers' own adapter groups empty), Qwen3-MoE's everything
      // and its routers.
      const Json targets = std::string(c.family) == "mixtral"
                               ? Json{"w1", "w2", "w3"}
                               : Json{"q_proj",    "k_proj",  "v_proj",    "o_proj",
                                      "gate_proj", "up_proj", "down_proj", "gate"};
      j["finetune"] = {{"method", "lora"}, {"r", 4}, {"alpha", 8}, {"target_modules", targets}};
    }
    ASSERT_EQ(testing::run_train(dir, j, "w1", 1), 0)
        << std::ifstream(dir.file("w1/err.txt")).rdbuf();
    const auto ref_loss = testing::losses(dir.file("w1/metrics.jsonl"));
    // LoRA saves the adapters alone, in the checkpoint directory itself.
    const auto saved = [&](const std::string& run) {
      const std::string step = dir.file(run + "/ckpt/step-00000003");
      return c.lora ? testing::tensors(step + "/adapter_model.safetensors")
                    : testing::weights(step + "/model");
    };
    const auto ref_w = saved("w1");
    ASSERT_EQ(ref_loss.size(), 3u);
    for (int np : {2, 4}) {
      SCOPED_TRACE("world size " + std::to_string(np));
      const std::string name = "w" + std::to_string(np);
      if (!c.lora) {
        testing::expect_same_run_as(dir, j, name, np, ref_loss, ref_w);
        continue;
      }
      Json k = j;
      k["save_dir"] = dir.file(name + "/ckpt");
      k["metrics_file"] = dir.file(name + "/metrics.jsonl");
      k["swap_paths"] = {dir.file(name + "/swap-{rank}")};
      ASSERT_EQ(testing::run_train(dir, k, name, np), 0)
          << std::ifstream(dir.file(name + "/err.txt")).rdbuf();
      testing::expect_close(testing::losses(dir.file(name + "/metrics.jsonl")), ref_loss, 1e-5);
      testing::expect_weights_close(saved(name), ref_w, j["optimizer"]["lr"].get<double>(), 3);
    }
  }
}

// Runs of one test's configs under names of their own (checkpoints, metrics, swap), and the
// one-rank references they are held against, each run once.
struct NamedRuns {
  TempDir dir;
  std::map<std::string, std::pair<std::vector<double>, std::vector<float>>> references;

  Json configured(Json j, const std::string& run) const {
    j["save_dir"] = dir.file(run + "/ckpt");
    j["metrics_file"] = dir.file(run + "/metrics.jsonl");
    j["swap_paths"] = {dir.file(run + "/swap-{rank}")};
    return j;
  }
  // The step-3 checkpoint's weights, or its adapters alone.
  std::vector<float> saved(const std::string& run, bool adapters) const {
    const std::string step = dir.file(run + "/ckpt/step-00000003");
    return adapters ? testing::tensors(step + "/adapter_model.safetensors")
                    : testing::weights(step + "/model");
  }
  // `j` trained on one rank as run `ref` (once): its losses and saved weights; null if it failed.
  const std::pair<std::vector<double>, std::vector<float>>* reference(const Json& j,
                                                                      const std::string& ref,
                                                                      bool adapters) {
    if (!references.contains(ref)) {
      if (testing::run_train(dir, configured(j, ref), ref, 1) != 0) {
        ADD_FAILURE() << std::ifstream(dir.file(ref + "/err.txt")).rdbuf();
        return nullptr;
      }
      references[ref] = {testing::losses(dir.file(ref + "/metrics.jsonl")), saved(ref, adapters)};
    }
    return &references[ref];
  }
};

// Expert parallelism: runs of E data-parallel ranks share out each MoE layer's experts and send
// each token's rows to its experts' ranks. Each expert then computes its weight gradient as one
// product over the rows of E ranks' micro-batches, where one rank sums E products in the
// canonical tree: the same sums in another order, so the losses and weights are those of one
// rank within the bounds of another summation order (not to the bit). E = D (every rank its own
// experts), E < D (each expert's gradient reduced over its D / E holders, and under ZeRO-3
// gathered from them), in every stage and offload, fully and with LoRA and QLoRA on the experts,
// in fp32 and bf16, with recomputed activations, 8-bit moments and asynchronous saves; the
// checkpoints hold whole experts, so a run resumes on another E.
TEST(MoeExpertParallel, RanksSharingOutTheExpertsTrainTheRunOfOne) {
  if (!STRATA_HAVE_MPI) GTEST_SKIP() << "built without MPI";
  struct Case {
    const char* family;
    int ranks, experts, stage;
    const char* offload;
    const char* method = "full";  // or adapters on every projection: "lora", "qlora"
    const char* precision = "fp32";
    // Recomputed activations, 8-bit moments and an asynchronous save every step besides.
    bool with_the_rest = false;
  };
  NamedRuns runs;
  const TempDir& dir = runs.dir;
  for (const Case& c :
       {Case{"qwen3-moe", 2, 2, 3, "none"}, Case{"qwen3-moe", 4, 4, 1, "none"},
        Case{"qwen3-moe", 4, 2, 3, "nvme"}, Case{"mixtral", 4, 2, 2, "cpu"},
        Case{"mixtral", 4, 4, 3, "cpu"}, Case{"qwen3-moe", 4, 2, 3, "cpu", "lora"},
        Case{"mixtral", 2, 2, 2, "none", "lora"}, Case{"qwen3-moe", 2, 2, 3, "none", "qlora"},
        Case{"mixtral", 4, 4, 3, "none", "full", "bf16"},
        Case{"qwen3-moe", 4, 2, 2, "cpu", "full", "bf16"},
        Case{"qwen3-moe", 4, 2, 3, "cpu", "full", "fp32", true}}) {
    const bool lora = std::string(c.method) != "full";
    const std::string name = std::string(c.family) + "-n" + std::to_string(c.ranks) + "-e" +
                             std::to_string(c.experts) + "-s" + std::to_string(c.stage) + "-" +
                             c.offload + "-" + c.method + "-" + c.precision +
                             (c.with_the_rest ? "-rest" : "");
    SCOPED_TRACE(name);
    Json j = testing::config(dir, "unused");
    j["model"] = testing::family_model(c.family, 2);
    j["micro_batch_size"] = 1;
    j["precision"] = c.precision;
    j["zero_stage"] = c.stage;
    if (c.with_the_rest) {
      j["activation_checkpointing"] = true;
      j["optimizer"]["state_dtype"] = "int8";
      j["save_async"] = true;
      j["save_every"] = 1;
    }
    j["offload_optimizer"] = c.offload;
    if (c.stage == 3) j["offload_param"] = c.offload;
    if (lora) {
      j["finetune"] = {
          {"method", c.method}, {"r", 4}, {"alpha", 8}, {"target_modules", "all-linear"}};
    }
    // One rank with every expert: the reference of each family, with or without adapters.
    const std::string ref = std::string(c.family) + "-" + c.method + "-" + c.precision +
                            (c.with_the_rest ? "-rest" : "") + "-w1";
    const auto* reference = runs.reference(j, ref, lora);
    ASSERT_NE(reference, nullptr);
    const auto& [ref_loss, ref_w] = *reference;
    const auto saved = [&](const std::string& run) { return runs.saved(run, lora); };
    Json k = runs.configured(j, name);
    k["expert_parallel_size"] = c.experts;
    ASSERT_EQ(testing::run_train(dir, k, name, c.ranks), 0)
        << std::ifstream(dir.file(name + "/err.txt")).rdbuf();
    const std::vector<double> loss = testing::losses(dir.file(name + "/metrics.jsonl"));
    const double lr = j["optimizer"]["lr"].get<double>();
    if (std::string(c.precision) == "fp32") {
      testing::expect_close(loss, ref_loss, 1e-5);
      testing::expect_weights_close(saved(name), ref_w, lr, 3);
    } else {
      // bf16 rounds each expert's weight gradient once over E ranks' rows where one rank rounds
      // E products and sums them in f32: a relative 2^-8 of the sum apart, which for a gradient
      // that nearly cancels flips the sign of Adam's update (up to 2 lr a step apart). The
      // forward is each row's own products, so the first loss is the same bits.
      ASSERT_EQ(loss.size(), ref_loss.size());
      EXPECT_EQ(loss[0], ref_loss[0]);
      testing::expect_close(loss, ref_loss, 1e-3);
      const std::vector<float> w = saved(name);
      ASSERT_EQ(w.size(), ref_w.size());
      for (std::size_t i = 0; i < w.size(); ++i) {
        ASSERT_LE(std::abs(w[i] - ref_w[i]), 3 * (2 * lr) + 1e-6) << "weight " << i;
      }
    }
    // The tokens travelled: every rank but none sends rows to another's experts.
    std::ifstream metrics(dir.file(name + "/metrics.jsonl"));
    std::string line;
    ASSERT_TRUE(std::getline(metrics, line));
    EXPECT_GT(Json::parse(line)["all_to_all_bytes"].get<std::uint64_t>(), 0u);
  }
}

// Tensor parallelism over MoE layers: attention split over the tensor-parallel ranks, each MoE
// layer whole on every one of them (router and experts, Megatron's default), over every token,
// its gradients duplicates that count once; and over the data axis beside it, the experts shared
// out (T x E grids). The run of one rank within the bounds of another summation order, saved
// whole, with LoRA too.
TEST(MoeTensorParallel, EveryTensorRankRunsTheExpertsWholeBesideExpertParallelism) {
  if (!STRATA_HAVE_MPI) GTEST_SKIP() << "built without MPI";
  struct Case {
    const char* family;
    int ranks, tensor, experts, stage;
    bool lora = false;
  };
  NamedRuns runs;
  const TempDir& dir = runs.dir;
  for (const Case& c :
       {Case{"qwen3-moe", 2, 2, 1, 3}, Case{"mixtral", 2, 2, 1, 2}, Case{"qwen3-moe", 4, 2, 2, 3},
        Case{"mixtral", 4, 2, 2, 1}, Case{"qwen3-moe", 4, 2, 2, 3, true}}) {
    const std::string name = std::string(c.family) + "-t" + std::to_string(c.tensor) + "-e" +
                             std::to_string(c.experts) + "-s" + std::to_string(c.stage) +
                             (c.lora ? "-lora" : "");
    SCOPED_TRACE(name);
    Json j = testing::config(dir, "unused");
    j["model"] = testing::family_model(c.family, 2);
    j["micro_batch_size"] = 1;
    j["zero_stage"] = c.stage;
    if (c.lora) {  // every projection, and the routers (whole on every tensor rank)
      j["finetune"] = {
          {"method", "lora"},
          {"r", 4},
          {"alpha", 8},
          {"target_modules",
           {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "gate"}}};
    }
    const auto* reference =
        runs.reference(j, std::string(c.family) + (c.lora ? "-lora" : "") + "-w1", c.lora);
    ASSERT_NE(reference, nullptr);
    const auto& [ref_loss, ref_w] = *reference;
    const auto saved = [&](const std::string& run) { return runs.saved(run, c.lora); };
    Json k = runs.configured(j, name);
    k["tensor_parallel_size"] = c.tensor;
    k["expert_parallel_size"] = c.experts;
    ASSERT_EQ(testing::run_train(dir, k, name, c.ranks), 0)
        << std::ifstream(dir.file(name + "/err.txt")).rdbuf();
    testing::expect_close(testing::losses(dir.file(name + "/metrics.jsonl")), ref_loss, 1e-5);
    testing::expect_weights_close(saved(name), ref_w, j["optimizer"]["lr"].get<double>(), 3);
  }
}

// strata estimate plans a rank of an expert-parallel grid (its step probe times a layer on one
// rank, every expert there) and prints the exchanges in its predicted step.
TEST(MoeExpertParallel, StrataEstimatePlansARankOfTheGridAndPricesTheExchanges) {
  TempDir dir;
  Json j = testing::config(dir, "est");
  j["model"] = testing::family_model("qwen3-moe", 2);
  j["micro_batch_size"] = 1;
  j["expert_parallel_size"] = 2;
  dir.write("est.json", j.dump());
  ASSERT_EQ(testing::run(std::string(STRATA_CLI) + " estimate " + dir.file("est.json") +
                         " --ranks 4 >" + dir.file("out.txt") + " 2>&1"),
            0)
      << std::ifstream(dir.file("out.txt")).rdbuf();
  std::stringstream out;
  out << std::ifstream(dir.file("out.txt")).rdbuf();
  EXPECT_NE(out.str().find("resolved: data 4 x tensor 1 x pipeline 1, experts over 2 |"),
            std::string::npos)
      << out.str();
  EXPECT_NE(out.str().find(", expert exchanges "), std::string::npos) << out.str();
}

// A checkpoint of experts shared out over 2 ranks resumes on 1 (every expert on it), and one of
// 1 rank on 4 sharing them out: the steps after the checkpoint are the uninterrupted run's
// within the bounds of another summation order.
TEST(MoeExpertParallel, ACheckpointResumesOnAnotherExpertSplit) {
  if (!STRATA_HAVE_MPI) GTEST_SKIP() << "built without MPI";
  TempDir dir;
  Json j = testing::config(dir, "unused");
  j["model"] = testing::family_model("qwen3-moe", 2);
  j["micro_batch_size"] = 1;
  j["save_every"] = 2;
  const auto configured = [&](const std::string& run, int experts) {
    Json k = j;
    k["save_dir"] = dir.file(run + "/ckpt");
    k["metrics_file"] = dir.file(run + "/metrics.jsonl");
    k["swap_paths"] = {dir.file(run + "/swap-{rank}")};
    k["expert_parallel_size"] = experts;
    return k;
  };
  struct Run {
    const char* name;
    int ranks, experts;
    const char* from;  // the run whose step-2 checkpoint it resumes; "": from the start
  };
  for (const Run& r : {Run{"e1", 1, 1, ""}, Run{"e2", 2, 2, ""}, Run{"e2-on-e1", 1, 1, "e2"},
                       Run{"e1-on-e4", 4, 4, "e1"}, Run{"e2-on-e2n4", 4, 2, "e2"}}) {
    SCOPED_TRACE(r.name);
    const std::string resume =
        *r.from == '\0' ? "" : "--resume " + dir.file(std::string(r.from) + "/ckpt/step-00000002");
    ASSERT_EQ(testing::run_train(dir, configured(r.name, r.experts), r.name, r.ranks, resume), 0)
        << std::ifstream(dir.file(std::string(r.name) + "/err.txt")).rdbuf();
    if (*r.from == '\0') continue;
    const std::vector<double> ref = testing::losses(dir.file("e1/metrics.jsonl"));
    const std::vector<double> loss =
        testing::losses(dir.file(std::string(r.name) + "/metrics.jsonl"));
    ASSERT_FALSE(loss.empty());  // the last: step 3, after the checkpoint's two
    EXPECT_NEAR(loss.back(), ref[2], 1e-5 * std::abs(ref[2]));
    testing::expect_weights_close(
        testing::weights(dir.file(std::string(r.name) + "/ckpt/step-00000003/model")),
        testing::weights(dir.file("e1/ckpt/step-00000003/model")),
        j["optimizer"]["lr"].get<double>(), 3);
  }
}

}  // namespace
}  // namespace strata::train
