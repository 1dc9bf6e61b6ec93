// LoRA through strata train's whole path: a Hugging Face base and a PEFT adapter in, adapters
// trained on the frozen base with the base in any tier, PEFT's files out. Matches float64 PyTorch
// written from PEFT's math (tests/data/lora/, tools/golden/lora_golden.py): the losses of three
// AdamW steps and the adapters after them, with and without dropout.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "strata/core/aligned.h"
#include "strata/core/file.h"
#include "strata/core/json.h"
#include "strata/device/nf4.h"
#include "strata/model/hf_checkpoint.h"
#include "strata/model/peft_adapter.h"
#include "strata/train/config.h"
#include "strata/train/trainer.h"
#include "tests/testing/cli.h"
#include "tests/testing/temp_dir.h"
#include "tests/testing/test_name.h"

namespace strata::train {
namespace {

namespace fs = std::filesystem;
using testing::TempDir;

Json golden(const std::string& name) {
  auto read = read_json_file(std::string(STRATA_TEST_DATA_DIR) + "/lora/" + name + ".json");
  STRATA_CHECK(read.is_ok(), read.status().to_string());
  return std::move(read).value();
}

// Fills a group from a golden map of tensor name -> values (`prefix` before each name).
model::GroupSource from_json(const Json& tensors, const std::string& prefix = "") {
  return [&tensors, prefix](const model::ParamGroup& group, float* dst) {
    std::fill(dst, dst + group.num_elems, 0.0f);
    for (const auto& t : group.tensors) {
      const Json& w = tensors.at(prefix + t.name);
      for (std::int64_t i = 0; i < t.num_elems; ++i) {
        dst[t.offset_elems + i] = w[static_cast<std::size_t>(i)].get<float>();
      }
    }
    return Status::ok();
  };
}

// The golden's "lora" object holds PEFT's adapter_config.json keys.
model::LoraConfig peft_lora(const Json& j) {
  auto l = model::lora_config_from_peft(j, "golden lora");
  STRATA_CHECK(l.is_ok(), l.status().to_string());
  return *l;
}

struct LoraRun {
  std::vector<StepMetrics> history;
  std::string checkpoint;
  std::string described;  // Trainer::describe()
};

// The golden case's base (an HF checkpoint) and initial adapters (a PEFT directory) under
// `dir`, then `steps` full-batch steps; `changes` are applied to the config last.
TrainConfig train_config(const Json& g, TempDir& dir, const Json& changes, int steps) {
  auto config = model::LlamaConfig::from_json(g.at("config"), "golden");
  STRATA_CHECK(config.is_ok(), config.status().to_string());
  const Json& l = g.at("lora");
  const model::LoraConfig lora = peft_lora(l);
  if (!fs::exists(dir.file("base"))) {
    const model::ParamLayout base = model::ParamLayout::build(*config);
    STRATA_CHECK(model::write_hf_checkpoint(dir.file("base"), *config, base, DType::kF32,
                                            from_json(g.at("weights")))
                     .is_ok(),
                 "base");
    const model::ParamLayout adapted = model::ParamLayout::build(*config, lora);
    STRATA_CHECK(model::write_peft_adapter(dir.file("adapter"), lora, adapted, "base",
                                           from_json(g.at("adapters")))
                     .is_ok(),
                 "adapter");  // the adapters and the modules saved whole, at their base values
    std::string tokens;
    for (const auto& t : g.at("tokens")) {
      const auto v = t.get<std::uint16_t>();
      tokens += static_cast<char>(v & 0xFF);
      tokens += static_cast<char>(v >> 8);
    }
    dir.write("tokens.u16", tokens);
    fs::create_directories(dir.file("swap"));
  }
  const Json& adamw = g.at("adamw");
  Json j = {{"model", dir.file("base")},
            {"seed", g.at("seed")},
            {"data", {{"path", dir.file("tokens.u16")}, {"format", "u16"}}},
            {"seq_len", g.at("seq")},
            {"batch_size", g.at("windows")},
            {"micro_batch_size", g.at("windows")},  // one micro-batch: the reference's masks
            {"max_steps", steps},
            {"precision", "fp32"},
            {"optimizer",
             {{"lr", adamw.at("lr")},
              {"betas", adamw.at("betas")},
              {"eps", adamw.at("eps")},
              {"weight_decay", adamw.at("weight_decay")}}},
            {"grad_clip", 0.0},
            {"threads", 1},
            {"finetune",
             {{"method", "lora"},
              {"r", l.at("r")},
              {"alpha", l.at("lora_alpha")},
              {"dropout", l.at("lora_dropout")},
              {"target_modules", l.at("target_modules")},
              {"use_rslora", l.at("use_rslora")},
              {"modules_to_save", l.value("modules_to_save", Json())},
              {"adapter", dir.file("adapter")}}},
            {"swap_paths", {dir.file("swap")}},
            {"save_dir", dir.file("ckpt")}};
  j.merge_patch(changes);
  auto c = parse_train_config(j, "test config");
  STRATA_CHECK(c.is_ok(), c.status().message());
  return *c;
}

LoraRun train(const Json& g, TempDir& dir, const Json& changes = Json::object(), int steps = 3,
              const std::string& resume_dir = "") {
  const TrainConfig c = train_config(g, dir, changes, steps);
  TrainOptions options;
  options.resume_dir = resume_dir;
  auto trainer = Trainer::create(c, options);
  STRATA_CHECK(trainer.is_ok(), trainer.status().message());
  const Status s = (*trainer)->run();
  STRATA_CHECK(s.is_ok(), s.message());
  return LoraRun{(*trainer)->history(), (*trainer)->last_checkpoint(), (*trainer)->describe()};
}

std::vector<float> saved_adapter(const std::string& checkpoint, const std::string& name,
                                 const std::vector<std::int64_t>& shape) {
  auto r = model::SafetensorsReader::open(checkpoint + "/" + model::kAdapterWeightsFile);
  STRATA_CHECK(r.is_ok(), r.status().to_string());
  std::int64_t n = 1;
  for (auto d : shape) n *= d;
  std::vector<float> v(static_cast<std::size_t>(n));
  const Status s = r->read(model::peft_tensor_name(name), shape, v.data(), DType::kF32);
  STRATA_CHECK(s.is_ok(), s.to_string());
  return v;
}

class LoraTrainTest : public ::testing::TestWithParam<std::tuple<std::string, std::string>> {};

TEST_P(LoraTrainTest, LossesAndAdaptersMatchPyTorchWithTheBaseInAnyTier) {
  const auto& [name, tier] = GetParam();
  const Json g = golden(name);
  TempDir dir;
  const LoraRun run = train(g, dir, {{"offload_param", tier}, {"offload_optimizer", "cpu"}});
  const auto& want = g.at("train_losses");
  ASSERT_EQ(run.history.size(), want.size());
  // Losses within 8 times the reference's own float32 error, or 1e-5 relative.
  const double loss_bound = 8 * g.at("f32_train_loss_error").get<double>();
  auto config = model::LlamaConfig::from_json(g.at("config"), "golden");
  ASSERT_TRUE(config.is_ok());
  for (std::size_t i = 0; i < run.history.size(); ++i) {
    const double w = want[i].get<double>();
    // An MoE model's reference loss is the trained objective: with the weighted aux loss.
    const double got = run.history[i].loss + config->moe.aux_loss_coef *
                                                 run.history[i].aux_loss.value_or(0.0) *
                                                 (config->moe.aux_loss ? 1.0 : 0.0);
    EXPECT_NEAR(got, w, std::max(loss_bound, 1e-5 * w)) << "step " << i + 1;
  }
  // Adapters after the steps: within 1e-4 of the tensor's largest value (a step moves an
  // element by about lr = 1e-2), or 8 times the reference's float32 error where that is larger.
  const model::ParamLayout layout = model::ParamLayout::build(*config, peft_lora(g.at("lora")));
  for (const auto& [tensor, values] : g.at("trained_adapters").items()) {
    const auto loc = layout.find(tensor);
    ASSERT_TRUE(loc.has_value()) << tensor;
    EXPECT_FALSE(layout.group(loc->group).frozen) << tensor;
    const std::vector<float> got = saved_adapter(run.checkpoint, tensor, loc->tensor->shape);
    double scale = 0;
    for (const auto& x : values) scale = std::max(scale, std::abs(x.get<double>()));
    const double bound =
        std::max(1e-4 * scale, 8 * g.at("f32_trained_error").at(tensor).get<double>());
    int bad = 0;
    for (std::size_t i = 0; i < got.size(); ++i) {
      const double err = std::abs(got[i] - values[i].get<double>());
      if (!(err <= bound) && ++bad <= 3) {
        ADD_FAILURE() << tensor << "[" << i << "]: off by " << err << " (bound " << bound << ")";
      }
    }
  }
  // The base is read, never written: NVMe writes in a step are the adapters' own fp32 working
  // copies, rewritten after their update (twice when a guessed update is redone), nothing of the
  // base's, which is several times larger.
  if (tier == "nvme") {
    // Each trainable group's working copy (padded) in whole 4 KiB swap blocks.
    std::uint64_t adapter_bytes = 0;
    for (const auto& group : layout.groups()) {
      if (!group.frozen) adapter_bytes += align_up(group.num_elems * sizeof(float), 4096);
    }
    for (const StepMetrics& m : run.history) {
      EXPECT_LE(m.nvme_write_bytes, 2 * adapter_bytes) << "step " << m.step;
      EXPECT_GT(m.nvme_read_bytes, 0u) << "step " << m.step << ": the adapters live on NVMe";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cases, LoraTrainTest,
    ::testing::Combine(::testing::Values("llama3-all", "llama3-all-dropout", "llama3-qv",
                                         "qwen2-all-dropout", "qwen3-all-rslora",
                                         "mistral-mlp-dropout", "llama3-qv-save", "qwen3-all-save",
                                         "qwen2-embed-save", "qwen3-moe-all",
                                         "mixtral-experts-dropout", "qwen3-moe-router",
                                         "mixtral-router-dropout"),
                       ::testing::Values("none", "cpu", "nvme")),
    [](const auto& info) {
      return strata::testing::test_name(std::get<0>(info.param) + "_" + std::get<1>(info.param));
    });

// Wherever the base lives, and wherever the adapters' optimizer runs, the run is the same to the
// bit: losses, and the adapters saved. With the optimizer on the device the adapters stay there
// beside it, so a base on NVMe is only ever read, and, the device having room for it, once: a
// frozen base's copies stay on the device between passes (nothing rewrites them).
TEST(LoraTiersTest, BitIdenticalWhereverTheBaseLives) {
  const Json g = golden("qwen2-all-dropout");
  const std::pair<const char*, const char*> placements[] = {
      {"none", "none"}, {"cpu", "cpu"}, {"nvme", "nvme"}, {"cpu", "none"}, {"nvme", "none"}};
  for (const char* precision : {"fp32", "bf16"}) {
    SCOPED_TRACE(precision);
    std::vector<LoraRun> runs;
    std::vector<std::string> files;
    for (const auto& [param, optimizer] : placements) {
      SCOPED_TRACE(std::string(param) + "/" + optimizer);
      TempDir dir;
      runs.push_back(train(g, dir,
                           {{"offload_param", param},
                            {"offload_optimizer", optimizer},
                            {"precision", precision},
                            {"activation_checkpointing", std::string(param) == "cpu"}}));
      auto bytes = read_file(runs.back().checkpoint + "/" + model::kAdapterWeightsFile);
      ASSERT_TRUE(bytes.is_ok());
      files.push_back(*bytes);
      if (std::string(param) != "none" && std::string(optimizer) == "none") {
        EXPECT_NE(runs.back().described.find("(the trained ones on device)"), std::string::npos)
            << runs.back().described;
        for (const StepMetrics& m : runs.back().history) {
          EXPECT_EQ(m.nvme_write_bytes, 0u) << "step " << m.step;
          if (std::string(param) == "nvme" && m.step == 1) {
            EXPECT_GT(m.nvme_read_bytes, 0u) << "step " << m.step;
          } else if (std::string(param) == "nvme") {  // the device has room for the base
            EXPECT_EQ(m.nvme_read_bytes, 0u) << "step " << m.step << ": read again";
          }
        }
      }
    }
    for (std::size_t r = 1; r < runs.size(); ++r) {
      for (std::size_t i = 0; i < runs[0].history.size(); ++i) {
        EXPECT_EQ(runs[r].history[i].loss, runs[0].history[i].loss) << "run " << r;
      }
      EXPECT_EQ(files[r], files[0]) << "run " << r << ": the saved adapters differ";
    }
  }
}

// A run stopped and resumed from its LoRA checkpoint continues as if never stopped.
TEST(LoraResumeTest, ResumeFromTheAdapterCheckpointIsExact) {
  // Adapters alone, and with modules saved whole (lm_head, q_norm, a moved norm).
  for (const char* name : {"llama3-all-dropout", "qwen3-all-save"}) {
    SCOPED_TRACE(name);
    const Json g = golden(name);
    TempDir straight, split;
    const LoraRun whole = train(g, straight, Json::object(), 4);
    train(g, split, Json::object(), 2);
    const LoraRun resumed = train(g, split, Json::object(), 4, split.file("ckpt"));
    EXPECT_NE(resumed.described.find("trainable parameters"), std::string::npos)
        << resumed.described;
    EXPECT_NE(resumed.described.find("; the base's"), std::string::npos) << resumed.described;
    ASSERT_EQ(resumed.history.size(), 2u);
    EXPECT_EQ(resumed.history[0].loss, whole.history[2].loss);
    EXPECT_EQ(resumed.history[1].loss, whole.history[3].loss);
    auto a = read_file(whole.checkpoint + "/" + model::kAdapterWeightsFile);
    auto b = read_file(resumed.checkpoint + "/" + model::kAdapterWeightsFile);
    ASSERT_TRUE(a.is_ok() && b.is_ok());
    EXPECT_EQ(*a, *b);
    // The checkpoint holds the adapters, their moments and the trainer state; no copy of the
    // base.
    EXPECT_FALSE(fs::exists(resumed.checkpoint + "/model"));
    auto cfg = read_json_file(resumed.checkpoint + "/" + model::kAdapterConfigFile);
    ASSERT_TRUE(cfg.is_ok());
    EXPECT_EQ(cfg->at("peft_type"), "LORA");
    EXPECT_EQ(cfg->at("r"), g.at("lora").at("r"));
    EXPECT_EQ(cfg->at("target_modules"), g.at("lora").at("target_modules"));
    EXPECT_EQ(cfg->at("modules_to_save"), g.at("lora").at("modules_to_save"));
  }
}

// strata merge folds a LoRA run's adapter into its base; strata generate --adapter decodes with
// it unmerged: the same tokens either way, and not the base's own.
TEST(LoraMergeCliTest, MergedAndUnmergedAdapterGenerateTheSame) {
  // Adapters alone, and with the embedding and norms saved whole: the merged checkpoint holds
  // their trained values.
  // With MoE layers, every expert's adapters merge into it; Mixtral's adapter names its
  // experts' projections as PEFT does (w1, w2, w3). A router's adapter ("gate") merges into the
  // router (mlp.gate, Mixtral's block_sparse_moe.gate).
  for (const char* name :
       {"llama3-all", "llama3-qv-save", "qwen3-moe-all", "mixtral-experts-dropout",
        "qwen3-moe-router", "mixtral-router-dropout"}) {
    SCOPED_TRACE(name);
    const Json g = golden(name);
    TempDir dir;
    const LoraRun run = train(g, dir, {{"optimizer", {{"lr", 0.05}}}}, 3);
    auto adapter_config = read_json_file(run.checkpoint + "/adapter_config.json");
    ASSERT_TRUE(adapter_config.is_ok());
    const auto names = [](const Json& j) { return j.get<std::set<std::string>>(); };
    EXPECT_EQ(names(adapter_config->at("target_modules")),
              names(g.at("lora").at("target_modules")));
    const std::string gen = " --prompt-ids 1,5,9,2 --max-new-tokens 12";
    auto r = testing::run_cli(dir, "merge --model " + dir.file("base") + " --adapter " +
                                       run.checkpoint + " --output " + dir.file("merged"));
    ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
    EXPECT_TRUE(fs::exists(dir.file("merged/config.json")));
    EXPECT_TRUE(fs::exists(dir.file("merged/model.safetensors")));
    const auto merged = testing::run_cli(dir, "generate --model " + dir.file("merged") + gen);
    ASSERT_EQ(merged.exit_code, 0) << merged.err;
    const auto unmerged = testing::run_cli(
        dir, "generate --model " + dir.file("base") + " --adapter " + run.checkpoint + gen);
    ASSERT_EQ(unmerged.exit_code, 0) << unmerged.err;
    EXPECT_NE(unmerged.err.find("LoRA adapter"), std::string::npos) << unmerged.err;
    const auto base = testing::run_cli(dir, "generate --model " + dir.file("base") + gen);
    ASSERT_EQ(base.exit_code, 0) << base.err;
    EXPECT_EQ(merged.out, unmerged.out);
    EXPECT_NE(base.out, unmerged.out) << "the adapter changed nothing";
    auto merged_weights = model::SafetensorsReader::open(dir.file("merged/model.safetensors"));
    ASSERT_TRUE(merged_weights.is_ok());
    for (const auto& [tensor, init] : g.at("adapters").items()) {
      if (model::is_lora_tensor(tensor)) continue;
      const auto n = init.size();
      const std::vector<std::int64_t> shape = merged_weights->find(tensor)
                                                  ? merged_weights->find(tensor)->shape
                                                  : std::vector<std::int64_t>{};
      std::vector<float> got(n);
      ASSERT_TRUE(merged_weights->read(tensor, shape, got.data(), DType::kF32).is_ok()) << tensor;
      EXPECT_EQ(got, saved_adapter(run.checkpoint, tensor, shape)) << tensor;
    }
    // bf16 output; merging over the base itself is refused.
    r = testing::run_cli(dir, "merge --model " + dir.file("base") + " --adapter " + run.checkpoint +
                                  " --output " + dir.file("merged16") + " --dtype bf16");
    ASSERT_EQ(r.exit_code, 0) << r.err;
    auto cfg = read_json_file(dir.file("merged16/config.json"));
    ASSERT_TRUE(cfg.is_ok());
    EXPECT_EQ(cfg->at("torch_dtype"), "bfloat16");
    r = testing::run_cli(dir, "merge --model " + dir.file("base") + " --adapter " + run.checkpoint +
                                  " --output " + dir.file("base"));
    EXPECT_EQ(r.exit_code, 2);
    EXPECT_NE(r.err.find("is the base model's directory"), std::string::npos) << r.err;
  }
}

TEST(LoraConfigErrorsTest, BadKeysAreRefusedNamingTheKey) {
  const Json base = {{"model",
                      {{"vocab_size", 32},
                       {"hidden_size", 16},
                       {"intermediate_size", 24},
                       {"num_hidden_layers", 2},
                       {"num_attention_heads", 4}}},
                     {"data", {{"path", "x"}}}};
  auto message = [&](const Json& finetune) {
    Json j = base;
    j["finetune"] = finetune;
    auto c = parse_train_config(j, "cfg.json");
    return c.is_ok() ? std::string() : c.status().message();
  };
  EXPECT_NE(message({{"method", "lora"}, {"target_modules", {"q_proj", "qkv"}}}).find("\"qkv\""),
            std::string::npos);
  EXPECT_NE(message({{"method", "lora"}, {"dropout", 1.0}}).find("finetune.dropout"),
            std::string::npos);
  EXPECT_NE(message({{"method", "lora"}, {"r", 0}}).find("finetune.r"), std::string::npos);
  EXPECT_NE(message({{"method", "full"}, {"r", 8}}).find("finetune.r"), std::string::npos);
  EXPECT_NE(message({{"method", "lora"}, {"rank", 8}}).find("rank"), std::string::npos);
  EXPECT_NE(message({{"method", "qlora4"}}).find("qlora4"), std::string::npos);
  EXPECT_EQ(message({{"method", "qlora"}, {"r", 8}}), "");
  EXPECT_EQ(message({{"method", "lora"}, {"target_modules", "all-linear"}}), "");
  // "gate" is an MoE layer's router; this model has none.
  const std::string router = message({{"method", "lora"}, {"target_modules", {"q_proj", "gate"}}});
  EXPECT_NE(router.find("'finetune.target_modules': \"gate\" names an MoE layer's router"),
            std::string::npos)
      << router;
  EXPECT_EQ(message({{"method", "full"}}), "");
  // modules_to_save: names of this model's embedding, head and norms.
  EXPECT_EQ(message({{"method", "lora"}, {"modules_to_save", {"embed_tokens", "norm"}}}), "");
  const std::string proj = message({{"method", "lora"}, {"modules_to_save", {"o_proj"}}});
  EXPECT_NE(proj.find("'finetune.modules_to_save': \"o_proj\" is a projection"), std::string::npos)
      << proj;
  EXPECT_NE(message({{"method", "lora"}, {"modules_to_save", {"q_norm"}}}).find("\"q_norm\""),
            std::string::npos)
      << "no q_norm outside qwen3";
  EXPECT_NE(message({{"method", "lora"}, {"modules_to_save", "embed_tokens"}})
                .find("finetune.modules_to_save"),
            std::string::npos);
  EXPECT_NE(
      message({{"method", "full"}, {"modules_to_save", {"norm"}}}).find("finetune.modules_to_save"),
      std::string::npos);
}

TEST(LoraAdapterTest, AnAdapterTrainedWithOtherSettingsIsRefused) {
  const Json g = golden("llama3-qv");
  TempDir dir;
  train(g, dir, Json::object(), 1);
  auto c = parse_train_config(Json{{"model", dir.file("base")},
                                   {"data", {{"path", dir.file("tokens.u16")}, {"format", "u16"}}},
                                   {"seq_len", g.at("seq")},
                                   {"batch_size", 1},
                                   {"finetune",
                                    {{"method", "lora"},
                                     {"r", 4},
                                     {"target_modules", {"q_proj", "v_proj"}},
                                     {"modules_to_save", {"lm_head"}},
                                     {"adapter", dir.file("adapter")}}}},
                              "cfg");
  ASSERT_TRUE(c.is_ok()) << c.status().message();
  auto t = Trainer::create(*c, TrainOptions{});
  ASSERT_FALSE(t.is_ok());
  EXPECT_NE(t.status().message().find("finetune.r is 4, the adapter's r is 2"), std::string::npos)
      << t.status().message();
  EXPECT_NE(
      t.status().message().find("finetune.modules_to_save is [\"lm_head\"], the adapter's is []"),
      std::string::npos)
      << t.status().message();
}

// ---- QLoRA ----

// The golden case with every projection weight of the base replaced by f(name, values).
Json with_projections(const Json& g,
                      const std::function<void(const std::string&, std::vector<float>&)>& f) {
  Json out = g;
  Json& weights = out.at("weights");
  for (auto it = weights.begin(); it != weights.end(); ++it) {
    if (it.key().find("_proj.weight") == std::string::npos) continue;
    std::vector<float> v = it.value().get<std::vector<float>>();
    f(it.key(), v);
    it.value() = v;
  }
  return out;
}

// NF4 and back: what a QLoRA run computes with in fp32.
void nf4_round_trip(const std::string& name, std::vector<float>& v) {
  const auto n = static_cast<std::int64_t>(v.size());
  std::vector<std::uint8_t> packed(device::nf4_bytes(n));
  ASSERT_TRUE(device::nf4_quantize(v.data(), n, packed.data(), name.c_str()).is_ok());
  device::nf4_dequantize_reference(packed.data(), n, v.data());
}

const Json kQlora = {{"finetune", {{"method", "qlora"}}}};
// Full fine-tuning of the same golden case: the LoRA keys removed (merge patch nulls).
const Json kFull = {{"finetune",
                     {{"method", "full"},
                      {"r", nullptr},
                      {"alpha", nullptr},
                      {"dropout", nullptr},
                      {"target_modules", nullptr},
                      {"use_rslora", nullptr},
                      {"modules_to_save", nullptr},
                      {"adapter", nullptr}}}};

// ---- modules_to_save ----

// Fresh adapters (B = 0) leave the model its base, so the modules saved whole get full
// fine-tuning's gradients: after one step they hold full fine-tuning's values to the bit,
// wherever the base lives. They start from the base checkpoint's values, not the seed's.
TEST(LoraModulesTest, SavedModulesTakeFullFineTuningsFirstStepToTheBit) {
  const Json g = golden("llama3-qv-save");
  ASSERT_EQ(g.at("lora").at("lora_dropout").get<double>(), 0.0);
  TempDir full_dir;
  const LoraRun full = train(g, full_dir, kFull, 1);
  auto full_model = model::SafetensorsReader::open(full.checkpoint + "/model/model.safetensors");
  ASSERT_TRUE(full_model.is_ok()) << full_model.status().to_string();
  auto config = model::LlamaConfig::from_json(g.at("config"), "golden");
  ASSERT_TRUE(config.is_ok());
  const model::ParamLayout layout = model::ParamLayout::build(*config, peft_lora(g.at("lora")));
  for (const char* tier : {"none", "cpu", "nvme"}) {
    SCOPED_TRACE(tier);
    TempDir dir;
    const LoraRun run = train(g, dir,
                              {{"offload_param", tier},
                               {"offload_optimizer", "cpu"},
                               {"finetune", {{"adapter", nullptr}}}},
                              1);
    ASSERT_EQ(run.history.size(), 1u);
    EXPECT_EQ(run.history[0].loss, full.history[0].loss) << "the same model, the same loss";
    int modules = 0;
    for (const auto& [name, init] : g.at("adapters").items()) {
      if (model::is_lora_tensor(name)) continue;
      ++modules;
      const auto& shape = layout.find(name)->tensor->shape;
      const std::vector<float> got = saved_adapter(run.checkpoint, name, shape);
      std::vector<float> want(got.size());
      ASSERT_TRUE(full_model->read(name, shape, want.data(), DType::kF32).is_ok()) << name;
      EXPECT_EQ(got, want) << name;
      EXPECT_NE(got, init.get<std::vector<float>>()) << name << " trained";
    }
    EXPECT_EQ(modules, 4) << "embed_tokens, model.norm and two input_layernorm";
  }
}

// A QLoRA run computes with its base's NF4 weights decoded: it is a LoRA run on the decoded base,
// to the bit, in bf16 and fp32, whichever tier the quantized base lives in.
TEST(QloraTest, IsLoraOnTheDecodedBaseToTheBitInEveryTier) {
  // A dense model, and an MoE one whose experts are NF4 too (the routers stay in the compute
  // dtype, as bitsandbytes users leave the gate unquantized, and carry adapters of their own).
  for (const char* name : {"qwen2-all-dropout", "qwen3-moe-router"}) {
    const Json g = golden(name);
    const Json decoded = with_projections(g, nf4_round_trip);
    for (const char* precision : {"bf16", "fp32"}) {
      SCOPED_TRACE(std::string(name) + ", " + precision);
      TempDir lora_dir;
      const LoraRun want = train(decoded, lora_dir, {{"precision", precision}});
      auto want_file = read_file(want.checkpoint + "/" + model::kAdapterWeightsFile);
      ASSERT_TRUE(want_file.is_ok());
      for (const char* tier : {"none", "cpu", "nvme"}) {
        SCOPED_TRACE(tier);
        TempDir dir;
        Json changes = kQlora;
        changes.merge_patch({{"offload_param", tier},
                             {"offload_optimizer", std::string(tier) == "none" ? "none" : "cpu"},
                             {"precision", precision},
                             {"activation_checkpointing", std::string(tier) == "cpu"}});
        const LoraRun run = train(g, dir, changes);
        ASSERT_EQ(run.history.size(), want.history.size());
        for (std::size_t i = 0; i < run.history.size(); ++i) {
          EXPECT_EQ(run.history[i].loss, want.history[i].loss) << "step " << i + 1;
        }
        auto file = read_file(run.checkpoint + "/" + model::kAdapterWeightsFile);
        ASSERT_TRUE(file.is_ok());
        EXPECT_EQ(*file, *want_file) << "the saved adapters differ";
        EXPECT_NE(run.described.find("QLoRA r 4"), std::string::npos) << run.described;
        EXPECT_NE(run.described.find("in NF4"), std::string::npos) << run.described;
        if (std::string(tier) == "nvme") {
          for (const StepMetrics& m : run.history) {
            EXPECT_GT(m.nvme_read_bytes, 0u) << "step " << m.step << ": the NF4 base streams";
          }
        }
      }
    }
  }
}

// QLoRA's first loss against LoRA's on the unquantized base (fp32 both): the effective weights
// differ by dW = nf4(W) - W on the projections alone, so to first order the losses differ by
// g . dW, g the loss gradient at LoRA's weights W + s B A. dW is rounding noise that does not
// depend on g, so g . dW has a standard deviation of at most |g| max|dW_i|; the bound is six of
// those. A full fine-tune of the merged base measures |g| (over all weights: an upper bound on
// the projections' part).
TEST(QloraTest, FirstLossIsWithinTheNoiseBoundOfLoras) {
  const Json g = golden("llama3-all");
  const Json& l = g.at("lora");
  const double r = l.at("r").get<double>();
  const double scaling = l.at("lora_alpha").get<double>() / r;
  double max_dw = 0;
  with_projections(g, [&](const std::string& name, std::vector<float>& v) {
    std::vector<float> q = v;
    nf4_round_trip(name, q);
    for (std::size_t i = 0; i < v.size(); ++i) {
      max_dw = std::max(max_dw, std::abs(double{q[i]} - v[i]));
    }
  });
  const Json merged = with_projections(g, [&](const std::string& name, std::vector<float>& v) {
    const std::string module = name.substr(0, name.size() - std::string(".weight").size());
    const auto a = g.at("adapters").at(module + ".lora_A.weight").get<std::vector<double>>();
    const auto b = g.at("adapters").at(module + ".lora_B.weight").get<std::vector<double>>();
    const auto rank = static_cast<std::size_t>(r);
    const std::size_t out = b.size() / rank, in = a.size() / rank;
    ASSERT_EQ(out * in, v.size());
    for (std::size_t o = 0; o < out; ++o) {
      for (std::size_t i = 0; i < in; ++i) {
        double ba = 0;
        for (std::size_t k = 0; k < rank; ++k) ba += b[o * rank + k] * a[k * in + i];
        v[o * in + i] = static_cast<float>(v[o * in + i] + scaling * ba);
      }
    }
  });
  TempDir full_dir, lora_dir, qlora_dir;
  const double grad = train(merged, full_dir, kFull, 1).history.at(0).grad_norm;
  const double lora_loss = train(g, lora_dir, Json::object(), 1).history.at(0).loss;
  const double qlora_loss = train(g, qlora_dir, kQlora, 1).history.at(0).loss;
  const double bound = 6 * grad * max_dw + 1e-5;
  EXPECT_LE(std::abs(qlora_loss - lora_loss), bound)
      << "QLoRA " << qlora_loss << ", LoRA " << lora_loss << ", |g| " << grad << ", max |dW_i| "
      << max_dw;
  EXPECT_NE(qlora_loss, lora_loss) << "the NF4 base should change the loss a little";
}

// finetune.quantized_cache keeps the NF4 base between runs: the second run reads every group
// instead of quantizing, a damaged file is quantized again, another base replaces the cache, and
// every run's losses are the same.
TEST(QloraTest, ASecondRunReadsTheQuantizedBaseFromItsCache) {
  const Json g = golden("llama3-all");
  TempDir dir;
  Json changes = kQlora;
  changes["finetune"]["quantized_cache"] = dir.file("nf4");
  changes["precision"] = "bf16";
  const LoraRun first = train(g, dir, changes);
  EXPECT_NE(first.described.find("NF4 base: 2 groups quantized, kept in"), std::string::npos)
      << first.described;
  for (const char* f : {"manifest.json", "layers.0.nf4", "layers.1.nf4"}) {
    EXPECT_TRUE(fs::exists(fs::path(dir.file("nf4")) / f)) << f;
  }
  const auto same_losses = [&](const LoraRun& run) {
    ASSERT_EQ(run.history.size(), first.history.size());
    for (std::size_t i = 0; i < run.history.size(); ++i) {
      EXPECT_EQ(run.history[i].loss, first.history[i].loss) << "step " << i + 1;
    }
  };
  const LoraRun second = train(g, dir, changes);
  EXPECT_NE(second.described.find("NF4 base: 2 groups read from"), std::string::npos)
      << second.described;
  same_losses(second);

  // A file cut short is quantized again (and rewritten).
  fs::resize_file(fs::path(dir.file("nf4")) / "layers.1.nf4", 100);
  const LoraRun third = train(g, dir, changes);
  EXPECT_NE(third.described.find("1 groups quantized, 1 read from"), std::string::npos)
      << third.described;
  same_losses(third);

  // Another base (its weight file changed): quantized anew, the manifest replaced.
  for (const auto& e : fs::directory_iterator(dir.file("base"))) {
    if (e.path().extension() == ".safetensors") {
      fs::last_write_time(e.path(), fs::last_write_time(e.path()) + std::chrono::hours(1));
    }
  }
  const LoraRun fourth = train(g, dir, changes);
  EXPECT_NE(fourth.described.find("2 groups quantized"), std::string::npos) << fourth.described;
  same_losses(fourth);
  const LoraRun fifth = train(g, dir, changes);
  EXPECT_NE(fifth.described.find("2 groups read from"), std::string::npos) << fifth.described;
  // Norms that train whole leave the base's groups, laid out otherwise: quantized anew.
  Json saving = changes;
  saving["finetune"]["modules_to_save"] = {"post_attention_layernorm"};
  saving["finetune"]["adapter"] = nullptr;
  const LoraRun sixth = train(g, dir, saving);
  EXPECT_NE(sixth.described.find("2 groups quantized"), std::string::npos) << sixth.described;
  const LoraRun seventh = train(g, dir, saving);
  EXPECT_NE(seventh.described.find("2 groups read from"), std::string::npos) << seventh.described;

  // Only QLoRA has a quantized base to keep.
  auto c =
      parse_train_config({{"model",
                           {{"vocab_size", 32},
                            {"hidden_size", 16},
                            {"intermediate_size", 24},
                            {"num_hidden_layers", 2},
                            {"num_attention_heads", 4}}},
                          {"data", {{"path", "x"}}},
                          {"finetune", {{"method", "lora"}, {"quantized_cache", dir.file("nf4")}}}},
                         "cfg.json");
  ASSERT_FALSE(c.is_ok());
  EXPECT_NE(c.status().message().find("finetune.quantized_cache"), std::string::npos)
      << c.status().message();
}

// A checkpoint resumes only with the method it was trained with: adapters need LoRA settings, a
// full model needs "full"; adapters trained on a bf16 base continue on its NF4 form (QLoRA).
TEST(LoraResumeTest, AnotherMethodIsRefusedNamingWhatTheCheckpointHolds) {
  const Json g = golden("llama3-all");
  TempDir dir;
  const LoraRun lora = train(g, dir, Json::object(), 1);
  TrainOptions resume;
  resume.resume_dir = lora.checkpoint;
  auto as_full = Trainer::create(train_config(g, dir, kFull, 2), resume);
  ASSERT_FALSE(as_full.is_ok());
  EXPECT_NE(as_full.status().message().find("holds LoRA adapters, not a full model"),
            std::string::npos)
      << as_full.status().message();

  TempDir full_dir;
  const LoraRun whole = train(g, full_dir, kFull, 1);
  resume.resume_dir = whole.checkpoint;
  auto as_lora = Trainer::create(train_config(g, full_dir, Json::object(), 2), resume);
  ASSERT_FALSE(as_lora.is_ok());
  EXPECT_NE(as_lora.status().message().find("holds a full model, not LoRA adapters"),
            std::string::npos)
      << as_lora.status().message();

  const LoraRun qlora = train(g, dir, kQlora, 2, lora.checkpoint);
  ASSERT_EQ(qlora.history.size(), 1u);  // step 2 of 2
  EXPECT_TRUE(std::isfinite(qlora.history[0].loss));
}

}  // namespace
}  // namespace strata::train
