// Merging a LoRA adapter into its base, group by group.
#include "strata/train/merge.h"

#include <filesystem>
#include <vector>

#include "strata/model/hf_checkpoint.h"
#include "strata/model/peft_adapter.h"
#include "strata/train/checkpoint.h"

namespace strata::train {

Status merge_adapter(const MergeOptions& o) {
  if (o.dtype != DType::kF32 && o.dtype != DType::kBF16) {
    return invalid_argument("merged weights are written in fp32 or bf16, not " +
                            std::string(dtype_name(o.dtype)));
  }
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::exists(o.output_dir, ec) && fs::equivalent(o.output_dir, o.model_dir, ec)) {
    return invalid_argument("--output " + o.output_dir +
                            " is the base model's directory; merging writes a new checkpoint, "
                            "so give another directory");
  }
  STRATA_ASSIGN_OR_RETURN(auto base, model::HfCheckpointReader::open(o.model_dir));
  STRATA_ASSIGN_OR_RETURN(auto adapter, model::PeftAdapterReader::open(o.adapter_dir));
  const model::ParamLayout layout = model::ParamLayout::build(base.config());
  const auto problems = model::lora_problems(base.config(), adapter.config());
  if (!problems.empty()) {
    std::string msg = o.adapter_dir + "/" + model::kAdapterConfigFile + " does not fit the base " +
                      o.model_dir + ":";
    for (const auto& p : problems) msg += "\n  " + p.key + ": " + p.text;
    return invalid_argument(msg);
  }
  const model::ParamLayout adapted = model::ParamLayout::build(base.config(), adapter.config());
  STRATA_RETURN_IF_ERROR(base.validate(layout));
  STRATA_RETURN_IF_ERROR(adapter.validate(adapted).with_context(
      "the adapter " + o.adapter_dir + " does not fit the base " + o.model_dir));
  std::vector<float> values;
  // Each block's weights with its adapters merged in; the modules the adapter saved whole (the
  // embedding, the head, norms) replace the base's.
  const model::GroupSource merged = [&](const model::ParamGroup& g, float* dst) -> Status {
    STRATA_RETURN_IF_ERROR(base.read_group(g, dst));
    // A block's adapters are its adapter group's; an expert's, its own adapter group's.
    int adapters = -1;
    if (const int layer = g.id - layout.layer_group(0);
        layer >= 0 && layer < base.config().num_hidden_layers) {
      adapters = adapted.adapter_group(layer);
    } else if (g.expert_layer >= 0) {
      adapters = adapted.expert_adapter_group(g.expert_layer,
                                              g.id - layout.expert_group(g.expert_layer, 0));
    }
    if (adapters < 0) return Status::ok();
    const model::ParamGroup& a = adapted.group(adapters);
    values.assign(static_cast<std::size_t>(a.num_elems), 0.0f);
    STRATA_RETURN_IF_ERROR(adapter.read_group(a, values.data()));
    model::merge_adapters(adapter.config(), g, dst, a, values.data());
    return Status::ok();
  };
  STRATA_RETURN_IF_ERROR(model::write_hf_checkpoint(o.output_dir, base.config(), layout, o.dtype,
                                                    adapter.over(merged)));
  return copy_tokenizer_files(o.model_dir, o.output_dir);
}

}  // namespace strata::train
