// The `strata` command line: `strata train CONFIG [--set k=v]...`.
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <atomic>
#include <csignal>
#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#include "strata/build_config.h"
#include "strata/core/logging.h"
#include "strata/device/device.h"
#include "strata/train/config.h"
#include "strata/train/trainer.h"

namespace {

// Set by SIGINT/SIGTERM; the trainer finishes the current step, saves and exits.
std::atomic<bool> g_stop_requested{false};

extern "C" void on_stop_signal(int sig) {
  if (g_stop_requested.exchange(true)) {
    std::signal(sig, SIG_DFL);
    std::raise(sig);
    return;
  }
  static const char msg[] =
      "\nstrata: stopping after the current step and saving a checkpoint (press Ctrl-C again to "
      "abort now)\n";
  [[maybe_unused]] auto n = ::write(2, msg, sizeof(msg) - 1);
}

int exit_code_for(const strata::Status& s) {
  switch (s.code()) {
    case strata::StatusCode::kOk:
      return 0;
    case strata::StatusCode::kCancelled:
      return 130;
    case strata::StatusCode::kInvalidArgument:
      return 2;
    default:
      return 1;
  }
}

int run_train(const std::string& config_path, const std::vector<std::string>& sets,
              const std::string& metrics, std::int64_t save_every, const std::string& save_dir,
              const std::string& resume) {
  std::vector<std::string> overrides = sets;
  if (!metrics.empty()) overrides.push_back("metrics_file=\"" + metrics + "\"");
  if (save_every >= 0) overrides.push_back("save_every=" + std::to_string(save_every));
  if (!save_dir.empty()) overrides.push_back("save_dir=\"" + save_dir + "\"");
  auto config = strata::train::load_train_config(config_path, overrides);
  if (!config.is_ok()) {
    std::fprintf(stderr, "strata train: %s\n", config.status().message().c_str());
    return exit_code_for(config.status());
  }
  strata::train::TrainOptions options;
  options.resume_dir = resume;
  options.progress = &std::cout;
  options.stop_requested = &g_stop_requested;
  auto trainer = strata::train::Trainer::create(*config, options);
  if (!trainer.is_ok()) {
    std::fprintf(stderr, "strata train: %s\n", trainer.status().message().c_str());
    return exit_code_for(trainer.status());
  }
  std::cout << (*trainer)->describe() << std::flush;
  std::signal(SIGINT, on_stop_signal);
  std::signal(SIGTERM, on_stop_signal);
  const strata::Status s = (*trainer)->run();
  if (!s.is_ok()) {
    std::fprintf(stderr, "strata train: %s\n", s.message().c_str());
    return exit_code_for(s);
  }
  const auto& h = (*trainer)->history();
  if (!h.empty()) {
    std::printf(
        "done: %zu steps, loss %.4f -> %.4f\nweights: %s/model (a Hugging Face checkpoint: "
        "set it as \"model\" to fine-tune from it)\n",
        h.size(), h.front().loss, h.back().loss, (*trainer)->last_checkpoint().c_str());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Strata: train and fine-tune LLaMA-family models on hardware too small for them"};
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string("strata ") + STRATA_VERSION);
  bool verbose = false;
  app.add_flag("-v,--verbose", verbose, "Print debug logs");

  auto* train = app.add_subcommand("train", "Train or fine-tune a model from a JSON config");
  std::string config_path, metrics, save_dir, resume;
  std::vector<std::string> sets;
  std::int64_t save_every = -1;
  train->add_option("config", config_path, "JSON config file")
      ->required()
      ->check(CLI::ExistingFile);
  train->add_option("--set", sets, "Override a config key: --set optimizer.lr=1e-4 (repeatable)")
      ->allow_extra_args(false);
  train->add_option("--metrics", metrics, "Write one JSON object per step to this file");
  train->add_option("--save-every", save_every, "Save a resumable checkpoint every N steps");
  train->add_option("--save-dir", save_dir, "Directory for checkpoints (default: save_dir key)");
  train->add_option("--resume", resume, "Resume from a checkpoint directory (or a save dir)");

  auto* info = app.add_subcommand("info", "Show the backends this build and machine offer");

  CLI11_PARSE(app, argc, argv);
  if (verbose) strata::set_log_level(strata::LogLevel::kDebug);

  if (train->parsed()) return run_train(config_path, sets, metrics, save_every, save_dir, resume);
  if (info->parsed()) {
    std::printf("strata %s\nbackends: %s\nio_uring: %s, MPI: %s\n", STRATA_VERSION,
                strata::device::describe_backends().c_str(),
                STRATA_HAVE_URING ? "built" : "not built", STRATA_HAVE_MPI ? "built" : "not built");
    return 0;
  }
  return 0;
}
