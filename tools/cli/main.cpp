// The `strata` command line: dispatches to the subcommands in this folder.
#include <CLI/CLI.hpp>
#include <utility>
#include <vector>

#include "strata/build_config.h"
#include "strata/core/logging.h"
#include "tools/cli/commands.h"

int main(int argc, char** argv) {
  CLI::App app{"Strata: train and fine-tune LLaMA-family models on hardware too small for them"};
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string("strata ") + STRATA_VERSION);
  bool verbose = false;
  app.add_flag("-v,--verbose", verbose, "Print debug logs");

  std::vector<std::pair<CLI::App*, strata::cli::Runner>> commands;
  auto add = [&](strata::cli::Runner (*add_command)(CLI::App&)) {
    const std::size_t before = app.get_subcommands({}).size();
    strata::cli::Runner runner = add_command(app);
    commands.emplace_back(app.get_subcommands({}).at(before), std::move(runner));
  };
  add(strata::cli::add_train_command);
  add(strata::cli::add_info_command);
  add(strata::cli::add_io_bench_command);
  add(strata::cli::add_estimate_command);
  add(strata::cli::add_tokenize_command);
  add(strata::cli::add_generate_command);
  add(strata::cli::add_merge_command);
  add(strata::cli::add_launch_command);
  add(strata::cli::add_plot_command);

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // --help and --version exit 0; every other parsing error is a usage error, as README says.
    return app.exit(e) == 0 ? 0 : strata::cli::kExitUsage;
  }
  if (verbose) strata::set_log_level(strata::LogLevel::kDebug);
  for (auto& [sub, run] : commands) {
    if (sub->parsed()) return run();
  }
  return strata::cli::kExitUsage;
}
