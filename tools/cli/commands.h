// Subcommands of the `strata` CLI. Each registers its options on the app and returns a runner
// that main() calls when that subcommand was given; the runner returns the exit code.
#pragma once

#include <CLI/CLI.hpp>
#include <functional>

namespace strata::cli {

using Runner = std::function<int()>;

// Exit codes shared by every subcommand.
inline constexpr int kExitOk = 0;
inline constexpr int kExitError = 1;
inline constexpr int kExitUsage = 2;
inline constexpr int kExitInterrupted = 130;

Runner add_train_command(CLI::App& app);
Runner add_info_command(CLI::App& app);
Runner add_io_bench_command(CLI::App& app);
Runner add_estimate_command(CLI::App& app);
Runner add_tokenize_command(CLI::App& app);
Runner add_generate_command(CLI::App& app);
Runner add_merge_command(CLI::App& app);
Runner add_launch_command(CLI::App& app);
Runner add_plot_command(CLI::App& app);

}  // namespace strata::cli
