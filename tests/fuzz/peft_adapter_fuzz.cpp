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
    const std::string header =
        R"({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight":)"
        R"({"dtype":"F32","shape":[1,16],"data_offsets":[0,64]}})";
    std::string file(8, '\0');
    for (int i = 0; i < 8; ++i) file[i] = static_cast<char>((header.size() >> (8 * i)) & 0xff);
    write_input("adapter/adapter_model.safetensors", file + header + std::string(64, '\0'));
    return c;
  }();
  write_input("adapter/adapter_config.json", as_text(data));
  auto adapter = strata::model::PeftAdapterReader::open(scratch() + "/adapter");
  if (!adapter.is_ok()) return;
  const strata::model::LoraConfig& lora = adapter->config();
  if (!strata::model::modules_to_save_problems(config, lora).empty()) return;
  const auto layout = strata::model::ParamLayout::build(config, lora);
  (void)adapter->validate(layout);
}
