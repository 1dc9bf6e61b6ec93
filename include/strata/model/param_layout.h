// Flat parameter layout: every parameter of the model lives in one of a few flat groups with
// named views, one group per unit of fetching (the embedding, each decoder block, the head).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "strata/model/llama_config.h"

namespace strata::model {

// Element offsets of tensors inside a group are multiples of this, so every view is 128-byte
// aligned in f32 and bf16 alike.
inline constexpr std::int64_t kTensorAlignElems = 64;

struct TensorSpec {
  std::string name;  // Hugging Face name, e.g. "model.layers.0.self_attn.q_proj.weight"
  std::vector<std::int64_t> shape;
  std::int64_t offset_elems = 0;  // inside its group
  std::int64_t num_elems = 0;
  bool is_norm = false;  // RMSNorm weight: initialized to 1
  bool is_bias = false;  // a linear layer's bias: initialized to 0
};

struct ParamGroup {
  int id = 0;
  std::string name;  // "embed", "layers.3", "head"
  std::vector<TensorSpec> tensors;
  std::int64_t num_elems = 0;  // including alignment padding
  // No gradient and no optimizer state: its working copy is read, never written back (a frozen
  // base under trainable adapters; every group when generating).
  bool frozen = false;
};

// Groups: 0 = "embed" (model.embed_tokens.weight); 1..L = "layers.i" in the order
// input_layernorm, self_attn.{q,k,v,o}_proj (each weight followed by its bias where the family
// has one), self_attn.{q,k}_norm (Qwen3), post_attention_layernorm, mlp.{gate,up,down}_proj
// (with biases under mlp_bias); L+1 = "head" (model.norm.weight, then lm_head.weight unless
// tie_word_embeddings).
class ParamLayout {
 public:
  static ParamLayout build(const LlamaConfig& config);
  // A layout made of the given groups (ids are renumbered in order). Used for one rank's shards.
  static ParamLayout from_groups(std::vector<ParamGroup> groups);

  const std::vector<ParamGroup>& groups() const { return groups_; }
  const ParamGroup& group(int id) const { return groups_.at(static_cast<std::size_t>(id)); }
  int num_groups() const { return static_cast<int>(groups_.size()); }
  int embed_group() const { return 0; }
  int layer_group(int layer) const { return 1 + layer; }
  int head_group() const { return num_groups() - 1; }
  std::int64_t total_elems() const { return total_elems_; }
  // Number of real parameters (without padding).
  std::int64_t num_parameters() const { return num_parameters_; }

  struct Location {
    int group;
    const TensorSpec* tensor;
  };
  std::optional<Location> find(const std::string& name) const;

 private:
  std::vector<ParamGroup> groups_;
  std::int64_t total_elems_ = 0;
  std::int64_t num_parameters_ = 0;
};

// Initializes one group like transformers' LlamaForCausalLM: linear and embedding weights
// ~ N(0, initializer_range), norm weights = 1, biases and padding = 0. Each group draws from its
// own stream seeded by (seed, group id), so the result does not depend on the order groups are
// visited; the group's elements are drawn in parallel chunks that give the same numbers as one
// thread drawing them in order.
void init_group(const LlamaConfig& config, const ParamGroup& group, std::uint64_t seed, float* out);

}  // namespace strata::model
