// LLaMA architecture hyperparameters, read from and written as a Hugging Face config.json.
#pragma once

#include <cstdint>
#include <string>

#include "strata/core/json.h"
#include "strata/core/status.h"

namespace strata::model {

struct LlamaConfig {
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

  std::int64_t head_dim() const { return hidden_size / num_attention_heads; }

  // Reads an HF LlamaConfig object. `where` names the source in errors ("model.config.json").
  // Unknown HF keys (torch_dtype, architectures, bos_token_id...) are accepted and ignored;
  // unsupported features (rope_scaling, attention_bias, mlp_bias, hidden_act other than silu)
  // are errors.
  static Result<LlamaConfig> from_json(const Json& json, const std::string& where);
  // An HF-compatible config.json object (model_type "llama", architectures LlamaForCausalLM).
  Json to_json() const;
  Status validate(const std::string& where) const;
};

}  // namespace strata::model
