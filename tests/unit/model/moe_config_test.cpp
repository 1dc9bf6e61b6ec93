// Mixture-of-experts configs as Hugging Face writes them: Qwen3-MoE and Mixtral keys read with
// transformers' defaults and written back; which layers are MoE; each expert a parameter group
// with Hugging Face's tensor names; every bad value refused naming its key; a misshapen or
// missing expert tensor named by the checkpoint's validation.
#include <gtest/gtest.h>

#include <string>

#include "strata/core/json.h"
#include "strata/model/hf_checkpoint.h"
#include "strata/model/llama_config.h"
#include "strata/model/param_layout.h"
#include "tests/testing/temp_dir.h"

namespace strata::model {
namespace {

Json qwen3_moe() {
  return Json::parse(R"({"model_type": "qwen3_moe", "vocab_size": 32, "hidden_size": 16,
    "intermediate_size": 24, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 6, "num_experts": 6, "num_experts_per_tok": 2,
    "moe_intermediate_size": 8, "decoder_sparse_step": 1, "mlp_only_layers": [1],
    "norm_topk_prob": true, "output_router_logits": true, "router_aux_loss_coef": 0.01})");
}

Json mixtral() {
  return Json::parse(R"({"model_type": "mixtral", "vocab_size": 32, "hidden_size": 16,
    "intermediate_size": 8, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "sliding_window": null})");
}

std::string error_of(const Json& j) {
  auto c = LlamaConfig::from_json(j, "config.json");
  return c.is_ok() ? std::string() : c.status().message();
}

TEST(MoeConfigTest, KeysAndDefaultsAsTransformersHasThem) {
  auto q = LlamaConfig::from_json(qwen3_moe(), "q");
  ASSERT_TRUE(q.is_ok()) << q.status().message();
  EXPECT_EQ(q->family, ModelFamily::kQwen3Moe);
  EXPECT_TRUE(q->qk_norm);
  EXPECT_EQ(q->moe.num_experts, 6);
  EXPECT_EQ(q->moe.expert_intermediate_size, 8);
  EXPECT_TRUE(q->moe.aux_loss);
  EXPECT_TRUE(q->is_moe_layer(0));
  EXPECT_FALSE(q->is_moe_layer(1)) << "mlp_only_layers";
  Json step = qwen3_moe();
  step["decoder_sparse_step"] = 2;
  step["mlp_only_layers"] = Json::array();
  auto stepped = LlamaConfig::from_json(step, "q");
  ASSERT_TRUE(stepped.is_ok());
  EXPECT_FALSE(stepped->is_moe_layer(0));
  EXPECT_TRUE(stepped->is_moe_layer(1)) << "(layer + 1) % decoder_sparse_step == 0";

  auto m = LlamaConfig::from_json(mixtral(), "m");
  ASSERT_TRUE(m.is_ok()) << m.status().message();
  EXPECT_EQ(m->moe.num_experts, 8) << "num_local_experts' default";
  EXPECT_EQ(m->moe.experts_per_token, 2);
  EXPECT_EQ(m->moe.expert_intermediate_size, 8) << "Mixtral's experts are intermediate_size";
  EXPECT_FALSE(m->moe.aux_loss) << "output_router_logits' default";
  EXPECT_DOUBLE_EQ(m->moe.aux_loss_coef, 0.001);

  // Written back, the keys read the same.
  for (const LlamaConfig& c : {*q, *m}) {
    auto again = LlamaConfig::from_json(c.to_json(), "again");
    ASSERT_TRUE(again.is_ok()) << again.status().message();
    EXPECT_EQ(again->family, c.family);
    EXPECT_EQ(again->moe.num_experts, c.moe.num_experts);
    EXPECT_EQ(again->moe.experts_per_token, c.moe.experts_per_token);
    EXPECT_EQ(again->moe.expert_intermediate_size, c.moe.expert_intermediate_size);
    EXPECT_EQ(again->moe.dense_layers, c.moe.dense_layers);
    EXPECT_EQ(again->moe.normalize_top_k, c.moe.normalize_top_k);
  }
}

TEST(MoeConfigTest, EachExpertIsAGroupWithHuggingFacesNames) {
  auto q = LlamaConfig::from_json(qwen3_moe(), "q");
  ASSERT_TRUE(q.is_ok());
  const ParamLayout layout = ParamLayout::build(*q);
  EXPECT_EQ(layout.num_expert_groups(), 3 * 6) << "layers 0, 2 and 3";
  EXPECT_EQ(layout.num_experts(1), 0);
  const ParamGroup& e = layout.group(layout.expert_group(2, 5));
  EXPECT_EQ(e.name, "layers.2.experts.5");
  ASSERT_EQ(e.tensors.size(), 3u);
  EXPECT_EQ(e.tensors[0].name, "model.layers.2.mlp.experts.5.gate_proj.weight");
  EXPECT_EQ(e.tensors[2].name, "model.layers.2.mlp.experts.5.down_proj.weight");
  EXPECT_TRUE(layout.find("model.layers.0.mlp.gate.weight")) << "the router, in its layer";
  EXPECT_TRUE(layout.find("model.layers.1.mlp.up_proj.weight")) << "the dense layer's MLP";
  EXPECT_FALSE(layout.find("model.layers.0.mlp.up_proj.weight"));
  auto m = LlamaConfig::from_json(mixtral(), "m");
  ASSERT_TRUE(m.is_ok());
  const ParamLayout ml = ParamLayout::build(*m);
  EXPECT_TRUE(ml.find("model.layers.1.block_sparse_moe.gate.weight"));
  EXPECT_TRUE(ml.find("model.layers.1.block_sparse_moe.experts.7.w2.weight"));
  // A base from a seed is the same with or without adapters: the experts' ids come first.
  EXPECT_LT(layout.expert_group(3, 5), layout.num_groups());
  // Under tensor parallelism each MoE layer runs whole on every rank: its router and experts are
  // whole there, duplicates of the first rank's (counted once).
  EXPECT_TRUE(tensor_parallel_problems(*q, 2).empty());
  const ParamLayout second = ParamLayout::build(*q, std::nullopt, false, {2, 1});
  const ParamGroup& expert = second.group(second.expert_group(3, 5));
  EXPECT_EQ(expert.duplicate_begin, 0);
  EXPECT_EQ(expert.num_elems, layout.group(layout.expert_group(3, 5)).num_elems);
  const ParamGroup& first =
      ParamLayout::build(*q, std::nullopt, false, {2, 0}).group(second.expert_group(3, 5));
  EXPECT_EQ(first.duplicate_begin, first.num_elems);
}

// Expert parallelism over 3 ranks (6 experts: 2 each): every group keeps its id and name, and
// rank 1 holds experts 2 and 3 of every MoE layer, with their adapters; the other experts' groups
// (and adapters') are empty there, the dense groups whole. The three ranks' experts make the
// whole model once.
TEST(MoeConfigTest, AnExpertSplitEmptiesTheGroupsOfOtherRanksExperts) {
  auto q = LlamaConfig::from_json(qwen3_moe(), "q");
  ASSERT_TRUE(q.is_ok());
  LoraConfig lora;
  lora.r = 2;  // every projection, the experts' among them
  const ParamLayout whole = ParamLayout::build(*q, lora);
  std::int64_t split_elems = 0;
  for (int rank = 0; rank < 3; ++rank) {
    const ParamLayout part = ParamLayout::build(*q, lora, false, {}, {}, ExpertSplit{3, rank});
    ASSERT_EQ(part.num_groups(), whole.num_groups());
    for (int id = 0; id < whole.num_groups(); ++id) {
      const ParamGroup& g = part.group(id);
      EXPECT_EQ(g.name, whole.group(id).name);
      const int e = whole.expert_of(id);
      const bool held = e < 0 || e / 2 == rank;
      EXPECT_EQ(g.num_elems, held ? whole.group(id).num_elems : 0) << g.name << " on " << rank;
      EXPECT_EQ(part.expert_owner(id), e < 0 ? 0 : e / 2) << g.name;
      if (e >= 0 || rank == 0) split_elems += g.num_elems;
    }
    EXPECT_EQ(part.expert_of(part.expert_group(2, 3)), 3);
    EXPECT_EQ(part.expert_of(part.expert_adapter_group(3, 4)), 4);
    EXPECT_EQ(part.expert_of(part.layer_group(2)), -1);
    EXPECT_EQ(part.group(part.expert_group(0, 2 * rank + 1)).tensors.size(), 3u);
  }
  EXPECT_EQ(split_elems, whole.total_elems()) << "each expert on one rank, the rest counted once";
}

TEST(MoeConfigTest, BadValuesAreRefusedNamingTheKey) {
  Json j = qwen3_moe();
  j["num_experts_per_tok"] = 7;
  EXPECT_NE(error_of(j).find("num_experts_per_tok must be in [1, num_experts 6], got 7"),
            std::string::npos)
      << error_of(j);
  j["num_experts_per_tok"] = 0;
  EXPECT_NE(error_of(j).find("num_experts_per_tok"), std::string::npos) << error_of(j);
  j = qwen3_moe();
  j["mlp_only_layers"] = {1, 9};
  EXPECT_NE(error_of(j).find("mlp_only_layers holds layer 9, outside [0, num_hidden_layers 4)"),
            std::string::npos)
      << error_of(j);
  j = qwen3_moe();
  j["moe_intermediate_size"] = 0;
  EXPECT_NE(error_of(j).find("moe_intermediate_size must be > 0"), std::string::npos)
      << error_of(j);
  j = mixtral();
  j["router_jitter_noise"] = 0.1;
  EXPECT_NE(error_of(j).find("router_jitter_noise"), std::string::npos) << error_of(j);
  j = mixtral();
  j["model_type"] = "deepseek_v3";
  const std::string unknown = error_of(j);
  EXPECT_NE(unknown.find("\"qwen3_moe\" or \"mixtral\", got \"deepseek_v3\""), std::string::npos)
      << unknown;
}

TEST(MoeConfigTest, AMisshapenOrMissingExpertIsNamed) {
  testing::TempDir dir;
  auto c = LlamaConfig::from_json(mixtral(), "m");
  ASSERT_TRUE(c.is_ok());
  const ParamLayout layout = ParamLayout::build(*c);
  ASSERT_TRUE(
      write_hf_checkpoint(dir.path(), *c, layout, DType::kF32, [](const ParamGroup& g, float* dst) {
        std::fill(dst, dst + g.num_elems, 0.5f);
        return Status::ok();
      }).is_ok());
  auto reader = HfCheckpointReader::open(dir.path());
  ASSERT_TRUE(reader.is_ok()) << reader.status().message();
  // The file against a model whose experts are wider, and one with more of them.
  LlamaConfig wider = *c;
  wider.moe.expert_intermediate_size = 12;
  const std::string shape = reader->validate(ParamLayout::build(wider)).message();
  EXPECT_NE(shape.find("model.layers.0.block_sparse_moe.experts.0.w1.weight"), std::string::npos)
      << shape;
  EXPECT_NE(shape.find("expected [12, 16]"), std::string::npos) << shape;
  LlamaConfig more = *c;
  more.moe.num_experts = 9;
  const std::string missing = reader->validate(ParamLayout::build(more)).message();
  EXPECT_NE(missing.find("missing tensor 'model.layers.0.block_sparse_moe.experts.8.w1.weight'"),
            std::string::npos)
      << missing;
}

}  // namespace
}  // namespace strata::model
