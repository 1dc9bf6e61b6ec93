// strata merge: a base Hugging Face checkpoint with a PEFT LoRA adapter merged into its weights,
// written as a new Hugging Face checkpoint, one parameter group in memory at a time.
#pragma once

#include <string>

#include "strata/core/dtype.h"
#include "strata/core/status.h"

namespace strata::train {

struct MergeOptions {
  std::string model_dir;      // the base: a Hugging Face checkpoint directory
  std::string adapter_dir;    // a PEFT LoRA adapter directory (a LoRA run's step-N included)
  std::string output_dir;     // created; must not be model_dir
  DType dtype = DType::kF32;  // of the written weights: f32 or bf16
};

// Reads, checks (the adapter must fit the base: every tensor's shape) and writes; the base's
// tokenizer and generation files are copied beside the merged weights.
Status merge_adapter(const MergeOptions& options);

}  // namespace strata::train
