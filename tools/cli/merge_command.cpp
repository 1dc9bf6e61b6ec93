// `strata merge`: a LoRA adapter merged into its base, as a Hugging Face checkpoint.
#include <cstdio>
#include <string>

#include "strata/train/merge.h"
#include "tools/cli/commands.h"

namespace strata::cli {

Runner add_merge_command(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "merge", "Merge a PEFT LoRA adapter into its base model and write a Hugging Face checkpoint");
  auto o = std::make_shared<train::MergeOptions>();
  auto dtype = std::make_shared<std::string>("fp32");
  cmd->add_option("--model", o->model_dir, "the base: a Hugging Face checkpoint directory")
      ->required();
  cmd->add_option("--adapter", o->adapter_dir,
                  "a PEFT LoRA adapter directory (a LoRA run's checkpoint step-N)")
      ->required();
  cmd->add_option("--output", o->output_dir, "the merged checkpoint's directory (created)")
      ->required();
  cmd->add_option("--dtype", *dtype, "fp32 or bf16 weights")
      ->check(CLI::IsMember({"fp32", "bf16"}))
      ->capture_default_str();
  return [o, dtype]() {
    o->dtype = *dtype == "bf16" ? DType::kBF16 : DType::kF32;
    const Status s = train::merge_adapter(*o);
    if (!s.is_ok()) {
      std::fprintf(stderr, "strata merge: %s\n", s.message().c_str());
      return s.code() == StatusCode::kInvalidArgument ? kExitUsage : kExitError;
    }
    std::printf("merged %s into %s: %s (a Hugging Face checkpoint, %s)\n", o->adapter_dir.c_str(),
                o->model_dir.c_str(), o->output_dir.c_str(), dtype->c_str());
    return kExitOk;
  };
}

}  // namespace strata::cli
