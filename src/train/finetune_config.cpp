// The "finetune" part of a config: the method's name, the settings as JSON, and the check of a
// PEFT adapter against them.
#include <set>
#include <string>
#include <vector>

#include "strata/train/config.h"

namespace strata::train {

std::string_view finetune_method_name(FinetuneMethod method) {
  switch (method) {
    case FinetuneMethod::kFull:
      return "full";
    case FinetuneMethod::kLora:
      return "lora";
    case FinetuneMethod::kQlora:
      return "qlora";
  }
  return "?";
}

Json FinetuneConfig::to_json(model::ModelFamily family) const {
  if (method == FinetuneMethod::kFull) return Json{{"method", "full"}};
  return Json{
      {"method", finetune_method_name(method)},
      {"r", lora.r},
      {"alpha", lora.alpha},
      {"dropout", lora.dropout},
      {"target_modules", lora.target_names(family)},
      {"use_rslora", lora.use_rslora},
      {"modules_to_save", lora.modules_to_save.empty() ? Json() : Json(lora.modules_to_save)},
      {"adapter", adapter.empty() ? Json() : Json(adapter)},
      {"quantized_cache", quantized_cache.empty() ? Json() : Json(quantized_cache)}};
}

Status FinetuneConfig::check_adapter(const model::LoraConfig& a, model::ModelFamily family) const {
  std::vector<std::string> problems;
  const model::LoraConfig& c = lora;
  if (c.r != a.r) {
    problems.push_back("finetune.r is " + std::to_string(c.r) + ", the adapter's r is " +
                       std::to_string(a.r));
  }
  if (c.alpha != a.alpha) {
    problems.push_back("finetune.alpha is " + Json(c.alpha).dump() +
                       ", the adapter's lora_alpha is " + Json(a.alpha).dump());
  }
  if (c.targets != a.targets) {
    problems.push_back("finetune.target_modules is " + Json(c.target_names(family)).dump() +
                       ", the adapter's is " + Json(a.target_names(family)).dump());
  }
  if (std::set<std::string>(c.modules_to_save.begin(), c.modules_to_save.end()) !=
      std::set<std::string>(a.modules_to_save.begin(), a.modules_to_save.end())) {
    problems.push_back("finetune.modules_to_save is " + Json(c.modules_to_save).dump() +
                       ", the adapter's is " + Json(a.modules_to_save).dump());
  }
  if (c.use_rslora != a.use_rslora) {
    problems.push_back(std::string("finetune.use_rslora is ") + (c.use_rslora ? "true" : "false") +
                       ", the adapter's is " + (a.use_rslora ? "true" : "false"));
  }
  if (problems.empty()) return Status::ok();
  std::string msg =
      "finetune.adapter " + adapter + " was trained with other settings; set finetune to match it:";
  for (const auto& p : problems) msg += "\n  " + p;
  return invalid_argument(msg);
}

}  // namespace strata::train
