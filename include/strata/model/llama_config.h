// LLaMA-family architecture hyperparameters, read from and written as a Hugging Face
// config.json: Llama (1, 2, 3.x), Mistral, Qwen2 / Qwen2.5 and Qwen3 share one decoder and differ
// in a few places, each a field here.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "strata/core/json.h"
#include "strata/core/status.h"
#include "strata/device/rope.h"

namespace strata::model {

enum class ModelFamily : std::uint8_t { kLlama, kMistral, kQwen2, kQwen3 };
std::string_view model_type_name(ModelFamily family);    // "llama", "mistral", "qwen2", "qwen3"
std::string_view architecture_name(ModelFamily family);  // "LlamaForCausalLM", ...

struct LlamaConfig {
  ModelFamily family = ModelFamily::kLlama;
  std::int64_t vocab_size = 256;
  std::int64_t hidden_size = 128;
  std::int64_t intermediate_size = 344;
  std::int64_t num_hidden_layers = 4;
  std::int64_t num_attention_heads = 4;
  std::int64_t num_key_value_heads = 4;  // defaults to num_attention_heads when absent
  std::int64_t max_position_embeddings = 2048;
  double rope_theta = 10000.0;
  double rms_norm_eps = 1e-6;
  double initializer_range = 0.02;
  bool tie_word_embeddings = false;
  // An explicit head_dim (Qwen3, some Llama 3 shapes); 0: hidden_size / num_attention_heads.
  std::int64_t explicit_head_dim = 0;
  // Biases: on q/k/v_proj (Llama attention_bias, always for Qwen2), on o_proj (Llama and Qwen3
  // attention_bias; never Qwen2), on gate/up/down_proj (Llama mlp_bias).
  bool qkv_bias = false;
  bool o_bias = false;
  bool mlp_bias = false;
  // Qwen3: RMSNorm over each head's head_dim on q and k (q_norm, k_norm), before the rotation.
  bool qk_norm = false;
  // Sliding-window attention: query i attends to keys j with 0 <= i - j < sliding_window, in
  // the layers window_layers_from onward (Mistral: all; Qwen2/3 with use_sliding_window:
  // max_window_layers onward). 0: full causal attention everywhere.
  std::int64_t sliding_window = 0;
  std::int64_t window_layers_from = 0;
  // rope_scaling / rope_parameters: none, "linear" or "llama3" (theta is rope_theta).
  device::RopeScaling rope_scaling;
  // The config.json object as read, so a saved checkpoint keeps the keys Strata does not use
  // (bos_token_id, rope_scaling's spelling, ...). Empty for an inline config.
  Json source;

  std::int64_t head_dim() const {
    return explicit_head_dim > 0 ? explicit_head_dim : hidden_size / num_attention_heads;
  }
  std::int64_t q_dim() const { return num_attention_heads * head_dim(); }
  std::int64_t kv_dim() const { return num_key_value_heads * head_dim(); }
  // The attention window of layer `layer` (0: none).
  std::int64_t window_of(std::int64_t layer) const {
    return sliding_window > 0 && layer >= window_layers_from ? sliding_window : 0;
  }
  device::RopeParams rope() const { return device::RopeParams(rope_theta, rope_scaling); }

  // Reads an HF config object of one of the families. `where` names the source in errors
  // ("model.config.json"). Keys Strata does not interpret (torch_dtype, bos_token_id...) are
  // kept in `source`; features it does not implement (rope types other than linear and llama3,
  // hidden_act other than silu, ...) are errors naming the key and value.
  static Result<LlamaConfig> from_json(const Json& json, const std::string& where);
  // An HF config.json object of the family (model_type, architectures), `source`'s other keys
  // kept, so transformers loads it as the same class.
  Json to_json() const;
  Status validate(const std::string& where) const;
};

}  // namespace strata::model
