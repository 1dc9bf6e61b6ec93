// LoRA against PyTorch: the loss and every adapter gradient of one step on a frozen base, for
// each family and target set, with and without dropout (Strata's masks, reproduced by
// tools/golden/lora_golden.py from PEFT's math in float64; tests/data/lora/).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "strata/core/json.h"
#include "strata/model/llama.h"
#include "strata/model/lora.h"
#include "strata/model/peft_adapter.h"
#include "tests/testing/temp_dir.h"
#include "tests/testing/test_name.h"
#include "tests/unit/model/llama_test_util.h"

namespace strata::model {
namespace {

using testing::make_device;
using testing::TestProvider;

// As llama_golden_test.cpp: a plain f32 implementation lands within f32_error of float64 (the
// golden file's own float32 run measures it); Strata sums in other orders, so it may use
// kLoraF32Factor times that.
constexpr double kLoraF32Factor = 8.0;

// The golden's "lora" object holds PEFT's adapter_config.json keys.
LoraConfig peft_lora(const Json& j) {
  auto l = lora_config_from_peft(j, "golden lora");
  STRATA_CHECK(l.is_ok(), l.status().to_string());
  return *l;
}

class LoraGoldenTest : public ::testing::TestWithParam<std::tuple<std::string, bool>> {};

TEST_P(LoraGoldenTest, F32LossAndAdapterGradientsMatchPyTorch) {
  const auto& [name, checkpointing] = GetParam();
  const std::string path = std::string(STRATA_TEST_DATA_DIR) + "/lora/" + name + ".json";
  auto golden = read_json_file(path);
  ASSERT_TRUE(golden.is_ok()) << golden.status().to_string();
  const Json& g = golden.value();
  auto config = LlamaConfig::from_json(g.at("config"), path);
  ASSERT_TRUE(config.is_ok()) << config.status().to_string();
  const LoraConfig lora = peft_lora(g.at("lora"));
  const ParamLayout layout = ParamLayout::build(*config, lora);
  ASSERT_TRUE(layout.has_adapters());
  auto device = make_device();
  TestProvider provider(layout, *device, DType::kF32);
  // The golden's "adapters" are what trains: the adapters and the modules saved whole. A group
  // trains exactly when it holds them.
  const Json& trained = g.at("adapters");
  std::size_t adapter_tensors = 0;
  for (const auto& group : layout.groups()) {
    for (const auto& t : group.tensors) {
      EXPECT_EQ(group.frozen, !trained.contains(t.name)) << group.name << ": " << t.name;
      const Json& w = trained.contains(t.name) ? trained.at(t.name) : g.at("weights").at(t.name);
      ASSERT_EQ(static_cast<std::int64_t>(w.size()), t.num_elems) << t.name;
      float* p = provider.param(t.name);
      for (std::int64_t i = 0; i < t.num_elems; ++i) p[i] = w[i].get<float>();
      adapter_tensors += group.frozen ? 0 : 1;
    }
  }
  EXPECT_EQ(adapter_tensors, trained.size()) << "every adapter of the golden, no other";

  const testing::GoldenBatch windows = testing::batch_of(g);
  const std::vector<std::int32_t>& inputs = windows.inputs;
  const std::vector<std::int32_t>& targets = windows.targets;
  const std::int64_t seq = windows.seq, batch = windows.batch;
  LlamaModel model(*config, layout, *device, ModelOptions{DType::kF32, checkpointing, lora});
  const std::uint64_t key = std::stoull(g.at("dropout_key").get<std::string>());
  auto r = model.forward_backward(provider, inputs.data(), targets.data(), batch, seq, 1.0f, key);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  const double want = g.at("loss");
  // An MoE model's reference loss is the trained objective: with the weighted aux loss.
  const double got = *r + (config->has_moe() && config->moe.aux_loss
                               ? config->moe.aux_loss_coef * model.last_aux_loss()
                               : 0.0);
  EXPECT_NEAR(got, want, kLoraF32Factor * g.at("f32_loss_error").get<double>() + 0x1p-24 * want);

  for (const auto& [tensor, grads] : g.at("grads").items()) {
    const auto loc = layout.find(tensor);
    ASSERT_TRUE(loc.has_value()) << tensor;
    const double bound = kLoraF32Factor * g.at("f32_grad_error").at(tensor).get<double>();
    ASSERT_GT(bound, 0.0) << tensor;
    const float* got = provider.grad(tensor);
    double worst = 0, largest = 0;
    int bad = 0;
    for (std::size_t i = 0; i < grads.size(); ++i) {
      const double w = grads[i].get<double>();
      const double err = std::abs(got[i] - w);
      worst = std::max(worst, err / bound);
      largest = std::max(largest, std::abs(w));
      if (!(err <= bound) && ++bad <= 3) {
        ADD_FAILURE() << tensor << "[" << i << "]: got " << got[i] << ", want " << w;
      }
    }
    EXPECT_GT(largest, 100 * bound) << tensor << ": the gradient must be far above f32 noise";
    std::printf("  %s: worst %.2f of the bound (%.3g)\n", tensor.c_str(), worst, bound);
  }
  // Forward only (evaluation): no dropout, no gradient asked for.
  provider.log.clear();
  ASSERT_TRUE(model.forward_loss(provider, inputs.data(), targets.data(), batch, seq).is_ok());
  for (const auto& e : provider.log) EXPECT_NE(e.rfind("G+", 0), 0u) << e;
  EXPECT_FALSE(provider.any_held());
}

INSTANTIATE_TEST_SUITE_P(
    Cases, LoraGoldenTest,
    ::testing::Combine(::testing::Values("llama3-all", "llama3-all-dropout", "llama3-qv",
                                         "qwen2-all-dropout", "qwen3-all-rslora",
                                         "mistral-mlp-dropout", "llama3-qv-save", "qwen3-all-save",
                                         "qwen2-embed-save", "qwen3-moe-all",
                                         "mixtral-experts-dropout", "qwen3-moe-router",
                                         "mixtral-router-dropout"),
                       ::testing::Bool()),
    [](const auto& info) {
      return strata::testing::test_name(std::get<0>(info.param)) +
             (std::get<1>(info.param) ? "Checkpointed" : "Stored");
    });

// Adapters initialize as PEFT's do: A ~ U(-1/sqrt(in), 1/sqrt(in)), B zero; the base drawn from
// a seed is the same with or without adapters.
TEST(LoraLayoutTest, AdaptersInitializeAsPeftAndLeaveTheBaseUnchanged) {
  const LlamaConfig c = testing::tiny_config(false);
  LoraConfig lora;
  lora.r = 8;
  const ParamLayout plain = ParamLayout::build(c);
  const ParamLayout adapted = ParamLayout::build(c, lora);
  ASSERT_EQ(adapted.num_groups(), plain.num_groups() + c.num_hidden_layers);
  for (const auto& g : plain.groups()) {
    EXPECT_FALSE(g.frozen);
    EXPECT_TRUE(adapted.group(g.id).frozen);
    std::vector<float> a(static_cast<std::size_t>(g.num_elems)), b(a.size());
    init_group(c, g, 7, a.data());
    init_group(c, adapted.group(g.id), 7, b.data());
    EXPECT_EQ(a, b) << g.name;
  }
  const ParamGroup& g = adapted.group(adapted.adapter_group(1));
  EXPECT_EQ(g.name, "layers.1.lora");
  EXPECT_FALSE(g.frozen);
  ASSERT_EQ(g.tensors.size(), 14u);
  EXPECT_EQ(g.tensors[0].name, "model.layers.1.self_attn.q_proj.lora_A.weight");
  EXPECT_EQ(g.tensors[13].name, "model.layers.1.mlp.down_proj.lora_B.weight");
  EXPECT_EQ(g.tensors[13].shape, (std::vector<std::int64_t>{c.hidden_size, 8}));
  EXPECT_EQ(g.tensors[12].shape, (std::vector<std::int64_t>{8, c.intermediate_size}));
  std::vector<float> x(static_cast<std::size_t>(g.num_elems));
  init_group(c, g, 7, x.data());
  for (const auto& t : g.tensors) {
    const float* p = x.data() + t.offset_elems;
    if (t.init == TensorInit::kZeros) {
      for (std::int64_t i = 0; i < t.num_elems; ++i) ASSERT_EQ(p[i], 0.0f) << t.name;
      continue;
    }
    ASSERT_EQ(t.init, TensorInit::kUniformFanIn) << t.name;
    const double bound = 1.0 / std::sqrt(static_cast<double>(t.shape[1]));
    double sum = 0, sq = 0;
    for (std::int64_t i = 0; i < t.num_elems; ++i) {
      ASSERT_LE(std::abs(p[i]), bound) << t.name;
      sum += p[i];
      sq += static_cast<double>(p[i]) * p[i];
    }
    // U(-b, b) has variance b^2 / 3; over n draws the sample variance is within a few standard
    // errors (4 b^4 / 45 / n per draw squared) of it.
    const double n = static_cast<double>(t.num_elems);
    const double var = sq / n - (sum / n) * (sum / n);
    EXPECT_NEAR(var, bound * bound / 3, 6 * bound * bound * std::sqrt(4.0 / 45.0 / n)) << t.name;
  }
}

// modules_to_save: the embedding or the head group trains when all of it does; trained norms
// move to their block's adapter group, or model.norm to a group of its own beside a frozen
// lm_head; the base drawn from a seed stays the same.
TEST(LoraLayoutTest, ModulesToSaveTrainWholeAndLeaveTheBaseUnchanged) {
  const LlamaConfig c = testing::tiny_config(false);
  ASSERT_FALSE(c.tie_word_embeddings);
  LoraConfig lora;
  lora.r = 4;
  lora.modules_to_save = {"embed_tokens", "norm", "layers.1.post_attention_layernorm"};
  EXPECT_TRUE(lora_problems(c, lora).empty());
  const ParamLayout plain = ParamLayout::build(c);
  const ParamLayout adapted = ParamLayout::build(c, lora);
  const int L = static_cast<int>(c.num_hidden_layers);
  ASSERT_EQ(adapted.num_groups(), plain.num_groups() + L + 1);
  EXPECT_FALSE(adapted.group(adapted.embed_group()).frozen);
  EXPECT_TRUE(adapted.group(adapted.head_group()).frozen);
  const ParamGroup& norm = adapted.group(2 * L + 2);
  EXPECT_EQ(norm.name, "head.norm");
  EXPECT_FALSE(norm.frozen);
  ASSERT_EQ(norm.tensors.size(), 1u);
  EXPECT_EQ(norm.tensors[0].name, "model.norm.weight");
  const auto moved = adapted.find("model.layers.1.post_attention_layernorm.weight");
  ASSERT_TRUE(moved.has_value());
  EXPECT_EQ(moved->group, adapted.adapter_group(1));
  EXPECT_EQ(adapted.group(adapted.adapter_group(1)).tensors.back().name, moved->tensor->name);
  EXPECT_EQ(adapted.find("model.layers.0.post_attention_layernorm.weight")->group,
            adapted.layer_group(0));
  LoraConfig adapters_only = lora;
  adapters_only.modules_to_save.clear();
  EXPECT_EQ(adapted.num_parameters(), ParamLayout::build(c, adapters_only).num_parameters());
  // Every base tensor, wherever it lives, draws the values it draws without adapters.
  for (const auto& pg : plain.groups()) {
    std::vector<float> want(static_cast<std::size_t>(pg.num_elems));
    init_group(c, pg, 7, want.data());
    for (const auto& t : pg.tensors) {
      const auto loc = adapted.find(t.name);
      ASSERT_TRUE(loc.has_value()) << t.name;
      const ParamGroup& ag = adapted.group(loc->group);
      std::vector<float> got(static_cast<std::size_t>(ag.num_elems));
      init_group(c, ag, 7, got.data());
      for (std::int64_t i = 0; i < t.num_elems; ++i) {
        ASSERT_EQ(got[static_cast<std::size_t>(loc->tensor->offset_elems + i)],
                  want[static_cast<std::size_t>(t.offset_elems + i)])
            << t.name << "[" << i << "]";
      }
    }
  }
  // lm_head trains, model.norm does not: the norm moves to a frozen group.
  lora.modules_to_save = {"lm_head"};
  const ParamLayout head = ParamLayout::build(c, lora);
  EXPECT_FALSE(head.group(head.head_group()).frozen);
  EXPECT_EQ(head.group(head.head_group()).tensors.at(0).name, "lm_head.weight");
  EXPECT_TRUE(head.group(2 * L + 2).frozen);
  // Both: the head group trains whole, nothing moves.
  lora.modules_to_save = {"lm_head", "norm"};
  const ParamLayout both = ParamLayout::build(c, lora);
  EXPECT_EQ(both.num_groups(), plain.num_groups() + L);
  EXPECT_FALSE(both.group(both.head_group()).frozen);
}

TEST(LoraLayoutTest, ModulesToSaveThatNameNoModuleAreRefused) {
  LlamaConfig c = testing::tiny_config(false);
  LoraConfig lora;
  lora.modules_to_save = {"q_proj", "layernorm", "norm", "model.layers.9.input_layernorm"};
  const auto problems = lora_problems(c, lora);
  ASSERT_EQ(problems.size(), 3u);
  for (const auto& p : problems) EXPECT_EQ(p.key, "modules_to_save");
  EXPECT_NE(problems[0].text.find("\"q_proj\" is a projection: adapt it with target_modules"),
            std::string::npos)
      << problems[0].text;
  EXPECT_NE(problems[1].text.find("\"layernorm\" names no module"), std::string::npos)
      << problems[1].text;
  EXPECT_NE(problems[2].text.find("layers.9"), std::string::npos) << problems[2].text;
  c.tie_word_embeddings = true;
  lora.modules_to_save = {"lm_head"};
  const auto tied = lora_problems(c, lora);
  ASSERT_EQ(tied.size(), 1u);
  EXPECT_NE(tied[0].text.find("name \"embed_tokens\""), std::string::npos) << tied[0].text;
}

// The router ("gate") is adapted only where named, and only a model with MoE layers has one.
TEST(LoraLayoutTest, TheRouterIsATargetOnlyWhereNamedAndOnlyInMoeLayers) {
  EXPECT_EQ(parse_lora_target("gate"), LoraTarget::kRouter);
  EXPECT_EQ(parse_lora_target("gate_proj"), LoraTarget::kGate);
  LoraConfig lora;
  EXPECT_FALSE(lora.has(LoraTarget::kRouter));  // the default: all-linear
  EXPECT_EQ(lora.targets, LoraConfig::all_linear());
  lora.targets = {};
  lora.targets[static_cast<int>(LoraTarget::kRouter)] = true;
  lora.targets[static_cast<int>(LoraTarget::kDown)] = true;
  EXPECT_EQ(lora.target_names(ModelFamily::kMixtral), (std::vector<std::string>{"w2", "gate"}));
  EXPECT_EQ(lora.target_names(ModelFamily::kQwen3Moe),
            (std::vector<std::string>{"down_proj", "gate"}));

  const LlamaConfig dense = testing::tiny_config(false);
  const auto problems = lora_problems(dense, lora);
  ASSERT_EQ(problems.size(), 1u);
  EXPECT_EQ(problems[0].key, "target_modules");
  EXPECT_NE(problems[0].text.find("\"gate\" names an MoE layer's router"), std::string::npos)
      << problems[0].text;
  // Named in modules_to_save there, it names no module (not "a projection" to adapt).
  LoraConfig save_gate;
  save_gate.modules_to_save = {"gate"};
  const auto saved = lora_problems(dense, save_gate);
  ASSERT_EQ(saved.size(), 1u);
  EXPECT_NE(saved[0].text.find("\"gate\" names no module"), std::string::npos) << saved[0].text;

  // An MoE model: the router's adapter in its layer's adapter group (whole under a tensor
  // split), a dense layer (mlp_only_layers) without one.
  for (const auto& [family, path] :
       {std::pair{"qwen3-moe", "mlp.gate"}, std::pair{"mixtral", "block_sparse_moe.gate"}}) {
    const std::string name =
        std::string(family) == "mixtral" ? "mixtral-router-dropout" : "qwen3-moe-router";
    const std::string file = std::string(STRATA_TEST_DATA_DIR) + "/lora/" + name + ".json";
    auto golden = read_json_file(file);
    ASSERT_TRUE(golden.is_ok()) << golden.status().to_string();
    auto config = LlamaConfig::from_json(golden->at("config"), file);
    ASSERT_TRUE(config.is_ok()) << config.status().to_string();
    const LlamaConfig& c = *config;
    ASSERT_TRUE(c.has_moe()) << family;
    EXPECT_TRUE(lora_problems(c, lora).empty());
    const ParamLayout layout = ParamLayout::build(c, lora);
    for (std::int64_t l = 0; l < c.num_hidden_layers; ++l) {
      const std::string m = "model.layers." + std::to_string(l) + "." + path;
      const auto a = layout.find(m + ".lora_A.weight");
      const auto b = layout.find(m + ".lora_B.weight");
      ASSERT_EQ(a.has_value(), c.is_moe_layer(l)) << m;
      if (!c.is_moe_layer(l)) continue;
      EXPECT_EQ(a->group, layout.adapter_group(static_cast<int>(l)));
      EXPECT_EQ(a->tensor->shape, (std::vector<std::int64_t>{lora.r, c.hidden_size}));
      EXPECT_EQ(b->tensor->shape, (std::vector<std::int64_t>{c.moe.num_experts, lora.r}));
      EXPECT_FALSE(layout.group(a->group).frozen);
    }
  }
}

// Decoding logits of `layout` with `provider`'s parameters after `prompt`.
std::vector<float> decode_logits(device::Device& device, const LlamaConfig& c,
                                 const ParamLayout& layout, TestProvider& provider,
                                 const std::optional<LoraConfig>& lora,
                                 const std::vector<std::int32_t>& prompt) {
  LlamaModel model(c, layout, device, ModelOptions{DType::kF32, false, lora});
  const auto n = static_cast<std::int64_t>(prompt.size());
  STRATA_CHECK(model.begin_decode(provider, n, n).is_ok(), "begin_decode");
  auto logits = model.decode(provider, prompt.data(), n);
  STRATA_CHECK(logits.is_ok(), logits.status().to_string());
  return std::vector<float>(*logits, *logits + c.vocab_size);
}

// merge_adapters (strata merge) folds scaling * B A into each base weight: the merged model's
// logits are the unmerged adapter's up to f32 rounding. Both sum the same products in f32 in
// other orders, the merged weights once rounded more: each logit moves by a few units of f32
// rounding of the sums' magnitudes, far below 1e-4 of the largest logit.
TEST(LoraMergeTest, MergedWeightsGiveTheUnmergedLogits) {
  for (const char* name : {"llama3-all", "qwen3-all-rslora", "llama3-qv"}) {
    SCOPED_TRACE(name);
    const std::string path = std::string(STRATA_TEST_DATA_DIR) + "/lora/" + name + ".json";
    auto golden = read_json_file(path);
    ASSERT_TRUE(golden.is_ok());
    const Json& g = golden.value();
    auto config = LlamaConfig::from_json(g.at("config"), path);
    ASSERT_TRUE(config.is_ok());
    const LoraConfig lora = peft_lora(g.at("lora"));
    const ParamLayout adapted = ParamLayout::build(*config, lora).all_frozen();
    const ParamLayout plain = ParamLayout::build(*config).all_frozen();
    auto device = make_device();
    TestProvider unmerged(adapted, *device, DType::kF32), merged(plain, *device, DType::kF32);
    for (const auto& group : adapted.groups()) {
      for (const auto& t : group.tensors) {
        const bool base = g.at("weights").contains(t.name);
        const Json& w = base ? g.at("weights").at(t.name) : g.at("adapters").at(t.name);
        for (std::int64_t i = 0; i < t.num_elems; ++i) {
          unmerged.param(t.name)[i] = w[static_cast<std::size_t>(i)].get<float>();
          if (base) merged.param(t.name)[i] = w[static_cast<std::size_t>(i)].get<float>();
        }
      }
    }
    for (int l = 0; l < config->num_hidden_layers; ++l) {
      const int a = adapted.adapter_group(l), b = plain.layer_group(l);
      merge_adapters(lora, plain.group(b), merged.params[static_cast<std::size_t>(b)].data(),
                     adapted.group(a), unmerged.params[static_cast<std::size_t>(a)].data());
    }
    const std::vector<std::int32_t> prompt = {1, 5, 9, 2, 7, 3};
    const auto want = decode_logits(*device, *config, adapted, unmerged, lora, prompt);
    const auto got = decode_logits(*device, *config, plain, merged, std::nullopt, prompt);
    const auto base_only = [&] {
      TestProvider p(plain, *device, DType::kF32);
      for (const auto& group : plain.groups()) {
        for (const auto& t : group.tensors) {
          const Json& w = g.at("weights").at(t.name);
          for (std::int64_t i = 0; i < t.num_elems; ++i) {
            p.param(t.name)[i] = w[static_cast<std::size_t>(i)].get<float>();
          }
        }
      }
      return decode_logits(*device, *config, plain, p, std::nullopt, prompt);
    }();
    double scale = 0, worst = 0, moved = 0;
    for (std::size_t i = 0; i < want.size(); ++i) {
      scale = std::max(scale, static_cast<double>(std::abs(want[i])));
      worst = std::max(worst, static_cast<double>(std::abs(got[i] - want[i])));
      moved = std::max(moved, static_cast<double>(std::abs(base_only[i] - want[i])));
    }
    EXPECT_LE(worst, 1e-4 * scale);
    // The adapter matters: without it the logits move by far more than the bound.
    EXPECT_GT(moved, 100 * 1e-4 * scale);
    std::printf(
        "  %s: merged within %.2e of the unmerged logits (scale %.3g; the adapter moves "
        "them %.3g)\n",
        name, worst, scale, moved);
  }
}

TEST(LoraConfigTest, ScalingIsPefts) {
  LoraConfig l;
  l.r = 16;
  l.alpha = 32;
  EXPECT_EQ(l.scaling(), 2.0);
  l.use_rslora = true;
  EXPECT_EQ(l.scaling(), 8.0);
  EXPECT_EQ(parse_lora_target("gate_proj"), LoraTarget::kGate);
  EXPECT_FALSE(parse_lora_target("gate_up_proj").has_value());
  EXPECT_FALSE(parse_lora_target("mlp").has_value());
}

// Found by the peft_adapter fuzzer: a peft_type that is not a string threw from nlohmann.
TEST(PeftAdapterTest, APeftTypeThatIsNotAStringIsAnErrorNamingIt) {
  ::strata::testing::TempDir dir;
  for (const char* type : {"0.0", "null", "\"LOHA\""}) {
    dir.write(kAdapterConfigFile, std::string(R"({"peft_type": )") + type + "}");
    auto a = PeftAdapterReader::open(dir.path());
    ASSERT_FALSE(a.is_ok()) << type;
    EXPECT_NE(
        a.status().message().find("'peft_type' is " + std::string(type) + ", expected \"LORA\""),
        std::string::npos)
        << a.status().message();
  }
}

}  // namespace
}  // namespace strata::model
