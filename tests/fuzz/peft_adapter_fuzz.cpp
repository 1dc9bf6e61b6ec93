// A PEFT adapter directory's adapter_config.json (a LoRA run's checkpoint, or adapters to merge
// or resume from), beside an adapter_model.safetensors, read as a resume reads it; a config that
// reads is checked against a small model and laid out with its adapters.
#include "strata/model/llama_config.h"
#include "strata/model/lora.h"
#include "strata/model/param_layout.h"
#include "strata/model/peft_adapter.h"
#include "tests/fuzz/fuzz_target.h"

STRATA_FUZZ_TARGET(peft_adapter) {
  using namespace strata::fuzz;
  static const strata::model::LlamaConfig config = [] {
    strata::model::LlamaConfig c = small_llama(2);
    strata::model::SafetensorsWriter weights;
    weights.add("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
                strata::DType::kF32, {1, 16});
    write_safetensors("adapter/adapter_model.safetensors", weights);
    return c;
  }();
  write_input("adapter/adapter_config.json", as_text(data));
  auto adapter = strata::model::PeftAdapterReader::open(scratch() + "/adapter");
  if (!adapter.is_ok()) return;
  const strata::model::LoraConfig& lora = adapter->config();
  if (!strata::model::lora_problems(config, lora).empty()) return;
  const auto layout = strata::model::ParamLayout::build(config, lora);
  (void)adapter->validate(layout);
}
