// LlamaConfig <-> Hugging Face config.json.
#include "strata/model/llama_config.h"

#include <vector>

namespace strata::model {

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
  if (num_attention_heads > 0 && hidden_size % num_attention_heads != 0)
    errors.push_back("hidden_size " + std::to_string(hidden_size) +
                     " must be divisible by num_attention_heads " +
                     std::to_string(num_attention_heads));
  if (num_key_value_heads > 0 && num_attention_heads % num_key_value_heads != 0)
    errors.push_back("num_attention_heads " + std::to_string(num_attention_heads) +
                     " must be divisible by num_key_value_heads " +
                     std::to_string(num_key_value_heads));
  if (num_attention_heads > 0 && hidden_size % num_attention_heads == 0 && head_dim() % 2 != 0)
    errors.push_back("head_dim " + std::to_string(head_dim()) +
                     " must be even for rotary embedding");
  if (!(rope_theta > 0)) errors.push_back("rope_theta must be > 0");
  if (!(rms_norm_eps > 0)) errors.push_back("rms_norm_eps must be > 0");
  if (!(initializer_range > 0)) errors.push_back("initializer_range must be > 0");
  if (errors.empty()) return Status::ok();
  std::string msg = "invalid model config in " + where + ":";
  for (const auto& e : errors) msg += "\n  " + e;
  return invalid_argument(msg);
}

Result<LlamaConfig> LlamaConfig::from_json(const Json& json, const std::string& where) {
  if (!json.is_object()) return invalid_argument(where + ": model config must be a JSON object");
  std::vector<std::string> errors;
  JsonReader r(json, "", &errors);
  LlamaConfig c;
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
  if (const Json* v = r.raw("model_type"); v && *v != "llama")
    r.error("model_type", "expected \"llama\", got " + v->dump());
  if (const Json* v = r.raw("hidden_act"); v && *v != "silu")
    r.error("hidden_act", "only \"silu\" is supported, got " + v->dump());
  if (const Json* v = r.raw("rope_scaling"); v && !v->is_null())
    r.error("rope_scaling", "rope scaling is not supported, got " + v->dump());
  if (const Json* v = r.raw("attention_bias"); v && *v != false)
    r.error("attention_bias", "attention biases are not supported");
  if (const Json* v = r.raw("mlp_bias"); v && *v != false)
    r.error("mlp_bias", "MLP biases are not supported");
  if (const Json* v = r.raw("head_dim");
      v && v->is_number_integer() && c.num_attention_heads > 0 &&
      v->get<std::int64_t>() != c.hidden_size / c.num_attention_heads)
    r.error("head_dim", "must equal hidden_size / num_attention_heads");
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
  return Json{
      {"architectures", {"LlamaForCausalLM"}},
      {"model_type", "llama"},
      {"vocab_size", vocab_size},
      {"hidden_size", hidden_size},
      {"intermediate_size", intermediate_size},
      {"num_hidden_layers", num_hidden_layers},
      {"num_attention_heads", num_attention_heads},
      {"num_key_value_heads", num_key_value_heads},
      {"head_dim", head_dim()},
      {"max_position_embeddings", max_position_embeddings},
      {"rope_theta", rope_theta},
      {"rms_norm_eps", rms_norm_eps},
      {"initializer_range", initializer_range},
      {"tie_word_embeddings", tie_word_embeddings},
      {"hidden_act", "silu"},
      {"attention_bias", false},
      {"mlp_bias", false},
      {"rope_scaling", nullptr},
      {"torch_dtype", "float32"},
  };
}

}  // namespace strata::model
