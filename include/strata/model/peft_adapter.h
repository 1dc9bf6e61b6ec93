// PEFT LoRA adapter directories: adapter_config.json and adapter_model.safetensors, with PEFT's
// tensor names (base_model.model.<HF name>, e.g.
// base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight), read and written so that
// PEFT's PeftModel.from_pretrained and Strata load each other's adapters.
#pragma once

#include <string>

#include "strata/core/json.h"
#include "strata/core/status.h"
#include "strata/model/hf_checkpoint.h"
#include "strata/model/lora.h"
#include "strata/model/param_layout.h"
#include "strata/model/safetensors.h"

namespace strata::model {

inline constexpr const char* kAdapterConfigFile = "adapter_config.json";
inline constexpr const char* kAdapterWeightsFile = "adapter_model.safetensors";

// The name PEFT saves an adapter tensor under.
std::string peft_tensor_name(const std::string& hf_name);

// PEFT's LoRA keys (r, lora_alpha, lora_dropout, target_modules, use_rslora, modules_to_save;
// DoRA, fan_in_fan_out, biases and per-module ranks refused) of an adapter_config.json object;
// `where` names it in errors, which are all reported at once.
Result<LoraConfig> lora_config_from_peft(const Json& json, const std::string& where);

class PeftAdapterReader {
 public:
  // Reads adapter_config.json (peft_type LORA; r, lora_alpha, lora_dropout, target_modules,
  // use_rslora) and indexes adapter_model.safetensors; errors name the file and key.
  static Result<PeftAdapterReader> open(const std::string& dir);
  const LoraConfig& config() const { return config_; }
  // Every tensor of the layout's trainable groups (the adapters and the modules_to_save) is
  // present with its shape, and no other: all problems at once.
  Status validate(const ParamLayout& layout) const;
  // Whether the adapter holds the tensor of that Hugging Face name (an adapter's, or a module
  // saved whole).
  bool holds(const std::string& hf_name) const;
  // A group's flat f32 values (padding zeroed): every tensor of it from the adapter.
  Status read_group(const ParamGroup& group, float* dst) const;
  // A source of whole groups: what the adapter holds from it (its pairs and the modules it saved
  // whole), every other tensor from `base`. The reader must outlive it.
  GroupSource over(GroupSource base) const;

 private:
  std::string dir_;
  LoraConfig config_;
  SafetensorsReader weights_;
};

// Writes `dir` (created if needed): adapter_config.json and adapter_model.safetensors (f32) with
// the layout's trainable groups (the adapters and the modules_to_save, which PEFT saves under the
// module's own name), each supplied by `read_group`; `base_model` names the base for
// PEFT (base_model_name_or_path), `family` the names target_modules takes (Mixtral's experts'
// w1, w3, w2). Files are written atomically, weights first.
Status write_peft_adapter(const std::string& dir, const LoraConfig& lora, const ParamLayout& layout,
                          const std::string& base_model, const GroupSource& read_group,
                          ModelFamily family = ModelFamily::kLlama);

// Merges a decoder block's adapters into its base weights, as PEFT's merge_and_unload does:
// W += scaling * B A for each adapted projection, the product summed in double and added to the
// f32 weight with one rounding. `block`/`base`: the block's group and its f32 values;
// `adapters`/`values`: its adapter group and values (ParamLayout::build(config, lora)).
void merge_adapters(const LoraConfig& lora, const ParamGroup& block, float* base,
                    const ParamGroup& adapters, const float* values);

}  // namespace strata::model
