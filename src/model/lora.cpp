// LoRA's names and shapes: PEFT's target_modules and the projections they sit on.
#include "strata/model/lora.h"

#include <cmath>

namespace strata::model {
namespace {

struct TargetInfo {
  std::string_view name, path;
};
constexpr TargetInfo kTargets[kNumLoraTargets] = {
    {"q_proj", "self_attn.q_proj"}, {"k_proj", "self_attn.k_proj"}, {"v_proj", "self_attn.v_proj"},
    {"o_proj", "self_attn.o_proj"}, {"gate_proj", "mlp.gate_proj"}, {"up_proj", "mlp.up_proj"},
    {"down_proj", "mlp.down_proj"}};

}  // namespace

std::string_view lora_target_name(LoraTarget target) {
  return kTargets[static_cast<int>(target)].name;
}

std::string_view lora_module_path(LoraTarget target) {
  return kTargets[static_cast<int>(target)].path;
}

std::optional<LoraTarget> parse_lora_target(std::string_view name) {
  for (int i = 0; i < kNumLoraTargets; ++i) {
    if (kTargets[i].name == name) return static_cast<LoraTarget>(i);
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

std::vector<std::string> LoraConfig::target_names() const {
  std::vector<std::string> names;
  for (int i = 0; i < kNumLoraTargets; ++i) {
    if (targets[static_cast<std::size_t>(i)]) names.emplace_back(kTargets[i].name);
  }
  return names;
}

}  // namespace strata::model
