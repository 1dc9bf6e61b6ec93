// A pipeline stage's share of the model: which layers each chunk holds, which stage holds each
// group, and the layout whose other stages' groups are empty but keep their ids and seeds.
#include "strata/model/pipeline_stage.h"

#include <gtest/gtest.h>

#include <vector>

#include "strata/model/llama.h"
#include "strata/model/param_layout.h"

namespace strata::model {
namespace {

LlamaConfig small() {
  LlamaConfig c;
  c.vocab_size = 64;
  c.hidden_size = 16;
  c.intermediate_size = 24;
  c.num_hidden_layers = 6;
  c.num_attention_heads = 2;
  c.num_key_value_heads = 1;
  return c;
}

TEST(PipelineStageTest, ChunksHoldTheirVirtualStagesLayers) {
  // 2 stages x 2 chunks over 6 layers: virtual stages 0..3 hold 1, 2, 2, 1 layers.
  const std::vector<std::int64_t> counts = {1, 2, 2, 1};
  const PipelineStage s0 = pipeline_stage(2, 2, 0, counts), s1 = pipeline_stage(2, 2, 1, counts);
  EXPECT_EQ(s0.bounds, (std::vector<std::int64_t>{0, 1, 3, 5, 6}));
  // Stage 0: virtual stages 0 and 2; stage 1: 1 and 3.
  EXPECT_EQ(s0.chunk_begin(0), 0);
  EXPECT_EQ(s0.chunk_end(0, 6), 1);
  EXPECT_EQ(s0.chunk_begin(1), 3);
  EXPECT_EQ(s0.chunk_end(1, 6), 5);
  EXPECT_EQ(s1.chunk_begin(0), 1);
  EXPECT_EQ(s1.chunk_end(1, 6), 6);
  const int holder[] = {0, 1, 1, 0, 0, 1};
  for (int l = 0; l < 6; ++l) {
    EXPECT_EQ(s0.stage_holding(l, 6), holder[l]) << l;
    EXPECT_EQ(s0.holds_layer(l, 6), holder[l] == 0) << l;
    EXPECT_EQ(s1.holds_layer(l, 6), holder[l] == 1) << l;
  }
  EXPECT_EQ(s0.chunk_of(4, 6), 1);
  EXPECT_EQ(s1.chunk_of(4, 6), -1);
  EXPECT_TRUE(s0.first_chunk(0) && !s0.first_chunk(1) && !s0.last_chunk(1));
  EXPECT_TRUE(s1.last_chunk(1) && !s1.last_chunk(0));
  // The neighbours of stage 0's chunk 1 (virtual stage 2) are stage 1's chunks.
  EXPECT_EQ(s0.previous_stage(1), 1);
  EXPECT_EQ(s0.next_stage(1), 1);
  EXPECT_TRUE(s0.holds_embedding() && !s0.holds_head() && s1.holds_head());
  // One stage: every layer, no bounds.
  const PipelineStage one = pipeline_stage(1, 1, 0, {6});
  EXPECT_FALSE(one.split());
  EXPECT_EQ(one.chunk_end(0, 6), 6);
}

TEST(PipelineStageTest, LayerCountsThatCannotCutTheModelAreNamed) {
  EXPECT_TRUE(pipeline_layers_problems({3, 3}, 2, 1, 6).empty());
  const auto count = pipeline_layers_problems({6}, 2, 1, 6);
  ASSERT_EQ(count.size(), 1u);
  EXPECT_EQ(count[0], "has 1 counts; expected one per stage (2)");
  const auto v = pipeline_layers_problems({2, 2, 2}, 2, 2, 6);
  ASSERT_FALSE(v.empty());
  EXPECT_NE(v[0].find("pipeline_parallel_size 2 x virtual_stages 2 = 4"), std::string::npos);
  const auto zero = pipeline_layers_problems({6, 0}, 2, 1, 6);
  ASSERT_EQ(zero.size(), 1u);
  EXPECT_EQ(zero[0], "count 1 is 0; every stage needs at least one layer");
  const auto sum = pipeline_layers_problems({3, 2}, 2, 1, 6);
  ASSERT_EQ(sum.size(), 1u);
  EXPECT_EQ(sum[0], "sums to 5 layers; the model has 6 (num_hidden_layers)");
}

// Each stage's layout holds its own groups whole and the others' empty, under the same ids:
// together the stages hold every tensor once, with the values a seed gives the whole layout.
TEST(PipelineStageTest, EachStagesLayoutHoldsItsGroupsUnderTheirIds) {
  const LlamaConfig c = small();
  const ParamLayout whole = ParamLayout::build(c);
  const std::vector<std::int64_t> counts = {2, 4};
  std::vector<int> holders(static_cast<std::size_t>(whole.num_groups()), 0);
  for (int stage = 0; stage < 2; ++stage) {
    const ParamLayout l =
        ParamLayout::build(c, std::nullopt, false, {}, pipeline_stage(2, 1, stage, counts));
    ASSERT_EQ(l.num_groups(), whole.num_groups());
    for (const ParamGroup& g : l.groups()) {
      const ParamGroup& w = whole.group(g.id);
      EXPECT_EQ(g.name, w.name);
      const int owner = whole.stage_of(g.id, l.pipeline());
      EXPECT_EQ(l.stage_of(g.id), owner);
      if (owner == stage) {
        ++holders[static_cast<std::size_t>(g.id)];
        EXPECT_EQ(g.num_elems, w.num_elems) << g.name;
        std::vector<float> a(static_cast<std::size_t>(g.num_elems)), b(a.size());
        init_group(c, g, 7, a.data());
        init_group(c, w, 7, b.data());
        EXPECT_EQ(a, b) << g.name;
      } else {
        EXPECT_EQ(g.num_elems, 0) << g.name;
        EXPECT_TRUE(g.tensors.empty()) << g.name;
      }
    }
  }
  for (const int n : holders) EXPECT_EQ(n, 1);
  // The embedding on the first stage, layers 0-1 with it, the rest and the head on the last.
  const PipelineStage s = pipeline_stage(2, 1, 0, counts);
  EXPECT_EQ(whole.stage_of(whole.embed_group(), s), 0);
  EXPECT_EQ(whole.stage_of(whole.layer_group(1), s), 0);
  EXPECT_EQ(whole.stage_of(whole.layer_group(2), s), 1);
  EXPECT_EQ(whole.stage_of(whole.head_group(), s), 1);
}

// A tied embedding cut into stages: the last stage's workspace holds the head's copy of the
// embedding and its gradient part to send, the first stage's a received gradient part per
// micro-batch in flight (vocab x hidden each, in the compute dtype); none where the embedding is
// frozen (adapters beside it), only the copy.
TEST(PipelineStageTest, TiedEmbeddingsAcrossStagesTakeTheirBuffersInTheWorkspace) {
  LlamaConfig c = small();
  const std::uint64_t vh = static_cast<std::uint64_t>(c.vocab_size * c.hidden_size) * 4;
  ASSERT_EQ(vh % 256, 0u) << "a whole number of the workspace's alignment";
  const auto bytes = [&](bool tied, int stage, bool adapters) {
    c.tie_word_embeddings = tied;
    ModelOptions o;
    o.pipeline = pipeline_stage(2, 1, stage, {3, 3});
    o.pipeline.in_flight = 2 - stage;
    if (adapters) o.lora = LoraConfig{};
    return LlamaModel::activation_bytes(c, o, 2, 8);
  };
  for (const bool adapters : {false, true}) {
    SCOPED_TRACE(adapters);
    const std::uint64_t grads = adapters ? 0 : 1;
    EXPECT_EQ(bytes(true, 0, adapters), bytes(false, 0, adapters) + 2 * grads * vh);
    EXPECT_EQ(bytes(true, 1, adapters), bytes(false, 1, adapters) + (1 + grads) * vh);
  }
}

}  // namespace
}  // namespace strata::model
