// LoRA's names and shapes: PEFT's target_modules and the projections they sit on.
#include "strata/model/lora.h"

#include <cmath>

namespace strata::model {
namespace {

// PEFT's name and the module's path in a decoder layer, and where Mixtral names them otherwise
// (its experts' w1, w3, w2; its router under block_sparse_moe), those.
struct TargetInfo {
  std::string_view name, path, mixtral_name, mixtral_path;
};
constexpr TargetInfo kTargets[kNumLoraTargets] = {
    {"q_proj", "self_attn.q_proj", "", ""},   {"k_proj", "self_attn.k_proj", "", ""},
    {"v_proj", "self_attn.v_proj", "", ""},   {"o_proj", "self_attn.o_proj", "", ""},
    {"gate_proj", "mlp.gate_proj", "w1", ""}, {"up_proj", "mlp.up_proj", "w3", ""},
    {"down_proj", "mlp.down_proj", "w2", ""}, {"gate", "mlp.gate", "", "block_sparse_moe.gate"}};

}  // namespace

std::string_view lora_target_name(LoraTarget target) {
  return kTargets[static_cast<int>(target)].name;
}

std::string_view lora_module_path(LoraTarget target, ModelFamily family) {
  const TargetInfo& t = kTargets[static_cast<int>(target)];
  return family == ModelFamily::kMixtral && !t.mixtral_path.empty() ? t.mixtral_path : t.path;
}

std::optional<LoraTarget> parse_lora_target(std::string_view name) {
  for (int i = 0; i < kNumLoraTargets; ++i) {
    if (kTargets[i].name == name || (!name.empty() && kTargets[i].mixtral_name == name)) {
      return static_cast<LoraTarget>(i);
    }
  }
  return std::nullopt;
}

std::int64_t lora_in_features(const LlamaConfig& c, LoraTarget target) {
  switch (target) {
    case LoraTarget::kO:
      return c.q_dim();
    case LoraTarget::kDown:
      return c.intermediate_size;
    default:
      return c.hidden_size;
  }
}

std::int64_t lora_out_features(const LlamaConfig& c, LoraTarget target) {
  switch (target) {
    case LoraTarget::kQ:
      return c.q_dim();
    case LoraTarget::kK:
    case LoraTarget::kV:
      return c.kv_dim();
    case LoraTarget::kGate:
    case LoraTarget::kUp:
      return c.intermediate_size;
    case LoraTarget::kRouter:
      return c.moe.num_experts;
    default:
      return c.hidden_size;
  }
}

bool LoraConfig::targets_any() const {
  for (bool t : targets) {
    if (t) return true;
  }
  return false;
}

double LoraConfig::scaling() const {
  const double rank = static_cast<double>(r);
  return use_rslora ? alpha / std::sqrt(rank) : alpha / rank;
}

namespace {

bool names_module(std::string_view entry, std::string_view path) {
  if (entry.empty() || entry.size() > path.size()) return false;
  if (entry.size() == path.size()) return entry == path;
  return path.substr(path.size() - entry.size()) == entry &&
         path[path.size() - entry.size() - 1] == '.';
}

}  // namespace

bool LoraConfig::saves(std::string_view path) const {
  for (const auto& entry : modules_to_save) {
    if (names_module(entry, path)) return true;
  }
  return false;
}

bool is_lora_tensor(std::string_view name) {
  return name.ends_with(".lora_A.weight") || name.ends_with(".lora_B.weight");
}

std::vector<std::string> saveable_modules(const LlamaConfig& c) {
  std::vector<std::string> paths = {"model.embed_tokens"};
  for (std::int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    paths.push_back(p + "input_layernorm");
    if (c.qk_norm) {
      paths.push_back(p + "self_attn.q_norm");
      paths.push_back(p + "self_attn.k_norm");
    }
    paths.push_back(p + "post_attention_layernorm");
  }
  paths.emplace_back("model.norm");
  if (!c.tie_word_embeddings) paths.emplace_back("lm_head");
  return paths;
}

std::vector<LoraProblem> lora_problems(const LlamaConfig& c, const LoraConfig& lora) {
  std::vector<LoraProblem> problems;
  if (lora.has(LoraTarget::kRouter) && !c.has_moe()) {
    problems.push_back({"target_modules",
                        "\"gate\" names an MoE layer's router, and this model has no MoE layer "
                        "(its MLP's gate projection is \"gate_proj\")"});
  }
  const std::vector<std::string> paths = saveable_modules(c);
  for (const auto& entry : lora.modules_to_save) {
    bool found = false;
    for (const auto& p : paths) found = found || names_module(entry, p);
    if (found) continue;
    const std::string quoted = "\"" + entry + "\"";
    std::string text;
    const auto target = parse_lora_target(entry.substr(entry.rfind('.') + 1));
    if (target && (target != LoraTarget::kRouter || c.has_moe())) {
      text = quoted +
             " is a projection: adapt it with target_modules (modules_to_save trains the "
             "embedding, the head and the norms)";
    } else if (entry == "lm_head" && c.tie_word_embeddings) {
      text = quoted +
             ": this model ties lm_head to the embedding (tie_word_embeddings); name "
             "\"embed_tokens\" to train both";
    } else {
      text = quoted + " names no module of this model; expected embed_tokens, " +
             (c.tie_word_embeddings ? "" : "lm_head, ") + "norm, input_layernorm, " +
             (c.qk_norm ? "q_norm, k_norm, " : "") +
             "post_attention_layernorm or a path ending in one, e.g. layers.0.input_layernorm";
    }
    problems.push_back({"modules_to_save", std::move(text)});
  }
  return problems;
}

std::vector<std::string> LoraConfig::target_names(ModelFamily family) const {
  std::vector<std::string> names;
  for (int i = 0; i < kNumLoraTargets; ++i) {
    if (!targets[static_cast<std::size_t>(i)]) continue;
    const TargetInfo& t = kTargets[i];
    names.emplace_back(family == ModelFamily::kMixtral && !t.mixtral_name.empty() ? t.mixtral_name
                                                                                  : t.name);
  }
  return names;
}

}  // namespace strata::model
