// Pipeline parallelism under mpirun: stages train the losses and weights of one stage to the bit
// (1F1B and interleaved, every ZeRO stage and tier, with tensor and data parallelism), checkpoints
// resume on other grids, the schedule the trace records is the schedule's, bad shapes are refused
// and a stuck stage ends the run.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "strata/build_config.h"
#include "strata/core/json.h"
#include "strata/train/config.h"
#include "strata/train/pipeline_schedule.h"
#include "tests/testing/family_models.h"
#include "tests/testing/multirank_runs.h"
#include "tests/testing/temp_dir.h"

namespace strata {
namespace {

using namespace testing;  // NOLINT: the multi-rank run helpers
namespace fs = std::filesystem;

// The multi-rank tests' model with 4 layers (a stage each at P = 4) and an evaluation set.
Json pipeline_config(const TempDir& dir, const std::string& name) {
  Json j = config(dir, name);
  j["model"]["num_hidden_layers"] = 4;
  if (!fs::exists(dir.file("eval.txt"))) {
    std::string text;
    for (int i = 0; i < 40; ++i) text += "stages hand activations down and gradients back. ";
    dir.write("eval.txt", text);
  }
  j["eval_data"] = {{"path", dir.file("eval.txt")}, {"format", "text"}};
  j["eval_batches"] = 2;
  return j;
}

std::string read_text(const std::string& path) {
  std::stringstream s;
  s << std::ifstream(path).rdbuf();
  return s.str();
}

// Trains `k` as run `name` on np ranks; expects it to end well.
void train_ok(const TempDir& dir, Json k, const std::string& name, int np,
              const std::string& extra = "") {
  k["save_dir"] = dir.file(name + "/ckpt");
  k["metrics_file"] = dir.file(name + "/metrics.jsonl");
  k["swap_paths"] = {dir.file(name + "/swap-{rank}")};
  ASSERT_EQ(run_train(dir, k, name, np, extra), 0) << read_text(dir.file(name + "/err.txt"));
}

std::vector<double> metric(const std::string& metrics, const char* key) {
  std::vector<double> out;
  std::ifstream in(metrics);
  std::string line;
  while (std::getline(in, line)) {
    const Json j = Json::parse(line);
    if (j.contains(key)) out.push_back(j[key].get<double>());
  }
  return out;
}

// The same micro-batches summed in the same order: losses, gradient norms, evaluation losses and
// weights are the reference run's bits (a resumed run's: the reference's last steps).
void expect_same_bits(const TempDir& dir, const std::string& name, const std::string& ref,
                      std::int64_t step = 3) {
  const auto metrics = [&](const std::string& run) { return dir.file(run + "/metrics.jsonl"); };
  for (const char* key : {"loss", "aux_loss", "grad_norm", "eval_loss"}) {
    const auto got = metric(metrics(name), key);
    auto want = metric(metrics(ref), key);
    if (got.size() < want.size()) want.erase(want.begin(), want.end() - got.size());
    EXPECT_EQ(got, want) << key;
  }
  EXPECT_FALSE(metric(metrics(name), "loss").empty());
  const std::string at = "/ckpt/step-0000000" + std::to_string(step) + "/model";
  const auto got = weights(dir.file(name + at)), want = weights(dir.file(ref + at));
  ASSERT_FALSE(want.empty());
  EXPECT_TRUE(got == want) << "weights differ from " << ref;
}

// Adapters trained on one stage and on two (runs `one` and `two`, saved at step `step`): the same
// losses, gradient norms, evaluation losses and adapter tensors.
void expect_same_adapters(const TempDir& dir, const std::string& two, const std::string& one,
                          std::int64_t step) {
  for (const char* key : {"loss", "grad_norm", "eval_loss"}) {
    EXPECT_EQ(metric(dir.file(two + "/metrics.jsonl"), key),
              metric(dir.file(one + "/metrics.jsonl"), key))
        << key;
  }
  const auto adapters = [&](const std::string& name) {
    return tensors(dir.file(name + "/ckpt/step-0000000" + std::to_string(step) +
                            "/adapter_model.safetensors"));
  };
  ASSERT_FALSE(adapters(one).empty());
  EXPECT_TRUE(adapters(two) == adapters(one));
}

// P = 2 and 4 stages, 1F1B and interleaved (2 chunks a stage), at every ZeRO stage with
// parameters and optimizer states on the device, the host or NVMe, checkpointed activations,
// bf16, and clipping that triggers (grad_clip 0.5 here) or not: the bits of one stage.
TEST(ZeroPipeline, StagesTrainTheBitsOfOneStage) {
  if (!STRATA_HAVE_MPI) GTEST_SKIP() << "built without MPI";
  TempDir dir;
  const Json base = pipeline_config(dir, "p1");
  struct Run {
    std::string name;
    int np;
    Json changes;
  };
  const Json none = Json::object();
  const std::vector<Run> refs = {
      {"p1", 1, none},
      {"p1-noclip", 1, {{"grad_clip", 0}}},
      {"p1-bf16", 1, {{"precision", "bf16"}}},
  };
  for (const Run& r : refs) {
    Json k = base;
    k.merge_patch(r.changes);
    train_ok(dir, k, r.name, r.np);
  }
  ASSERT_GT(metric(dir.file("p1/metrics.jsonl"), "grad_norm").front(), 0.5) << "clipping";
  const std::vector<std::pair<Run, std::string>> runs = {
      {{"p2", 2, {{"pipeline_parallel_size", 2}}}, "p1"},
      {{"p4-cpu",
        4,
        {{"pipeline_parallel_size", 4}, {"offload_optimizer", "cpu"}, {"offload_param", "cpu"}}},
       "p1"},
      {{"p2-stage1-nvme",
        2,
        {{"pipeline_parallel_size", 2}, {"zero_stage", 1}, {"offload_optimizer", "nvme"}}},
       "p1"},
      {{"p2-stage2-cpu",
        2,
        {{"pipeline_parallel_size", 2}, {"zero_stage", 2}, {"offload_optimizer", "cpu"}}},
       "p1"},
      {{"p2-nvme-ckpt",
        2,
        {{"pipeline_parallel_size", 2},
         {"offload_optimizer", "nvme"},
         {"offload_param", "nvme"},
         {"activation_checkpointing", true},
         {"activation_offload", "nvme"}}},
       "p1"},
      {{"p2-interleaved-ckpt-cpu",
        2,
        {{"pipeline_parallel_size", 2},
         {"pipeline_schedule", "interleaved"},
         {"activation_checkpointing", true},
         {"activation_offload", "cpu"},
         {"offload_optimizer", "cpu"}}},
       "p1"},
      {{"p2-interleaved", 2, {{"pipeline_parallel_size", 2}, {"pipeline_schedule", "interleaved"}}},
       "p1"},
      {{"p2-layers-1-3", 2, {{"pipeline_parallel_size", 2}, {"pipeline_layers", {1, 3}}}}, "p1"},
      {{"p2-noclip", 2, {{"pipeline_parallel_size", 2}, {"grad_clip", 0}}}, "p1-noclip"},
      {{"p2-bf16", 2, {{"pipeline_parallel_size", 2}, {"precision", "bf16"}}}, "p1-bf16"},
  };
  for (const auto& [r, ref] : runs) {
    SCOPED_TRACE(r.name);
    Json k = base;
    k.merge_patch(r.changes);
    train_ok(dir, k, r.name, r.np);
    expect_same_bits(dir, r.name, ref);
  }
  const std::string out = read_text(dir.file("p2-interleaved/out.txt"));
  EXPECT_NE(out.find("| comm 0 B, sent "), std::string::npos) << out;
  EXPECT_NE(out.find("pipeline: 2 stages, interleaved schedule (2 chunks a stage), layers 0 | 1 "
                     "|| 2 | 3 | 4 micro-batches a step"),
            std::string::npos)
      << out;
}

// The families' own tensors (biases, Qwen3's q/k norms and wider q_proj, sliding windows, Llama
// 3's rope scaling) cut into stages like any layer: 2 stages train the bits of one.
TEST(ZeroPipeline, FamiliesTrainTheBitsOfOneStage) {
  if (!STRATA_HAVE_MPI) GTEST_SKIP() << "built without MPI";
  TempDir dir;
  for (const std::string& family : families()) {
    Json k = pipeline_config(dir, "x");
    k["model"] = family_model(family, 3);
    SCOPED_TRACE(family);
    train_ok(dir, k, family + "-p1", 1);
    k["pipeline_parallel_size"] = 2;
    train_ok(dir, k, family + "-p2", 2);
    expect_same_bits(dir, family + "-p2", family + "-p1");
  }
}

// A tied embedding cut into stages: the last stage's head reads a copy the first stage sends it,
// and the head's part of each micro-batch's embedding gradient goes back to the first stage,
// where the lookup's part adds to it. 2 and 4 stages, 1F1B and interleaved, offloaded, bf16,
// with data (ZeRO 3: the first stage's ranks gather the embedding to send it) and tensor
// (vocabulary-parallel) ranks, resumed from one stage, and with adapters on a frozen or a trained
// embedding: the bits of one stage.
TEST(ZeroPipeline, TiedEmbeddingsTrainTheBitsOfOneStage) {
  if (!STRATA_HAVE_MPI) GTEST_SKIP() << "built without MPI";
  TempDir dir;
  Json base = pipeline_config(dir, "x");
  base["model"]["tie_word_embeddings"] = true;
  base["max_steps"] = 4;
  const auto with = [&](const Json& changes) {
    Json k = base;
    k.merge_patch(changes);
    return k;
  };
  const Json p2 = {{"pipeline_parallel_size", 2}};
  train_ok(dir, with({{"save_every", 2}}), "p1", 1);
  train_ok(dir, with({{"precision", "bf16"}}), "p1-bf16", 1);
  train_ok(dir, with({{"tensor_parallel_size", 2}}), "t2", 2);
  train_ok(dir, base, "d2", 2);
  const std::vector<std::tuple<std::string, int, Json, std::string>> runs = {
      {"p2", 2, p2, "p1"},
      {"d2p2", 4, p2, "d2"},
      {"p4-cpu",
       4,
       {{"pipeline_parallel_size", 4}, {"offload_param", "cpu"}, {"offload_optimizer", "cpu"}},
       "p1"},
      {"p2-interleaved-ckpt-nvme",
       2,
       {{"pipeline_parallel_size", 2},
        {"pipeline_schedule", "interleaved"},
        {"activation_checkpointing", true},
        {"offload_param", "nvme"},
        {"offload_optimizer", "nvme"}},
       "p1"},
      {"p2-bf16", 2, {{"pipeline_parallel_size", 2}, {"precision", "bf16"}}, "p1-bf16"},
      {"t2p2", 4, {{"pipeline_parallel_size", 2}, {"tensor_parallel_size", 2}}, "t2"},
  };
  for (const auto& [name, np, changes, ref] : runs) {
    SCOPED_TRACE(name);
    train_ok(dir, with(changes), name, np);
    expect_same_bits(dir, name, ref, 4);
  }
  // Resumed on two stages from one stage's checkpoint: the copy is sent before the first step.
  train_ok(dir, with(p2), "p1-on-p2", 2, "--resume " + dir.file("p1/ckpt/step-00000002"));
  expect_same_bits(dir, "p1-on-p2", "p1", 4);

  // Adapters beside a frozen embedding (its copy sent once) and beside a trained one.
  for (const Json& saved : {Json::array(), Json{"embed_tokens"}}) {
    SCOPED_TRACE(saved.dump());
    Json k = with({{"finetune",
                    {{"method", "lora"},
                     {"r", 4},
                     {"alpha", 8},
                     {"target_modules", "all-linear"},
                     {"modules_to_save", saved}}}});
    const std::string one = "lora-p1-" + std::to_string(saved.size()),
                      two = "lora-p2-" + std::to_string(saved.size());
    train_ok(dir, k, one, 1);
    k["pipeline_parallel_size"] = 2;
    train_ok(dir, k, two, 2);
    expect_same_adapters(dir, two, one, 4);
  }
}

// LoRA and QLoRA on a frozen base cut into stages: each stage trains its layers' adapters (and
// the modules saved whole beside them) to the bits of one stage.
TEST(ZeroPipeline, AdaptersTrainTheBitsOfOneStage) {
  if (!STRATA_HAVE_MPI) GTEST_SKIP() << "built without MPI";
  TempDir dir;
  for (const auto& [method, saved] :
       {std::pair{"lora", Json{"lm_head", "post_attention_layernorm"}},
        std::pair{"qlora", Json{"embed_tokens", "norm"}}}) {
    SCOPED_TRACE(method);
    Json k = pipeline_config(dir, method);
    k["finetune"] = {{"method", method},
                     {"r", 4},
                     {"alpha", 8},
                     {"target_modules", "all-linear"},
                     {"modules_to_save", saved}};
    k["offload_optimizer"] = "cpu";
    const std::string one = std::string(method) + "-p1", two = std::string(method) + "-p2";
    train_ok(dir, k, one, 1);
    k["pipeline_parallel_size"] = 2;
    train_ok(dir, k, two, 2);
    expect_same_adapters(dir, two, one, 3);
  }
}

// 3D: data x pipeline (2 x 2) and tensor x pipeline x data (2 x 2 x 2 on 8 ranks) train the bits
// of the same grid without the pipeline, and the split grid stays within the tensor-parallel
// bounds of one rank.
TEST(ZeroPipeline, ThreeDGridsTrainTheBitsOfTheirGridWithoutAPipeline) {
  if (!STRATA_HAVE_MPI) GTEST_SKIP() << "built without MPI";
  TempDir dir;
  Json base = pipeline_config(dir, "x");
  base["offload_optimizer"] = "cpu";
  const auto with = [&](Json changes) {
    Json k = base;
    k.merge_patch(changes);
    return k;
  };
  train_ok(dir, base, "one", 1);
  train_ok(dir, base, "d2", 2);
  train_ok(dir, with({{"pipeline_parallel_size", 2}}), "d2p2", 4);
  expect_same_bits(dir, "d2p2", "d2");
  train_ok(dir, with({{"tensor_parallel_size", 2}}), "t2d2", 4);
  train_ok(dir, with({{"tensor_parallel_size", 2}, {"pipeline_parallel_size", 2}}), "t2p2d2", 8);
  expect_same_bits(dir, "t2p2d2", "t2d2");
  expect_close(losses(dir.file("t2p2d2/metrics.jsonl")), losses(dir.file("one/metrics.jsonl")),
               1e-5);
  expect_weights_close(weights(dir.file("t2p2d2/ckpt/step-00000003/model")),
                       weights(dir.file("one/ckpt/step-00000003/model")),
                       base["optimizer"]["lr"].get<double>(), 3);
}

// Mixture-of-experts layers cut into stages: the load-balancing loss is one product of sums over
// every MoE layer, so each stage continues the micro-batch's per-expert counts and probability
// sums where the stage before stopped (they travel with the activations) and the last stage's
// totals go back with the gradients: in the order one stage adds them, so the losses, the aux
// losses, the norms and the weights are one stage's bits. 1F1B and interleaved, 4 stages (one of
// them Qwen3-MoE's dense layer alone), recomputed activations, ZeRO-3 offloaded, bf16; beside
// experts shared out over the data-parallel ranks (P x D x E against D x E, and resumed from one
// onto the other) and tensor ranks (P x T against T).
TEST(ZeroPipeline, MoeLayersCutIntoStagesTrainTheBitsOfOneStage) {
  if (!STRATA_HAVE_MPI) GTEST_SKIP() << "built without MPI";
  TempDir dir;
  struct Run {
    std::string name;
    int np;
    Json changes;
    std::string ref;
  };
  const Json p2 = {{"pipeline_parallel_size", 2}};
  for (const std::string& family : moe_families()) {
    SCOPED_TRACE(family);
    Json base = pipeline_config(dir, "x");
    base["model"] = family_model(family, 4);
    const auto with = [&](const Json& a, const Json& b = Json::object()) {
      Json k = base;
      k.merge_patch(a);
      k.merge_patch(b);
      return k;
    };
    const Json bf16 = {{"precision", "bf16"}},
               ep = {{"expert_parallel_size", 2}, {"save_every", 2}},
               tp = {{"tensor_parallel_size", 2}};
    const std::vector<Run> runs = {
        {"p1", 1, Json::object(), ""},
        {"p2", 2, p2, "p1"},
        {"p2-interleaved-ckpt", 2,
         with(p2, {{"pipeline_schedule", "interleaved"}, {"activation_checkpointing", true}}),
         "p1"},
        {"p4-cpu", 4,
         with(p2, {{"pipeline_parallel_size", 4},
                   {"offload_param", "cpu"},
                   {"offload_optimizer", "cpu"}}),
         "p1"},
        {"p1-bf16", 1, bf16, ""},
        {"p2-bf16", 2, with(p2, bf16), "p1-bf16"},
        {"d2e2", 2, ep, ""},
        {"p2d2e2", 4, with(p2, ep), "d2e2"},
        {"t2", 2, tp, ""},
        {"p2t2", 4, with(p2, tp), "t2"},
    };
    for (const Run& r : runs) {
      SCOPED_TRACE(r.name);
      const std::string name = family + "-" + r.name;
      train_ok(dir, with(r.changes), name, r.np);
      if (!r.ref.empty()) expect_same_bits(dir, name, family + "-" + r.ref);
    }
    // Checkpoints hold whole experts, gathered from their ranks on every stage: a run resumes
    // across the pipeline both ways and continues the bits.
    const auto resumed = [&](const std::string& from) {
      return "--resume " + dir.file(family + "-" + from + "/ckpt/step-00000002");
    };
    train_ok(dir, with(ep), family + "-p2d2e2-on-d2e2", 2, resumed("p2d2e2"));
    expect_same_bits(dir, family + "-p2d2e2-on-d2e2", family + "-d2e2");
    train_ok(dir, with(p2, ep), family + "-d2e2-on-p2d2e2", 4, resumed("d2e2"));
    expect_same_bits(dir, family + "-d2e2-on-p2d2e2", family + "-d2e2");
    // The load-balancing loss is reported, trained (coefficient 0.02) and not zero.
    const auto aux = metric(dir.file(family + "-p2/metrics.jsonl"), "aux_loss");
    ASSERT_EQ(aux.size(), 3u);
    EXPECT_GT(aux.front(), 0.5);
  }
}

// A checkpoint records its pipeline and resumes on another: 2 stages on one, one stage on 2
// (the same bits as the uninterrupted run: resharding moves values, never rounds them), and
// 2 x 2 x 2 (tensor x pipeline x data) on 8 data-parallel ranks (within the bounds of a run on
// another grid).
TEST(ZeroPipeline, CheckpointsResumeOnAnotherPipeline) {
  if (!STRATA_HAVE_MPI) GTEST_SKIP() << "built without MPI";
  TempDir dir;
  Json base = pipeline_config(dir, "x");
  base["max_steps"] = 5;
  base["offload_optimizer"] = "cpu";
  base.erase("eval_data");
  base.erase("eval_batches");
  const auto with = [&](Json changes) {
    Json k = base;
    k.merge_patch(changes);
    return k;
  };
  train_ok(dir, base, "full", 1);
  train_ok(dir, with({{"save_every", 3}, {"pipeline_parallel_size", 2}}), "save-p2", 2);
  const auto state = read_json_file(dir.file("save-p2/ckpt/step-00000003/trainer_state.json"));
  ASSERT_TRUE(state.is_ok()) << state.status().message();
  EXPECT_EQ((*state)["pipeline_parallel_size"], 2);
  EXPECT_EQ((*state)["pipeline_layers"], Json({3, 1}));
  train_ok(dir, with({{"save_every", 3}}), "save-p1", 1);
  const auto resumed = [&](const std::string& from) {
    return "--resume " + dir.file(from + "/ckpt/step-00000003");
  };
  train_ok(dir, base, "p2-on-p1", 1, resumed("save-p2"));
  expect_same_bits(dir, "p2-on-p1", "full", 5);
  train_ok(dir, with({{"pipeline_parallel_size", 2}, {"pipeline_schedule", "interleaved"}}),
           "p1-on-p2i", 2, resumed("save-p1"));
  expect_same_bits(dir, "p1-on-p2i", "full", 5);
  // The full run's last two steps: the resumed runs' metrics hold those alone.
  EXPECT_EQ(metric(dir.file("p2-on-p1/metrics.jsonl"), "loss").size(), 2u);

  train_ok(dir,
           with({{"save_every", 3},
                 {"tensor_parallel_size", 2},
                 {"pipeline_parallel_size", 2},
                 {"micro_batch_size", 1}}),
           "save-3d", 8);
  train_ok(dir, with({{"micro_batch_size", 1}}), "3d-on-d8", 8, resumed("save-3d"));
  expect_close(
      losses(dir.file("3d-on-d8/metrics.jsonl")),
      {losses(dir.file("full/metrics.jsonl"))[3], losses(dir.file("full/metrics.jsonl"))[4]}, 1e-5);
  expect_weights_close(weights(dir.file("3d-on-d8/ckpt/step-00000005/model")),
                       weights(dir.file("full/ckpt/step-00000005/model")),
                       base["optimizer"]["lr"].get<double>(), 5);

  // A pipeline that cannot have cut this model is refused, naming the file and the value.
  const std::string ckpt = dir.file("save-p2/ckpt/step-00000003");
  Json edited = *state;
  edited["pipeline_layers"] = {2, 1};
  ASSERT_TRUE(write_json_file(ckpt + "/trainer_state.json", edited).is_ok());
  Json k = base;
  k["save_dir"] = "";
  ASSERT_NE(run_train(dir, k, "bad-state", 1, "--resume " + ckpt), 0);
  const std::string err = read_text(dir.file("bad-state/err.txt"));
  EXPECT_NE(err.find("trainer_state.json: pipeline_layers [2,1] cannot cut this model over "
                     "pipeline_parallel_size 2"),
            std::string::npos)
      << err;
}

// Each stage's passes as its trace recorded them are the schedule's (strata's stage_passes), and
// the bubble the stages' traces show, on one clock, is near the theory's.
TEST(ZeroPipeline, TheTraceFollowsTheSchedule) {
  if (!STRATA_HAVE_MPI) GTEST_SKIP() << "built without MPI";
  TempDir dir;
  for (const char* schedule : {"1f1b", "interleaved"}) {
    SCOPED_TRACE(schedule);
    const std::string name = std::string("trace-") + schedule;
    Json k = pipeline_config(dir, name);
    k.erase("eval_data");
    k.erase("eval_batches");
    k["max_steps"] = 1;
    k["pipeline_parallel_size"] = 2;
    k["pipeline_schedule"] = schedule;
    k["trace_file"] = dir.file(name + "/trace-{rank}.json");
    train_ok(dir, k, name, 2);
    auto parsed = train::parse_train_config(k, "test");
    ASSERT_TRUE(parsed.is_ok()) << parsed.status().message();
    for (int stage = 0; stage < 2; ++stage) {
      auto trace = read_json_file(dir.file(name + "/trace-" + std::to_string(stage) + ".json"));
      ASSERT_TRUE(trace.is_ok()) << trace.status().message();
      std::vector<std::pair<double, std::string>> passes;
      for (const Json& e : (*trace)["traceEvents"]) {
        const std::string n = e.value("name", "");
        if (n.starts_with("forward micro-batch") || n.starts_with("backward micro-batch")) {
          passes.emplace_back(e["ts"].get<double>(), n);
        }
      }
      std::sort(passes.begin(), passes.end());
      std::vector<std::string> want;
      for (const train::PipelinePass& p :
           train::stage_passes(parsed->pipeline_schedule, parsed->pipeline_shape(1), stage)) {
        want.push_back(std::string(p.forward ? "forward" : "backward") + " micro-batch " +
                       std::to_string(p.micro_batch) + " chunk " + std::to_string(p.chunk));
      }
      std::vector<std::string> got;
      for (const auto& [ts, n] : passes) got.push_back(n);
      EXPECT_EQ(got, want) << "stage " << stage;
    }
  }
}

// Shapes the pipeline cannot run are refused before anything is allocated, naming the values.
TEST(ZeroPipeline, ShapesThatCannotRunAreRefused) {
  TempDir dir;
  const Json base = pipeline_config(dir, "x");
  const auto refusal = [&](const Json& changes) {
    Json k = base;
    k.merge_patch(changes);
    auto c = train::parse_train_config(k, "test.json");
    return c.is_ok() ? std::string("accepted") : c.status().message();
  };
  const auto expect_refused = [&](const Json& changes, const std::string& want) {
    const std::string got = refusal(changes);
    EXPECT_NE(got.find(want), std::string::npos) << got;
  };
  expect_refused({{"virtual_stages", 2}},
                 "'virtual_stages': 2 chunks a stage need pipeline_schedule \"interleaved\"");
  expect_refused({{"pipeline_schedule", "interleaved"}},
                 "\"interleaved\" needs pipeline_parallel_size above 1");
  expect_refused(
      {{"pipeline_schedule", "interleaved"}, {"pipeline_parallel_size", 2}, {"virtual_stages", 1}},
      "the interleaved schedule needs 2 or more chunks a stage, got 1");
  expect_refused({{"pipeline_parallel_size", 4}, {"pipeline_schedule", "interleaved"}},
                 "'pipeline_parallel_size': 4 x virtual_stages 2 = 8 virtual stages need at "
                 "least as many layers; the model has 4");
  expect_refused({{"pipeline_parallel_size", 2}, {"pipeline_layers", {1, 2}}},
                 "'pipeline_layers': sums to 3 layers; the model has 4");
  expect_refused({{"pipeline_parallel_size", 2}, {"pipeline_layers", {4}}},
                 "'pipeline_layers': has 1 counts; expected one per stage (2)");
  expect_refused({{"pipeline_parallel_size", 2}, {"pipeline_layers", {4, 0}}},
                 "count 1 is 0; every stage needs at least one layer");
  expect_refused({{"pipeline_parallel_size", 2}, {"pipeline_layers", {1.5, 2.5}}},
                 "'pipeline_layers': expected a list of whole numbers");
  expect_refused({{"pipeline_schedule", "gpipe"}}, "pipeline_schedule");
  expect_refused({{"parallelism", "auto"}, {"pipeline_parallel_size", 2}},
                 "'parallelism': \"auto\" chooses tensor_parallel_size, "
                 "pipeline_parallel_size and expert_parallel_size");
  expect_refused({{"parallelism", "some"}}, "parallelism");

  if (!STRATA_HAVE_MPI) GTEST_SKIP() << "built without MPI";
  // The grid and the step's micro-batches are known once the ranks are.
  for (const auto& [np, changes, want] :
       {std::tuple{3, Json{{"pipeline_parallel_size", 2}},
                   "pipeline_parallel_size 2 = 2 must divide the 3 ranks this run has"},
        std::tuple{2,
                   Json{{"pipeline_parallel_size", 2},
                        {"pipeline_schedule", "interleaved"},
                        {"batch_size", 6}},
                   "micro-batches 3: the interleaved schedule takes them 2 at a time (one per "
                   "stage); use a multiple of 2"}}) {
    SCOPED_TRACE(want);
    Json k = base;
    k.merge_patch(changes);
    k["save_dir"] = "";
    ASSERT_NE(run_train(dir, k, "refused", np), 0);
    const std::string err = read_text(dir.file("refused/err.txt"));
    EXPECT_NE(err.find(want), std::string::npos) << err;
  }
}

// strata estimate plans each stage: the first rank's plan, and each later stage's needs.
TEST(ZeroPipeline, EstimatePlansEveryStage) {
  TempDir dir;
  Json k = pipeline_config(dir, "est");
  k["pipeline_parallel_size"] = 2;
  dir.write("est.json", k.dump());
  const std::string out = dir.file("est.txt");
  ASSERT_EQ(run(std::string(STRATA_CLI) + " estimate " + dir.file("est.json") + " --ranks 4 >" +
                out + " 2>&1"),
            0)
      << read_text(out);
  const std::string said = read_text(out);
  EXPECT_NE(said.find("rank 0 of 4 (pipeline stage 0 of 2)"), std::string::npos) << said;
  EXPECT_NE(said.find("pipeline stage 1 (rank 2): device "), std::string::npos) << said;
  EXPECT_NE(said.find("pipeline bubble "), std::string::npos) << said;
}

// parallelism "auto" on 4 ranks: every rank runs the grid rank 0's step model chose, said once.
TEST(ZeroPipeline, AutoParallelismRunsTheChosenGrid) {
  if (!STRATA_HAVE_MPI) GTEST_SKIP() << "built without MPI";
  TempDir dir;
  Json k = pipeline_config(dir, "auto");
  k["parallelism"] = "auto";
  train_ok(dir, k, "auto", 4);
  const std::string err = read_text(dir.file("auto/err.txt"));
  EXPECT_NE(err.find("grid: tensor "), std::string::npos) << err;
  EXPECT_NE(err.find(", the fastest that fits"), std::string::npos) << err;
  EXPECT_EQ(metric(dir.file("auto/metrics.jsonl"), "loss").size(), 3u);
}

// A stage that stops for good (rank 1, the second stage, as step 3 starts) ends the run: the
// first stage's wait for its gradients times out naming the stages and the operation.
TEST(ZeroPipeline, StuckStageEndsTheRunNamingTheStagesAndTheOperation) {
  if (!STRATA_HAVE_MPI) GTEST_SKIP() << "built without MPI";
  TempDir dir;
  const FaultedRun r = run_with_fault(
      dir, "stuck-pp", "stall", 3,
      {{"pipeline_parallel_size", 2}, {"save_dir", ""}, {"model", {{"num_hidden_layers", 4}}}});
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.err.find("between pipeline stages 0 and 1"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("did not complete in time; a peer rank may have died or be stuck"),
            std::string::npos)
      << r.err;
  EXPECT_LT(r.seconds, 2 * 3 + 20) << r.err;
}

// A stage that dies (rank 1 kills itself as step 3 starts) ends the other within the timeout.
TEST(ZeroPipeline, DeadStageEndsTheRunWithinTheTimeout) {
  if (!STRATA_HAVE_MPI) GTEST_SKIP() << "built without MPI";
  TempDir dir;
  const FaultedRun r = run_with_fault(
      dir, "dead-pp", "kill", 10,
      {{"pipeline_parallel_size", 2}, {"save_dir", ""}, {"model", {{"num_hidden_layers", 4}}}});
  EXPECT_NE(r.rc, 0);
  EXPECT_LT(r.seconds, 10 + 30) << "the surviving stage did not give up within dist_timeout_s";
  EXPECT_NE(r.err.find("rank"), std::string::npos) << r.err;
}

}  // namespace
}  // namespace strata
