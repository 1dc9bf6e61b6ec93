// LlamaConfig <-> Hugging Face config.json, for the Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE and
// Mixtral families.
#include "strata/model/llama_config.h"

#include <algorithm>
#include <vector>

namespace strata::model {

std::string_view model_type_name(ModelFamily family) {
  switch (family) {
    case ModelFamily::kLlama:
      return "llama";
    case ModelFamily::kMistral:
      return "mistral";
    case ModelFamily::kQwen2:
      return "qwen2";
    case ModelFamily::kQwen3:
      return "qwen3";
    case ModelFamily::kQwen3Moe:
      return "qwen3_moe";
    case ModelFamily::kMixtral:
      return "mixtral";
  }
  return "?";
}

std::string_view architecture_name(ModelFamily family) {
  switch (family) {
    case ModelFamily::kLlama:
      return "LlamaForCausalLM";
    case ModelFamily::kMistral:
      return "MistralForCausalLM";
    case ModelFamily::kQwen2:
      return "Qwen2ForCausalLM";
    case ModelFamily::kQwen3:
      return "Qwen3ForCausalLM";
    case ModelFamily::kQwen3Moe:
      return "Qwen3MoeForCausalLM";
    case ModelFamily::kMixtral:
      return "MixtralForCausalLM";
  }
  return "?";
}

bool LlamaConfig::is_moe_layer(std::int64_t layer) const {
  if (moe.num_experts == 0) return false;
  // Mixtral: no mlp_only_layers, a sparse step of 1.
  return std::find(moe.dense_layers.begin(), moe.dense_layers.end(), layer) ==
             moe.dense_layers.end() &&
         (layer + 1) % moe.sparse_step == 0;
}

Status LlamaConfig::validate(const std::string& where) const {
  std::vector<std::string> errors;
  auto positive = [&](const char* key, std::int64_t v) {
    if (v <= 0) errors.push_back(std::string(key) + " must be > 0, got " + std::to_string(v));
  };
  positive("vocab_size", vocab_size);
  positive("hidden_size", hidden_size);
  positive("intermediate_size", intermediate_size);
  positive("num_hidden_layers", num_hidden_layers);
  positive("num_attention_heads", num_attention_heads);
  positive("num_key_value_heads", num_key_value_heads);
  positive("max_position_embeddings", max_position_embeddings);
  if (explicit_head_dim == 0 && num_attention_heads > 0 && hidden_size % num_attention_heads != 0)
    errors.push_back("hidden_size " + std::to_string(hidden_size) +
                     " must be divisible by num_attention_heads " +
                     std::to_string(num_attention_heads) + " (or set head_dim)");
  if (num_key_value_heads > 0 && num_attention_heads % num_key_value_heads != 0)
    errors.push_back("num_attention_heads " + std::to_string(num_attention_heads) +
                     " must be divisible by num_key_value_heads " +
                     std::to_string(num_key_value_heads));
  if (num_attention_heads > 0 && head_dim() > 0 && head_dim() % 2 != 0)
    errors.push_back("head_dim " + std::to_string(head_dim()) +
                     " must be even for rotary embedding");
  if (!(rope_theta > 0)) errors.push_back("rope_theta must be > 0");
  if (!(rms_norm_eps > 0)) errors.push_back("rms_norm_eps must be > 0");
  if (!(initializer_range > 0)) errors.push_back("initializer_range must be > 0");
  if (sliding_window < 0) errors.push_back("sliding_window must be >= 0");
  if (has_moe()) {
    const char* k = family == ModelFamily::kMixtral ? "num_local_experts" : "num_experts";
    if (moe.experts_per_token < 1 || moe.experts_per_token > moe.num_experts) {
      errors.push_back("num_experts_per_tok must be in [1, " + std::string(k) + " " +
                       std::to_string(moe.num_experts) + "], got " +
                       std::to_string(moe.experts_per_token));
    }
    positive(family == ModelFamily::kMixtral ? "intermediate_size" : "moe_intermediate_size",
             moe.expert_intermediate_size);
    positive("decoder_sparse_step", moe.sparse_step);
    for (const std::int64_t l : moe.dense_layers) {
      if (l < 0 || l >= num_hidden_layers) {
        errors.push_back("mlp_only_layers holds layer " + std::to_string(l) +
                         ", outside [0, num_hidden_layers " + std::to_string(num_hidden_layers) +
                         ")");
      }
    }
    if (!(moe.aux_loss_coef >= 0)) errors.push_back("router_aux_loss_coef must be >= 0");
  }
  if (errors.empty()) return Status::ok();
  std::string msg = "invalid model config in " + where + ":";
  for (const auto& e : errors) msg += "\n  " + e;
  return invalid_argument(msg);
}

namespace {

// rope_scaling (transformers v4) or rope_parameters (v5): {"rope_type" (or "type"), "factor",
// ...}; v5 also carries rope_theta inside.
void read_rope(JsonReader& r, const char* key, LlamaConfig* c) {
  const Json* v = r.raw(key);
  if (v == nullptr || v->is_null()) return;
  if (!v->is_object()) {
    r.error(key, "expected an object with \"rope_type\", got " + v->dump());
    return;
  }
  std::string type = "default";
  if (v->contains("rope_type") && (*v)["rope_type"].is_string()) {
    type = (*v)["rope_type"].get<std::string>();
  } else if (v->contains("type") && (*v)["type"].is_string()) {
    type = (*v)["type"].get<std::string>();
  }
  if (v->contains("rope_theta") && (*v)["rope_theta"].is_number()) {
    c->rope_theta = (*v)["rope_theta"].get<double>();
  }
  auto number = [&](const char* field, double* out, bool required) {
    if (v->contains(field) && (*v)[field].is_number()) {
      *out = (*v)[field].get<double>();
    } else if (required) {
      r.error(key, std::string("rope_type \"") + type + "\" needs a number \"" + field + "\"");
    }
  };
  device::RopeScaling& s = c->rope_scaling;
  if (type == "default") {
    s.type = device::RopeScaling::kNone;
  } else if (type == "linear") {
    s.type = device::RopeScaling::kLinear;
    number("factor", &s.factor, true);
  } else if (type == "llama3") {
    s.type = device::RopeScaling::kLlama3;
    number("factor", &s.factor, true);
    number("low_freq_factor", &s.low_freq_factor, true);
    number("high_freq_factor", &s.high_freq_factor, true);
    number("original_max_position_embeddings", &s.original_max_position_embeddings, true);
    if (s.high_freq_factor <= s.low_freq_factor) {
      r.error(key, "llama3 rope scaling needs high_freq_factor > low_freq_factor");
    }
  } else {
    r.error(key, "rope_type \"" + type +
                     "\" is not supported (supported: default, linear, llama3); got " + v->dump());
  }
  if (s.type != device::RopeScaling::kNone && !(s.factor > 0)) {
    r.error(key, "factor must be > 0");
  }
}

// The MoE keys of Qwen3MoeConfig and MixtralConfig, with transformers' defaults.
void read_moe(JsonReader& r, LlamaConfig* c) {
  MoeConfig& m = c->moe;
  if (c->family == ModelFamily::kQwen3Moe) {
    m.num_experts = 128;
    m.experts_per_token = 8;
    m.expert_intermediate_size = 768;
    r.read("num_experts", &m.num_experts, 0);
    r.read("moe_intermediate_size", &m.expert_intermediate_size, 0);
    r.read("norm_topk_prob", &m.normalize_top_k);
    r.read("decoder_sparse_step", &m.sparse_step, 0);
    if (const Json* v = r.raw("mlp_only_layers"); v != nullptr && !v->is_null()) {
      r.read("mlp_only_layers", &m.dense_layers);
    }
  } else if (c->family == ModelFamily::kMixtral) {
    m.num_experts = 8;
    m.experts_per_token = 2;
    m.normalize_top_k = true;
    r.read("num_local_experts", &m.num_experts, 1);
    m.expert_intermediate_size = c->intermediate_size;
    if (r.has("intermediate_size")) r.read("intermediate_size", &m.expert_intermediate_size, 1);
    double jitter = 0;
    r.read("router_jitter_noise", &jitter, 0.0);
    if (jitter != 0) {
      r.error(
          "router_jitter_noise",
          "training-time router noise is not supported: expected 0, got " + std::to_string(jitter));
    }
  } else {
    return;
  }
  r.read("num_experts_per_tok", &m.experts_per_token, 0);
  r.read("router_aux_loss_coef", &m.aux_loss_coef, 0.0);
  r.read("output_router_logits", &m.aux_loss);
}

}  // namespace

Result<LlamaConfig> LlamaConfig::from_json(const Json& json, const std::string& where) {
  if (!json.is_object()) return invalid_argument(where + ": model config must be a JSON object");
  std::vector<std::string> errors;
  JsonReader r(json, "", &errors);
  LlamaConfig c;
  c.source = json;
  if (const Json* v = r.raw("model_type")) {
    const std::string t = v->is_string() ? v->get<std::string>() : v->dump();
    if (t == "llama") {
      c.family = ModelFamily::kLlama;
    } else if (t == "mistral") {
      c.family = ModelFamily::kMistral;
    } else if (t == "qwen2") {
      c.family = ModelFamily::kQwen2;
    } else if (t == "qwen3") {
      c.family = ModelFamily::kQwen3;
    } else if (t == "qwen3_moe") {
      c.family = ModelFamily::kQwen3Moe;
    } else if (t == "mixtral") {
      c.family = ModelFamily::kMixtral;
    } else {
      r.error("model_type",
              "expected \"llama\", \"mistral\", \"qwen2\", \"qwen3\", \"qwen3_moe\" or "
              "\"mixtral\", got " +
                  v->dump());
    }
  }
  r.read("vocab_size", &c.vocab_size, 1);
  r.read("hidden_size", &c.hidden_size, 1);
  r.read("intermediate_size", &c.intermediate_size, 1);
  r.read("num_hidden_layers", &c.num_hidden_layers, 1);
  r.read("num_attention_heads", &c.num_attention_heads, 1);
  c.num_key_value_heads = c.num_attention_heads;
  r.read("num_key_value_heads", &c.num_key_value_heads, 1);
  r.read("max_position_embeddings", &c.max_position_embeddings, 1);
  r.read("rope_theta", &c.rope_theta, 0.0);
  r.read("rms_norm_eps", &c.rms_norm_eps, 0.0);
  r.read("initializer_range", &c.initializer_range, 0.0);
  r.read("tie_word_embeddings", &c.tie_word_embeddings);
  if (r.has("head_dim")) r.read("head_dim", &c.explicit_head_dim, 1);
  if (const Json* v = r.raw("hidden_act"); v && *v != "silu")
    r.error("hidden_act", "only \"silu\" is supported, got " + v->dump());
  read_rope(r, "rope_scaling", &c);
  read_rope(r, "rope_parameters", &c);

  bool attention_bias = false, mlp_bias = false;
  r.read("attention_bias", &attention_bias);
  r.read("mlp_bias", &mlp_bias);
  const bool qwen = c.family == ModelFamily::kQwen2 || c.family == ModelFamily::kQwen3 ||
                    c.family == ModelFamily::kQwen3Moe;
  switch (c.family) {
    case ModelFamily::kLlama:
      c.qkv_bias = c.o_bias = attention_bias;
      c.mlp_bias = mlp_bias;
      break;
    case ModelFamily::kMistral:
      if (attention_bias) r.error("attention_bias", "Mistral has no attention biases");
      if (mlp_bias) r.error("mlp_bias", "Mistral has no MLP biases");
      break;
    case ModelFamily::kQwen2:
      c.qkv_bias = true;  // q/k/v_proj always carry biases; o_proj never
      if (mlp_bias) r.error("mlp_bias", "Qwen2 has no MLP biases");
      break;
    case ModelFamily::kQwen3:
    case ModelFamily::kQwen3Moe:
      c.qkv_bias = c.o_bias = attention_bias;
      c.qk_norm = true;
      if (mlp_bias) r.error("mlp_bias", "Qwen3 has no MLP biases");
      break;
    case ModelFamily::kMixtral:
      if (attention_bias) r.error("attention_bias", "Mixtral has no attention biases");
      if (mlp_bias) r.error("mlp_bias", "Mixtral has no MLP biases");
      break;
  }
  read_moe(r, &c);

  // Sliding windows.
  std::int64_t window = 0;
  if (const Json* v = r.raw("sliding_window"); v && !v->is_null()) {
    if (!v->is_number_integer() || v->get<std::int64_t>() < 1) {
      r.error("sliding_window", "expected a positive integer or null, got " + v->dump());
    } else {
      window = v->get<std::int64_t>();
    }
  }
  if (c.family == ModelFamily::kMistral || c.family == ModelFamily::kMixtral) {
    c.sliding_window = window;
  } else if (qwen) {
    bool use = false;
    r.read("use_sliding_window", &use);
    std::int64_t from = c.num_hidden_layers;
    if (r.has("max_window_layers")) r.read("max_window_layers", &from, 0);
    if (use && window > 0) {
      c.sliding_window = window;
      c.window_layers_from = from;
    }
  } else if (window > 0) {
    r.error("sliding_window", "Llama has no sliding window (model_type \"mistral\" has)");
  }
  if (const Json* v = r.raw("layer_types"); v && !v->is_null()) {
    // transformers' explicit per-layer attention kinds: the sliding layers must be a suffix,
    // as max_window_layers makes them.
    if (!v->is_array()) {
      r.error("layer_types", "expected a list of \"full_attention\" / \"sliding_attention\"");
    } else {
      std::int64_t first_sliding = static_cast<std::int64_t>(v->size());
      bool suffix = true;
      for (std::size_t i = 0; i < v->size(); ++i) {
        const bool sliding = (*v)[i] == "sliding_attention";
        if (!sliding && (*v)[i] != "full_attention") {
          r.error("layer_types", "entry " + std::to_string(i) + " is " + (*v)[i].dump() +
                                     ", expected \"full_attention\" or \"sliding_attention\"");
        }
        if (sliding && first_sliding == static_cast<std::int64_t>(v->size())) {
          first_sliding = static_cast<std::int64_t>(i);
        }
        if (!sliding && first_sliding < static_cast<std::int64_t>(v->size())) suffix = false;
      }
      if (!suffix) {
        r.error("layer_types",
                "sliding-window layers after a full-attention one are not supported");
      } else if (first_sliding < static_cast<std::int64_t>(v->size())) {
        if (window == 0) r.error("layer_types", "sliding_attention layers need sliding_window");
        c.sliding_window = window;
        c.window_layers_from = first_sliding;
      } else {
        c.sliding_window = 0;
      }
    }
  }

  for (const char* required : {"vocab_size", "hidden_size", "intermediate_size",
                               "num_hidden_layers", "num_attention_heads"}) {
    if (!r.has(required)) r.error(required, "is required");
  }
  if (!errors.empty()) {
    std::string msg = "invalid model config in " + where + ":";
    for (const auto& e : errors) msg += "\n  " + e;
    return invalid_argument(msg);
  }
  STRATA_RETURN_IF_ERROR(c.validate(where));
  return c;
}

Json LlamaConfig::to_json() const {
  Json j = source.is_object() ? source : Json::object();
  j["architectures"] = {std::string(architecture_name(family))};
  j["model_type"] = std::string(model_type_name(family));
  j["vocab_size"] = vocab_size;
  j["hidden_size"] = hidden_size;
  j["intermediate_size"] = intermediate_size;
  j["num_hidden_layers"] = num_hidden_layers;
  j["num_attention_heads"] = num_attention_heads;
  j["num_key_value_heads"] = num_key_value_heads;
  j["head_dim"] = head_dim();
  j["max_position_embeddings"] = max_position_embeddings;
  j["rope_theta"] = rope_theta;
  j["rms_norm_eps"] = rms_norm_eps;
  j["initializer_range"] = initializer_range;
  j["tie_word_embeddings"] = tie_word_embeddings;
  j["hidden_act"] = "silu";
  if (family == ModelFamily::kLlama || family == ModelFamily::kQwen3 ||
      family == ModelFamily::kQwen3Moe) {
    j["attention_bias"] = qkv_bias;
  }
  if (family == ModelFamily::kQwen3Moe) {
    j["num_experts"] = moe.num_experts;
    j["moe_intermediate_size"] = moe.expert_intermediate_size;
    j["norm_topk_prob"] = moe.normalize_top_k;
    j["decoder_sparse_step"] = moe.sparse_step;
    j["mlp_only_layers"] = moe.dense_layers;
  } else if (family == ModelFamily::kMixtral) {
    j["num_local_experts"] = moe.num_experts;
    j["intermediate_size"] = moe.expert_intermediate_size;
    j["router_jitter_noise"] = 0.0;
  }
  if (has_moe()) {
    j["num_experts_per_tok"] = moe.experts_per_token;
    j["router_aux_loss_coef"] = moe.aux_loss_coef;
    j["output_router_logits"] = moe.aux_loss;
  }
  if (family == ModelFamily::kLlama) j["mlp_bias"] = mlp_bias;
  if (!j.contains("rope_scaling") && !j.contains("rope_parameters")) {
    if (rope_scaling.type == device::RopeScaling::kNone) {
      j["rope_scaling"] = nullptr;
    } else if (rope_scaling.type == device::RopeScaling::kLinear) {
      j["rope_scaling"] = {{"rope_type", "linear"}, {"factor", rope_scaling.factor}};
    } else {
      j["rope_scaling"] = {
          {"rope_type", "llama3"},
          {"factor", rope_scaling.factor},
          {"low_freq_factor", rope_scaling.low_freq_factor},
          {"high_freq_factor", rope_scaling.high_freq_factor},
          {"original_max_position_embeddings", rope_scaling.original_max_position_embeddings}};
    }
  }
  if (family == ModelFamily::kMistral || family == ModelFamily::kMixtral) {
    j["sliding_window"] = sliding_window > 0 ? Json(sliding_window) : Json();
  } else if (family == ModelFamily::kQwen2 || family == ModelFamily::kQwen3 ||
             family == ModelFamily::kQwen3Moe) {
    if (!j.contains("use_sliding_window")) j["use_sliding_window"] = sliding_window > 0;
    if (sliding_window > 0) {
      j["sliding_window"] = sliding_window;
      j["max_window_layers"] = window_layers_from;
    }
  }
  j["torch_dtype"] = "float32";
  return j;
}

}  // namespace strata::model
