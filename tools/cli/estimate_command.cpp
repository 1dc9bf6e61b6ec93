// `strata estimate CONFIG [--set k=v]... [--ranks N] [--json]`: the memory plan of a config,
// without allocating the model.
#include <cstdio>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "strata/train/config.h"
#include "strata/train/estimate.h"
#include "tools/cli/commands.h"

namespace strata::cli {
namespace {

struct EstimateArgs {
  std::string config_path;
  std::vector<std::string> sets;
  int ranks = 1;
  bool json = false;
};

int run_estimate(const EstimateArgs& a) {
  auto config = train::load_train_config(a.config_path, a.sets);
  Result<train::Estimate> e =
      config.is_ok() ? train::estimate(*config, a.ranks) : Result<train::Estimate>(config.status());
  if (!e.is_ok()) {
    std::fprintf(stderr, "strata estimate: %s\n", e.status().message().c_str());
    return e.status().code() == StatusCode::kInvalidArgument ? kExitUsage : kExitError;
  }
  if (a.json) {
    std::cout << e->to_json().dump() << "\n";
  } else {
    std::cout << e->describe();
  }
  return kExitOk;
}

}  // namespace

Runner add_estimate_command(CLI::App& app) {
  auto args = std::make_shared<EstimateArgs>();
  auto* cmd = app.add_subcommand(
      "estimate",
      "Print where a config's tensors will live and the bytes of each memory tier, without "
      "allocating the model");
  cmd->add_option("config", args->config_path, "JSON config file")
      ->required()
      ->check(CLI::ExistingFile);
  cmd->add_option("--set", args->sets, "Override a config key, as for train (repeatable)")
      ->allow_extra_args(false);
  cmd->add_option("--ranks", args->ranks, "Plan rank 0 of a job of this many ranks (default 1)")
      ->check(CLI::PositiveNumber);
  cmd->add_flag("--json", args->json, "One JSON object instead of the text");
  return [args] { return run_estimate(*args); };
}

}  // namespace strata::cli
