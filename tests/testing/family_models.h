// Small models of each family Strata trains, each with the family's own tensors and positions
// (biases, Qwen3's q/k norms and a q_proj wider than the hidden size, sliding windows, Llama 3's
// rope scaling), for tests that run every family through some path.
#pragma once

#include <string>
#include <vector>

#include "strata/core/json.h"

namespace strata::testing {

// "llama3" (biases and Llama 3's rope scaling), "mistral" (a sliding window), "qwen2" (a window
// on the upper layers), "qwen3" (q/k norms, head_dim 12), and the mixtures of experts
// "qwen3-moe" and "mixtral": vocabulary 256, hidden 32, `layers` layers, 64 positions, untied.
inline Json family_model(const std::string& family, int layers) {
  Json m = Json::parse(R"({"vocab_size": 256, "hidden_size": 32, "intermediate_size": 48,
                           "num_attention_heads": 4, "num_key_value_heads": 2,
                           "max_position_embeddings": 64})");
  m["num_hidden_layers"] = layers;
  if (family == "llama3") {
    m.merge_patch(Json::parse(R"({"model_type": "llama", "attention_bias": true,
        "mlp_bias": true, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16}})"));
  } else if (family == "mistral") {
    m.merge_patch(Json::parse(R"({"model_type": "mistral", "sliding_window": 6})"));
  } else if (family == "qwen2") {
    m.merge_patch(Json::parse(R"({"model_type": "qwen2", "use_sliding_window": true,
        "sliding_window": 5, "max_window_layers": 1})"));
  } else if (family == "qwen3") {
    m.merge_patch(
        Json::parse(R"({"model_type": "qwen3", "head_dim": 12, "attention_bias": true})"));
  } else if (family == "qwen3-moe") {
    // 16 experts of which a token picks 2: a micro-batch of 16 tokens leaves some unchosen.
    // Layer 1 keeps a dense MLP.
    m.merge_patch(Json::parse(R"({"model_type": "qwen3_moe", "head_dim": 12,
        "num_experts": 16, "num_experts_per_tok": 2, "moe_intermediate_size": 8,
        "norm_topk_prob": true, "mlp_only_layers": [1], "router_aux_loss_coef": 0.02,
        "output_router_logits": true})"));
  } else if (family == "mixtral") {
    m.merge_patch(Json::parse(R"({"model_type": "mixtral", "num_local_experts": 8,
        "num_experts_per_tok": 2, "intermediate_size": 16, "sliding_window": 6,
        "router_aux_loss_coef": 0.02, "output_router_logits": true})"));
  }
  return m;
}

// The mixture-of-experts families, as family_model makes them.
inline const std::vector<std::string>& moe_families() {
  static const std::vector<std::string> all = {"qwen3-moe", "mixtral"};
  return all;
}

inline const std::vector<std::string>& families() {
  static const std::vector<std::string> all = {"llama3", "mistral", "qwen2", "qwen3"};
  return all;
}

}  // namespace strata::testing
