// `strata train CONFIG [--set k=v]...`: the training loop with progress, metrics and Ctrl-C.
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "strata/core/file.h"
#include "strata/dist/communicator.h"
#include "strata/sys/environment.h"
#include "strata/train/config.h"
#include "strata/train/trainer.h"
#include "tools/cli/commands.h"

namespace strata::cli {
namespace {

// Set by SIGINT/SIGTERM; the trainer finishes the current step, saves and exits. A signal
// handler can reach nothing but a global.
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

int exit_code_for(const Status& s) {
  switch (s.code()) {
    case StatusCode::kOk:
      return kExitOk;
    case StatusCode::kCancelled:
      return kExitInterrupted;
    case StatusCode::kInvalidArgument:
      return kExitUsage;
    default:
      return kExitError;
  }
}

struct TrainArgs {
  std::string config_path, metrics, trace, save_dir, resume, deepspeed;
  bool list_keys = false;
  std::vector<std::string> sets;
  std::int64_t save_every = -1;
  // hidden, for the failure tests: "kill:RANK:STEP", "stall:RANK:STEP" or "overflow:RANK:STEP"
  std::string inject_fault;
};

// --inject-fault kill:R:S makes rank R die (SIGKILL, no cleanup) as step S starts, as a crashed
// node would; stall:R:S makes it stop there for good, alive but stuck, as a hung GPU would;
// overflow:R:S makes its gradients of step S overflow, as fp16's on one GPU can.
Status add_fault(const std::string& spec, train::TrainOptions* options) {
  const auto bad = [&] {
    return invalid_argument(
        "--inject-fault '" + spec +
        "': expected kill:RANK:STEP, stall:RANK:STEP or overflow:RANK:STEP (e.g. kill:1:3)");
  };
  const std::size_t a = spec.find(':'), b = spec.find(':', a == std::string::npos ? a : a + 1);
  if (a == std::string::npos || b == std::string::npos) return bad();
  const std::string kind = spec.substr(0, a);
  int rank = -1;
  std::int64_t step = -1;
  try {
    std::size_t used = 0;
    rank = std::stoi(spec.substr(a + 1, b - a - 1), &used);
    if (used != b - a - 1) return bad();
    step = std::stoll(spec.substr(b + 1), &used);
    if (used != spec.size() - b - 1) return bad();
  } catch (const std::exception&) {
    return bad();
  }
  if ((kind != "kill" && kind != "stall" && kind != "overflow") || rank < 0 || step < 1) {
    return bad();
  }
  if (kind == "overflow") {
    options->overflow_at = [=](int r, std::int64_t s) { return r == rank && s == step; };
    return Status::ok();
  }
  const bool kill = kind == "kill";
  options->before_step = [=](int r, std::int64_t s) {
    if (r != rank || s != step) return;
    if (kill) std::raise(SIGKILL);
    for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
  };
  return Status::ok();
}

// "strata train: ", naming the rank when several ranks each print their error.
std::string error_prefix() {
  const Result<sys::Launch> launch = sys::read_launch();
  if (!launch.is_ok() || !launch->multiple_ranks()) return "strata train: ";
  return "strata train [rank " + std::to_string(launch->rank) + "]: ";
}

int run_train(const TrainArgs& a) {
  if (a.list_keys) {
    std::cout << train::list_config_keys() << std::flush;
    return kExitOk;
  }
  if (a.config_path.empty()) {
    std::fprintf(stderr,
                 "strata train: a config file is required: strata train CONFIG [--set k=v]... "
                 "(strata train --help)\n");
    return kExitUsage;
  }
  Json keys = Json::object();  // the flags that stand for config keys
  if (!a.deepspeed.empty()) keys["deepspeed"] = a.deepspeed;
  if (!a.metrics.empty()) keys["metrics_file"] = a.metrics;
  if (!a.trace.empty()) keys["trace_file"] = a.trace;
  if (a.save_every >= 0) keys["save_every"] = a.save_every;
  if (!a.save_dir.empty()) keys["save_dir"] = a.save_dir;
  auto config = train::load_train_config(a.config_path, a.sets, keys);
  if (!config.is_ok()) {
    std::fprintf(stderr, "%s%s\n", error_prefix().c_str(), config.status().message().c_str());
    return exit_code_for(config.status());
  }
  train::TrainOptions options;
  // Under strata launch, a restarted job does not meet the fault again (a lost node does not
  // come back to fail at the same step).
  const char* attempt = std::getenv("STRATA_LAUNCH_ATTEMPT");
  if (!a.inject_fault.empty() && (attempt == nullptr || std::string(attempt) == "0")) {
    if (Status s = add_fault(a.inject_fault, &options); !s.is_ok()) {
      std::fprintf(stderr, "%s%s\n", error_prefix().c_str(), s.message().c_str());
      return exit_code_for(s);
    }
  }
  // --resume=~/x reaches us unexpanded (a shell expands "~" only at a word's start).
  auto resume = expand_path(a.resume);
  if (!resume.is_ok()) {
    std::fprintf(stderr, "%s--resume %s\n", error_prefix().c_str(),
                 resume.status().message().c_str());
    return exit_code_for(resume.status());
  }
  options.resume_dir = *resume;
  options.progress = &std::cout;
  options.stop_requested = &g_stop_requested;
  auto trainer = train::Trainer::create(*config, options);
  if (!trainer.is_ok()) {
    std::fprintf(stderr, "%s%s\n", error_prefix().c_str(), trainer.status().message().c_str());
    return exit_code_for(trainer.status());
  }
  if ((*trainer)->reports()) {
    std::cout << config->deepspeed_line() << (*trainer)->describe() << std::flush;
  }
  std::signal(SIGINT, on_stop_signal);
  std::signal(SIGTERM, on_stop_signal);
  const Status s = (*trainer)->run();
  if (!s.is_ok()) {
    std::fprintf(stderr, "%s%s\n", error_prefix().c_str(), s.message().c_str());
    return exit_code_for(s);
  }
  const auto& h = (*trainer)->history();
  if (!h.empty() && (*trainer)->reports()) {
    std::printf("done: %zu steps, loss %.4f -> %.4f\n", h.size(), h.front().loss, h.back().loss);
    std::printf("%s\n", (*trainer)->peaks_against_plan().c_str());
    if ((*trainer)->last_checkpoint().empty()) {
      std::printf("weights: not saved (save_dir is \"\")\n");
    } else if (config->lora()) {
      std::printf(
          "adapters: %s (a PEFT LoRA adapter: adapter_config.json and "
          "adapter_model.safetensors, for the base model this run read)\n",
          (*trainer)->last_checkpoint().c_str());
    } else {
      std::printf(
          "weights: %s/model (a Hugging Face checkpoint: set it as \"model\" to fine-tune from "
          "it, or try it with strata generate --model %s/model --prompt ...)\n",
          (*trainer)->last_checkpoint().c_str(), (*trainer)->last_checkpoint().c_str());
    }
  }
  return kExitOk;
}

}  // namespace

Runner add_train_command(CLI::App& app) {
  auto args = std::make_shared<TrainArgs>();
  auto* train = app.add_subcommand("train", "Train or fine-tune a model from a JSON config");
  train->add_option("config", args->config_path, "JSON config file")->check(CLI::ExistingFile);
  train->add_option("--deepspeed", args->deepspeed,
                    "A DeepSpeed config file (ds_config.json): its keys join the config's "
                    "(README: DeepSpeed configs)");
  train->add_flag("--list-keys", args->list_keys, "Print every config key with its default");
  train
      ->add_option("--set", args->sets,
                   "Override a config key: --set optimizer.lr=1e-4 (repeatable)")
      ->allow_extra_args(false);
  train->add_option("--metrics", args->metrics, "Write one JSON object per step to this file");
  train->add_option("--trace", args->trace,
                    "Write a Chrome trace (open in Perfetto or chrome://tracing) of the run to "
                    "this file: one row per stream (compute, h2d, d2h, nvme read/write, cpu "
                    "optimizer)");
  train->add_option("--save-every", args->save_every, "Save a resumable checkpoint every N steps");
  train->add_option("--save-dir", args->save_dir,
                    "Directory for checkpoints (default: save_dir key)");
  train->add_option("--resume", args->resume, "Resume from a checkpoint directory (or a save dir)");
  // For the failure tests only: not in --help.
  train->add_option("--inject-fault", args->inject_fault)->group("");
  return [args] { return run_train(*args); };
}

}  // namespace strata::cli
