// `strata estimate CONFIG [--set k=v]... [--ranks N] [--json]`: the memory plan of a config,
// without allocating the model.
#include <cstdio>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "strata/train/config.h"
#include "strata/train/estimate_report.h"
#include "tools/cli/commands.h"

namespace strata::cli {
namespace {

struct EstimateArgs {
  std::string config_path, deepspeed, gpu;
  std::vector<std::string> sets;
  int ranks = 1;
  bool json = false;
};

int run_estimate(const EstimateArgs& a) {
  // A config that cannot run: the reasons on stderr, one a line; under --json also a JSON
  // object on stdout ({"fits": false, "error": ...}), so a script reads every outcome alike.
  const auto fail = [&a](const Status& s) {
    std::fprintf(stderr, "strata estimate: %s\n", s.message().c_str());
    const Json refusal = train::refusal_json(s);
    if (a.json) std::cout << refusal.dump() << "\n";
    return refusal["exit_code"].get<int>();
  };
  Json keys = Json::object();
  if (!a.deepspeed.empty()) keys["deepspeed"] = a.deepspeed;
  auto config = train::load_train_config(a.config_path, a.sets, keys);
  if (!config.is_ok()) return fail(config.status());
  auto report = train::estimate_report(*config, {a.ranks, a.gpu});
  if (!report.is_ok()) return fail(report.status());
  std::cout << (a.json ? report->to_json().dump() + "\n" : report->describe());
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
  cmd->add_option(
      "--gpu", args->gpu,
      std::string("With device \"cuda\" on a machine without that GPU: predict the step "
                  "with a named GPU's published rate (") +
          train::kNamedGpus + ")");
  cmd->add_option("--deepspeed", args->deepspeed,
                  "A DeepSpeed config file whose keys join the config's, as for train");
  return [args] { return run_estimate(*args); };
}

}  // namespace strata::cli
