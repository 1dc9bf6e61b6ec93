// LLaMA-family architecture hyperparameters, read from and written as a Hugging Face
// config.json: Llama (1, 2, 3.x), Mistral, Qwen2 / Qwen2.5, Qwen3 and the mixture-of-experts
// Qwen3-MoE and Mixtral share one decoder and differ in a few places, each a field here.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "strata/core/json.h"
#include "strata/core/status.h"
#include "strata/device/rope.h"

namespace strata::model {

enum class ModelFamily : std::uint8_t { kLlama, kMistral, kQwen2, kQwen3, kQwen3Moe, kMixtral };
// "llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral"
std::string_view model_type_name(ModelFamily family);
std::string_view architecture_name(ModelFamily family);  // "LlamaForCausalLM", ...

// A sparse mixture-of-experts MLP (Qwen3MoeSparseMoeBlock, MixtralSparseMoeBlock): in an MoE
// layer a router (a [num_experts, hidden] projection) scores the experts for each token, the
// softmax's top experts_per_token are chosen, their weights renormalized where the family does,
// and the token's MLP output is the weighted sum of its experts' SwiGLU outputs. With aux_loss,
// transformers' load-balancing loss over the MoE layers is added with aux_loss_coef.
struct MoeConfig {
  std::int64_t num_experts = 0;        // num_experts (Mixtral: num_local_experts); 0: no MoE layer
  std::int64_t experts_per_token = 0;  // num_experts_per_tok
  std::int64_t expert_intermediate_size = 0;  // moe_intermediate_size (Mixtral: intermediate_size)
  bool normalize_top_k = false;               // norm_topk_prob (Mixtral: always)
  std::int64_t sparse_step = 1;               // decoder_sparse_step: every n-th layer is MoE
  std::vector<std::int64_t> dense_layers;     // mlp_only_layers: a dense MLP of intermediate_size
  double aux_loss_coef = 0.001;               // router_aux_loss_coef
  bool aux_loss = false;                      // output_router_logits
};

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
  MoeConfig moe;
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
  // Whether layer `layer`'s MLP is a mixture of experts (Qwen3MoeDecoderLayer's rule: not in
  // mlp_only_layers, and every decoder_sparse_step-th layer; Mixtral: every layer).
  bool is_moe_layer(std::int64_t layer) const;
  bool has_moe() const { return moe.num_experts > 0; }

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
