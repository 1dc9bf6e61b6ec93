// Low-rank adapters (LoRA, PEFT's LoraConfig): on each targeted projection W [out, in] of every
// decoder block, y = x W^T + b + scaling * dropout(x) A^T B^T, with A [r, in] and B [out, r]
// trainable and the base frozen. PEFT's meaning for every key: scaling alpha / r (alpha / sqrt(r)
// with use_rslora), A drawn Kaiming-uniform (bound 1 / sqrt(in)), B zero.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "strata/core/rng.h"
#include "strata/model/llama_config.h"

namespace strata::model {

// The projections of a decoder block an adapter can sit on, in the block's order: attention's
// four, the MLP's three (an MoE layer's: every expert's), and an MoE layer's router (PEFT's
// "gate": Qwen3-MoE's mlp.gate, Mixtral's block_sparse_moe.gate [experts, hidden]), which is
// adapted only where target_modules names it.
enum class LoraTarget : std::uint8_t { kQ, kK, kV, kO, kGate, kUp, kDown, kRouter };
inline constexpr int kNumLoraTargets = 8;

// "q_proj", "k_proj", ... "down_proj", "gate": the names PEFT's target_modules use.
std::string_view lora_target_name(LoraTarget target);
// "self_attn.q_proj", ... "mlp.down_proj", "mlp.gate": the module's path inside a decoder layer
// (Mixtral's router: "block_sparse_moe.gate").
std::string_view lora_module_path(LoraTarget target, ModelFamily family = ModelFamily::kLlama);
// A target_modules name: one of the above, or Mixtral's expert names w1 (gate_proj), w3
// (up_proj), w2 (down_proj), which adapt the same projections.
std::optional<LoraTarget> parse_lora_target(std::string_view name);
// Whether `target`'s adapter sits in a layer's own adapter group: an MoE layer's MLP
// projections are its experts' (their adapters in the experts' groups), and only an MoE layer
// has a router.
constexpr bool in_layer_adapters(LoraTarget target, bool moe_layer) {
  const bool mlp =
      target == LoraTarget::kGate || target == LoraTarget::kUp || target == LoraTarget::kDown;
  return moe_layer ? !mlp : target != LoraTarget::kRouter;
}
// The projection's input and output features in this model.
std::int64_t lora_in_features(const LlamaConfig& config, LoraTarget target);
std::int64_t lora_out_features(const LlamaConfig& config, LoraTarget target);

struct LoraConfig {
  std::int64_t r = 16;
  double alpha = 32;
  double dropout = 0;  // probability of zeroing an input element of an adapter (training only)
  std::array<bool, kNumLoraTargets> targets = all_linear();
  bool use_rslora = false;
  // PEFT's modules_to_save: modules outside the adapters that train in full beside them and are
  // saved whole with the adapters. Strata trains the embedding, the head and the norms this way.
  // An entry names every such module whose path (model.embed_tokens, lm_head, model.norm,
  // model.layers.N.input_layernorm, model.layers.N.post_attention_layernorm,
  // model.layers.N.self_attn.q_norm / k_norm) is the entry or ends with "." + the entry:
  // "norm" is model.norm alone, "input_layernorm" every block's, "layers.0.input_layernorm" one.
  std::vector<std::string> modules_to_save;

  // target_modules "all-linear": every projection of the decoder blocks (the experts'
  // included); the router only where named.
  static constexpr std::array<bool, kNumLoraTargets> all_linear() {
    return {true, true, true, true, true, true, true, false};
  }
  bool targets_any() const;
  // Whether the module at `path` (a tensor's name less ".weight") is one of modules_to_save.
  bool saves(std::string_view path) const;
  bool has(LoraTarget t) const { return targets[static_cast<std::size_t>(t)]; }
  // The adapter's output scale, as PEFT forms it in double; the model multiplies in f32.
  double scaling() const;
  // target_modules, in the block's order, as `family` names its modules (Mixtral's experts:
  // w1, w3, w2 for gate, up, down).
  std::vector<std::string> target_names(ModelFamily family = ModelFamily::kLlama) const;
};

// Whether `name` is an adapter's tensor (....lora_A.weight or ....lora_B.weight).
bool is_lora_tensor(std::string_view name);

// The paths of the modules of `config` that modules_to_save can name, in the model's order.
std::vector<std::string> saveable_modules(const LlamaConfig& config);
// A problem with an adapter's settings for a model: the key (target_modules, modules_to_save)
// and what is wrong, naming the entry and what was expected.
struct LoraProblem {
  std::string key, text;
};
// Every problem with `lora` for `config`: a modules_to_save entry that names no saveable module
// (a projection, to adapt with target_modules; lm_head under tie_word_embeddings, which is
// embed_tokens; an unknown name); the router ("gate") targeted in a model without MoE layers.
std::vector<LoraProblem> lora_problems(const LlamaConfig& config, const LoraConfig& lora);

// The dropout mask key (device::Ops::dropout) of adapter `target` of layer `layer` in a micro-batch
// whose key is `key`.
inline constexpr std::uint64_t lora_dropout_key(std::uint64_t key, std::int64_t layer,
                                                LoraTarget target) {
  return strata::splitmix64_at(key, static_cast<std::uint64_t>(layer) * kNumLoraTargets +
                                        static_cast<std::uint64_t>(target));
}

// The layer number an MoE layer's expert's adapters draw their dropout masks as (with
// lora_dropout_key): past every decoder layer, one for each expert of each layer.
inline constexpr std::int64_t expert_lora_layer(std::int64_t num_layers, std::int64_t experts,
                                                std::int64_t layer, std::int64_t expert) {
  return num_layers + layer * experts + expert;
}

}  // namespace strata::model
