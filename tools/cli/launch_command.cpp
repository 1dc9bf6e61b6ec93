// `strata launch --ranks N [--min-ranks M] [--hostfile F] [--max-restarts K] -- CONFIG [...]`:
// runs `strata train` under mpirun and, when the job fails (a rank killed, a node lost, a rank
// ending with an error), runs it again from the latest complete checkpoint with the ranks still
// available: the largest number of them, at least M, that the global batch splits over (more
// micro-batches per rank; T x P must divide it too), up to K restarts.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <optional>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "strata/core/file.h"
#include "strata/train/config.h"
#include "tools/cli/commands.h"

namespace strata::cli {
namespace {

struct LaunchArgs {
  int ranks = 0;
  int min_ranks = 1;
  std::string hostfile;
  int max_restarts = 3;
  std::string mpirun = "mpirun";
  std::string mpirun_args;
  std::vector<std::string> train_args;  // CONFIG and strata train's own options
};

std::string quoted(const std::string& s) {
  std::string q = "'";
  for (const char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

void say(const std::string& line) { std::fprintf(stderr, "strata launch: %s\n", line.c_str()); }

// The slots a hostfile lists ("host slots=N", one host a line; a host without slots= is one).
Result<int> hostfile_slots(const std::string& path) {
  std::ifstream in(path);
  if (!in) return io_error("cannot read hostfile " + path);
  int total = 0;
  std::string line;
  static const std::regex slots(R"(slots\s*=\s*(\d+))");
  while (std::getline(in, line)) {
    line = line.substr(0, line.find('#'));
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    std::smatch m;
    total += std::regex_search(line, m, slots) ? std::stoi(m[1]) : 1;
  }
  if (total == 0) return invalid_argument("hostfile " + path + " lists no hosts");
  return total;
}

// The train arguments' config, as strata train will read it (its --set, --save-dir and
// --deepspeed).
Result<train::TrainConfig> config_of(const std::vector<std::string>& args) {
  std::vector<std::string> sets;
  Json keys = Json::object();
  for (std::size_t i = 1; i < args.size(); ++i) {
    const std::string& a = args[i];
    const auto value = [&](const std::string& flag) -> std::optional<std::string> {
      if (a == flag && i + 1 < args.size()) return args[++i];
      if (a.rfind(flag + "=", 0) == 0) return a.substr(flag.size() + 1);
      return std::nullopt;
    };
    if (auto v = value("--set")) {
      sets.push_back(*v);
    } else if (auto d = value("--save-dir")) {
      keys["save_dir"] = *d;
    } else if (auto ds = value("--deepspeed")) {
      keys["deepspeed"] = *ds;
    }
  }
  return train::load_train_config(args.at(0), sets, keys);
}

// The largest rank count in [min, available] the config's global batch splits over (its
// tensor x pipeline grid dividing it too), or 0. A batch that gradient_accumulation_steps
// derives from the ranks (batch_size left out) would change with their number: it runs on
// `first` ranks, the job's, or not at all.
int usable_ranks(const train::TrainConfig& c, int available, int min, int first) {
  const int grid = c.tensor_parallel_size * c.pipeline_parallel_size;
  for (int w = available; w >= std::max(min, 1); --w) {
    if (w % grid != 0) continue;
    if (c.batch_size == 0 && w != first) continue;
    if (c.check_batch_split(w / grid).is_ok()) return w;
  }
  return 0;
}

// Runs `command`, passing its output through, and returns its exit status and the ranks mpirun
// reports killed by a signal ("... process rank R ... exited on signal N").
struct RunResult {
  int exit_code = -1;
  std::set<int> killed;
};
RunResult run_job(const std::string& command) {
  RunResult r;
  FILE* pipe = ::popen((command + " 2>&1").c_str(), "r");
  if (pipe == nullptr) return r;
  static const std::regex killed(R"(process rank (\d+) .*exited on signal)");
  std::string line;
  char buf[4096];
  while (std::fgets(buf, sizeof buf, pipe) != nullptr) {
    std::fputs(buf, stdout);
    line += buf;
    if (line.empty() || line.back() != '\n') continue;
    std::smatch m;
    if (std::regex_search(line, m, killed)) r.killed.insert(std::stoi(m[1]));
    line.clear();
  }
  std::fflush(stdout);
  const int status = ::pclose(pipe);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return r;
}

int run_launch(const LaunchArgs& a) {
  auto config = config_of(a.train_args);
  if (!config.is_ok()) {
    std::fprintf(stderr, "strata launch: %s\n", config.status().message().c_str());
    return kExitUsage;
  }
  if (a.ranks < 1 || a.min_ranks < 1 || a.min_ranks > a.ranks || a.max_restarts < 0) {
    std::fprintf(stderr,
                 "strata launch: --ranks %d, --min-ranks %d, --max-restarts %d: expected "
                 "1 <= min-ranks <= ranks and restarts >= 0\n",
                 a.ranks, a.min_ranks, a.max_restarts);
    return kExitUsage;
  }
  char self[4096] = {};
  const ssize_t len = ::readlink("/proc/self/exe", self, sizeof self - 1);
  const std::string strata = len > 0 ? std::string(self, static_cast<std::size_t>(len)) : "strata";
  const std::string save_dir = config->save_dir;
  int available = a.ranks;
  for (int attempt = 0;; ++attempt) {
    if (!a.hostfile.empty()) {
      auto slots = hostfile_slots(a.hostfile);
      if (!slots.is_ok()) {
        std::fprintf(stderr, "strata launch: %s\n", slots.status().message().c_str());
        return kExitUsage;
      }
      available = std::min(a.ranks, *slots);
    }
    const int world = usable_ranks(*config, available, a.min_ranks, a.ranks);
    if (world == 0) {
      say(std::to_string(available) + " rank(s) available, but " +
          (config->batch_size == 0
               ? "the batch is micro_batch_size x gradient_accumulation_steps x " +
                     std::to_string(a.ranks) +
                     " ranks, which fewer ranks would change (set batch_size, and the "
                     "accumulation follows the ranks): giving up"
               : "no count from " + std::to_string(a.min_ranks) + " (--min-ranks) to " +
                     std::to_string(available) + " splits batch_size " +
                     std::to_string(config->batch_size) + " into micro-batches of " +
                     std::to_string(config->micro_batch_size) + ": giving up"));
      return kExitError;
    }
    if (world < available) {
      say(std::to_string(available) + " rank(s) available; batch_size " +
          std::to_string(config->batch_size) + " (micro-batches of " +
          std::to_string(config->micro_batch_size) + ") does not split over " +
          std::to_string(available) + ", so " + std::to_string(world) + " of them run");
    }
    std::vector<std::string> args = a.train_args;
    const bool resume = attempt > 0 && !save_dir.empty() &&
                        std::filesystem::exists(std::filesystem::path(save_dir) / "latest");
    if (attempt > 0) {
      // A restart resumes from the latest complete checkpoint (not a --resume given at first).
      for (std::size_t i = 1; i < args.size(); ++i) {
        if (args[i] == "--resume" && i + 1 < args.size()) {
          args.erase(args.begin() + static_cast<std::ptrdiff_t>(i),
                     args.begin() + static_cast<std::ptrdiff_t>(i) + 2);
          --i;
        } else if (args[i].rfind("--resume=", 0) == 0) {
          args.erase(args.begin() + static_cast<std::ptrdiff_t>(i));
          --i;
        }
      }
      if (resume) args.insert(args.end(), {"--resume", save_dir});
    }
    // mpirun refuses root unless told; the ranks learn which attempt they are part of.
    std::string command = (::geteuid() == 0 ? "OMPI_ALLOW_RUN_AS_ROOT=1 "
                                              "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 "
                                            : "") +
                          std::string("STRATA_LAUNCH_ATTEMPT=") + std::to_string(attempt) + " " +
                          quoted(a.mpirun) + " -np " + std::to_string(world);
    if (!a.hostfile.empty()) command += " --hostfile " + quoted(a.hostfile);
    if (!a.mpirun_args.empty()) command += " " + a.mpirun_args;
    command += " " + quoted(strata) + " train";
    for (const std::string& arg : args) command += " " + quoted(arg);
    say("attempt " + std::to_string(attempt + 1) + ": " + std::to_string(world) + " rank(s)" +
        (resume        ? ", resuming from " + save_dir + "/latest"
         : attempt > 0 ? ", from the start (no checkpoint yet)"
                       : ""));
    const RunResult r = run_job(command);
    if (r.exit_code == kExitOk) {
      if (attempt > 0) say("finished after " + std::to_string(attempt) + " restart(s)");
      return kExitOk;
    }
    if (r.exit_code == kExitUsage || r.exit_code == kExitInterrupted) return r.exit_code;
    std::string lost;
    for (const int k : r.killed) lost += (lost.empty() ? "" : ", ") + std::to_string(k);
    const std::string why = r.killed.empty()
                                ? "the job failed (exit code " + std::to_string(r.exit_code) + ")"
                                : "rank(s) " + lost + " died";
    if (attempt >= a.max_restarts) {
      say(why + "; no restarts left (--max-restarts " + std::to_string(a.max_restarts) + ")");
      return kExitError;
    }
    // Without a hostfile, each rank that died takes its slot with it.
    if (a.hostfile.empty()) available = world - static_cast<int>(r.killed.size());
    say(why + "; restarting with the ranks still available (" +
        (a.hostfile.empty() ? std::to_string(available) : "as " + a.hostfile + " lists them") +
        ")");
  }
}

}  // namespace

Runner add_launch_command(CLI::App& app) {
  auto args = std::make_shared<LaunchArgs>();
  auto* cmd = app.add_subcommand(
      "launch",
      "Run strata train under mpirun and restart it from the latest checkpoint when a rank or "
      "node is lost, with the ranks still available: strata launch --ranks 4 -- config.json");
  cmd->add_option("--ranks", args->ranks, "Ranks to start with")->required();
  cmd->add_option("--min-ranks", args->min_ranks, "Fewest ranks to go on with (default 1)");
  cmd->add_option("--hostfile", args->hostfile,
                  "mpirun's hostfile; re-read at each restart, so hosts listed back are used "
                  "again")
      ->check(CLI::ExistingFile);
  cmd->add_option("--max-restarts", args->max_restarts, "Restarts before giving up (default 3)");
  cmd->add_option("--mpirun", args->mpirun, "The mpirun to run (default: mpirun on PATH)");
  cmd->add_option("--mpirun-args", args->mpirun_args,
                  "Extra mpirun options, as one string (e.g. \"--oversubscribe --bind-to none\")");
  cmd->add_option("train", args->train_args, "-- CONFIG and strata train's options")->required();
  return [args] { return run_launch(*args); };
}

}  // namespace strata::cli
