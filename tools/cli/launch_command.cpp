// `strata launch --ranks N [--min-ranks M] [--hostfile F] [--max-restarts K] -- CONFIG [...]`:
// runs `strata train` under mpirun and, when the job fails (a rank killed, a node lost, a rank
// ending with an error), runs it again from the latest complete checkpoint with the ranks still
// available: the largest number of them, at least M, that the global batch splits over (more
// micro-batches per rank; T x P must divide it too), up to K restarts. With a hostfile, each
// attempt first asks every listed host to start a process (32 at a time, each within
// --host-timeout-s) and runs on those that did: a node lost is left out, a node back in service
// (or listed back) is used again. An mpirun whose ranks have failed but which still waits for a
// daemon it cannot reach (a node cut off) is ended dist_timeout_s later.
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
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
  int host_timeout_s = 30;
  std::string mpirun = "mpirun";
  std::string mpirun_args;
  std::vector<std::string> train_args;  // CONFIG and strata train's own options
};

std::string sh_quoted(const std::string& s) {
  std::string q = "'";
  for (const char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

void say(const std::string& line) { std::fprintf(stderr, "strata launch: %s\n", line.c_str()); }

// A hostfile's hosts ("host slots=N ...", one a line, # comments; a host without slots= is one),
// each with its line as written.
struct Host {
  std::string name;
  int slots = 1;
  std::string line;
};
Result<std::vector<Host>> read_hostfile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return io_error("cannot read hostfile " + path);
  std::vector<Host> hosts;
  std::string line;
  static const std::regex slots(R"(slots\s*=\s*(\d+))");
  for (int number = 1; std::getline(in, line); ++number) {
    const std::string text = line.substr(0, line.find('#'));
    std::istringstream words(text);
    Host h;
    if (!(words >> h.name)) continue;
    std::smatch m;
    if (std::regex_search(text, m, slots)) h.slots = std::stoi(m[1]);
    if (h.slots < 1) {
      return invalid_argument("hostfile " + path + " line " + std::to_string(number) + ": host " +
                              h.name + " has slots=" + std::to_string(h.slots) +
                              "; expected at least 1");
    }
    h.line = text;
    hosts.push_back(h);
  }
  if (hosts.empty()) return invalid_argument("hostfile " + path + " lists no hosts");
  return hosts;
}

// mpirun refuses root unless told; `vars` (NAME=VALUE ...) go to it and the ranks.
std::string mpirun_prefix(const LaunchArgs& a, const std::string& vars = "") {
  return "env " + vars + (vars.empty() ? "" : " ") +
         (::geteuid() == 0 ? "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 " : "") +
         sh_quoted(a.mpirun);
}

// The hosts that start a process when asked (`mpirun --host H -np 1 true`, kProbesAtOnce at a
// time, a failed start tried once more) within `timeout_s` each; says which did not and why.
std::vector<Host> answering(const LaunchArgs& a, const std::vector<Host>& hosts) {
  // Each probe is an mpirun with its own remote start (ssh): a bounded number at once, as
  // pdsh-style tools fan out, so a hostfile of hundreds does not start hundreds of them.
  constexpr std::size_t kProbesAtOnce = 32;
  using Clock = std::chrono::steady_clock;
  const auto start = [&](const Host& h) {
    const std::string cmd = "exec " + mpirun_prefix(a) + " -np 1 --host " + sh_quoted(h.name) +
                            (a.mpirun_args.empty() ? "" : " " + a.mpirun_args) +
                            " true >/dev/null 2>&1 </dev/null";
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::setpgid(0, 0);
      ::execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
      ::_exit(127);
    }
    return pid;
  };
  // Per host: its probe and when it gives up; -1 while it runs (or waits to), else its exit code
  // (a probe that could not be started counts as mpirun's 127), -2 once it timed out.
  std::vector<pid_t> probes(hosts.size(), 0);
  std::vector<Clock::time_point> deadlines(hosts.size());
  std::vector<int> status(hosts.size(), -1);
  std::vector<bool> retried(hosts.size(), false);
  std::size_t next = 0, running = 0, left = hosts.size();
  while (left > 0) {
    for (; next < hosts.size() && running < kProbesAtOnce; ++next) {
      probes[next] = start(hosts[next]);
      deadlines[next] = Clock::now() + std::chrono::seconds(a.host_timeout_s);
      if (probes[next] < 0) {
        status[next] = 127;
        --left;
      } else {
        ++running;
      }
    }
    for (std::size_t i = 0; i < next; ++i) {
      if (status[i] != -1) continue;
      int st = 0;
      if (::waitpid(probes[i], &st, WNOHANG) == probes[i]) {
        status[i] = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
        // A failed start is tried once more within the host's time: concurrent mpiruns on one
        // machine can trip over each other's session directories (seen under a loaded test
        // run: exit code 1 from a host that answered at once when asked alone).
        if (status[i] != 0 && !retried[i] && Clock::now() < deadlines[i]) {
          retried[i] = true;
          probes[i] = start(hosts[i]);
          if (probes[i] > 0) {
            status[i] = -1;
            continue;
          }
          status[i] = 127;
        }
      } else if (Clock::now() >= deadlines[i]) {
        ::kill(-probes[i], SIGKILL);
        ::waitpid(probes[i], nullptr, 0);
        status[i] = -2;
      } else {
        continue;
      }
      --running;
      --left;
    }
    if (left > 0) ::usleep(50'000);
  }
  std::vector<Host> up;
  for (std::size_t i = 0; i < hosts.size(); ++i) {
    if (status[i] == -2) {
      say("host " + hosts[i].name + " did not start a process within " +
          std::to_string(a.host_timeout_s) + " s (--host-timeout-s): left out of this attempt");
    } else if (status[i] != 0) {
      say("host " + hosts[i].name + " could not start a process (mpirun exit code " +
          std::to_string(status[i]) + (retried[i] ? ", tried twice" : "") +
          "): left out of this attempt");
    } else {
      up.push_back(hosts[i]);
    }
  }
  return up;
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

// The job's mpirun, in a process group of its own (so that it and what it started can be ended
// together); SIGINT and SIGTERM given to the launcher are passed on to it.
volatile sig_atomic_t g_job_group = 0;
void pass_on(int sig) {
  if (g_job_group > 0) ::kill(-g_job_group, sig);
}

// Runs `command`, passing its output through, and returns its exit status and the ranks mpirun
// reports killed by a signal ("... process rank R ... exited on signal N"). Once a rank has
// failed (its error line, or mpirun's report of one), mpirun ends in a moment, unless it waits
// for a daemon on a node it cannot reach: `grace_s` later it is ended.
struct RunResult {
  int exit_code = -1;
  std::set<int> killed;
  bool ended_by_launch = false;
};
RunResult run_job(const std::string& command, int grace_s) {
  RunResult r;
  int out[2];
  if (::pipe(out) != 0) return r;
  const pid_t pid = ::fork();
  if (pid < 0) return r;
  if (pid == 0) {
    ::setpgid(0, 0);
    ::dup2(out[1], STDOUT_FILENO);
    ::dup2(out[1], STDERR_FILENO);
    ::close(out[0]);
    ::close(out[1]);
    ::execl("/bin/sh", "sh", "-c", ("exec " + command).c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  ::setpgid(pid, pid);
  ::close(out[1]);
  g_job_group = pid;
  struct sigaction act = {}, old_int = {}, old_term = {};
  act.sa_handler = pass_on;
  ::sigaction(SIGINT, &act, &old_int);
  ::sigaction(SIGTERM, &act, &old_term);

  static const std::regex killed(R"(process rank (\d+) .*exited on signal)");
  static const std::regex failed(
      R"(strata train \[rank \d+\]:|exited on signal|the job has been aborted|ORTE has lost communication)");
  using Clock = std::chrono::steady_clock;
  std::optional<Clock::time_point> deadline;
  std::string line;
  char buf[4096];
  bool open = true;
  int signals_sent = 0;
  while (open) {
    pollfd p{out[0], POLLIN, 0};
    const int ready = ::poll(&p, 1, 500);
    if (ready > 0) {
      const ssize_t n = ::read(out[0], buf, sizeof buf);
      if (n <= 0) {
        open = false;
      } else {
        std::fwrite(buf, 1, static_cast<std::size_t>(n), stdout);
        std::fflush(stdout);
        line.append(buf, static_cast<std::size_t>(n));
        for (std::size_t nl; (nl = line.find('\n')) != std::string::npos; line.erase(0, nl + 1)) {
          const std::string one = line.substr(0, nl);
          std::smatch m;
          if (std::regex_search(one, m, killed)) r.killed.insert(std::stoi(m[1]));
          if (!deadline && std::regex_search(one, failed)) {
            deadline = Clock::now() + std::chrono::seconds(grace_s);
          }
        }
      }
    }
    if (deadline && Clock::now() > *deadline && signals_sent < 2) {
      if (signals_sent == 0) {
        say("a rank failed and mpirun has not ended " + std::to_string(grace_s) +
            " s later (dist_timeout_s; it waits for a node it cannot reach?): ending it");
      }
      ::kill(-pid, signals_sent == 0 ? SIGTERM : SIGKILL);
      r.ended_by_launch = true;
      ++signals_sent;
      deadline = Clock::now() + std::chrono::seconds(5);
      // Its output may stay open in a daemon it started: stop reading once it is gone.
      if (signals_sent == 2) open = false;
    }
    int st = 0;
    if (r.ended_by_launch && ::waitpid(pid, &st, WNOHANG) == pid) {
      r.exit_code = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
      open = false;
    }
  }
  ::close(out[0]);
  if (r.exit_code == -1) {
    int st = 0;
    if (::waitpid(pid, &st, 0) == pid) {
      r.exit_code = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    }
  }
  ::kill(-pid, SIGKILL);  // whatever of the job is left (an agent for a node cut off)
  g_job_group = 0;
  ::sigaction(SIGINT, &old_int, nullptr);
  ::sigaction(SIGTERM, &old_term, nullptr);
  if (r.ended_by_launch && r.exit_code == kExitOk) r.exit_code = kExitError;
  return r;
}

int run_launch(const LaunchArgs& a) {
  auto config = config_of(a.train_args);
  if (!config.is_ok()) {
    std::fprintf(stderr, "strata launch: %s\n", config.status().message().c_str());
    return kExitUsage;
  }
  if (a.ranks < 1 || a.min_ranks < 1 || a.min_ranks > a.ranks || a.max_restarts < 0 ||
      a.host_timeout_s < 1) {
    std::fprintf(stderr,
                 "strata launch: --ranks %d, --min-ranks %d, --max-restarts %d, "
                 "--host-timeout-s %d: expected 1 <= min-ranks <= ranks, restarts >= 0 and a "
                 "host timeout of at least 1 s\n",
                 a.ranks, a.min_ranks, a.max_restarts, a.host_timeout_s);
    return kExitUsage;
  }
  char self[4096] = {};
  const ssize_t len = ::readlink("/proc/self/exe", self, sizeof self - 1);
  const std::string strata = len > 0 ? std::string(self, static_cast<std::size_t>(len)) : "strata";
  const std::string save_dir = config->save_dir;
  int available = a.ranks;
  // This attempt's hosts, those of the hostfile that answered, in their order.
  std::string hosts_file;
  if (!a.hostfile.empty()) {
    char name[] = "/tmp/strata-launch-hosts-XXXXXX";
    const int fd = ::mkstemp(name);
    if (fd < 0) {
      say("cannot make a temporary hostfile in /tmp");
      return kExitError;
    }
    ::close(fd);
    hosts_file = name;
  }
  struct RemoveOnExit {
    std::string path;
    ~RemoveOnExit() {
      if (!path.empty()) std::remove(path.c_str());
    }
  } remove_hosts{hosts_file};
  for (int attempt = 0;; ++attempt) {
    if (!a.hostfile.empty()) {
      // Re-read at each attempt: hosts listed back (or newly) are used again.
      auto hosts = read_hostfile(a.hostfile);
      if (!hosts.is_ok()) {
        std::fprintf(stderr, "strata launch: %s\n", hosts.status().message().c_str());
        return kExitUsage;
      }
      const std::vector<Host> up = answering(a, *hosts);
      std::ofstream f(hosts_file, std::ios::trunc);
      int slots = 0;
      for (const Host& h : up) {
        f << h.line << "\n";
        slots += h.slots;
      }
      available = std::min(a.ranks, slots);
      if (up.size() < hosts->size()) {
        say(std::to_string(up.size()) + " of the " + std::to_string(hosts->size()) + " hosts of " +
            a.hostfile + " answered: " + std::to_string(slots) + " slot(s)");
      }
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
    // The ranks learn which attempt they are part of.
    std::string command = mpirun_prefix(a, "STRATA_LAUNCH_ATTEMPT=" + std::to_string(attempt)) +
                          " -np " + std::to_string(world);
    if (!hosts_file.empty()) command += " --hostfile " + sh_quoted(hosts_file);
    if (!a.mpirun_args.empty()) command += " " + a.mpirun_args;
    command += " " + sh_quoted(strata) + " train";
    for (const std::string& arg : args) command += " " + sh_quoted(arg);
    say("attempt " + std::to_string(attempt + 1) + ": " + std::to_string(world) + " rank(s)" +
        (resume        ? ", resuming from " + save_dir + "/latest"
         : attempt > 0 ? ", from the start (no checkpoint yet)"
                       : ""));
    const RunResult r =
        run_job(command, static_cast<int>(std::max<std::int64_t>(config->dist_timeout_s, 10)));
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
        (a.hostfile.empty() ? std::to_string(available)
                            : "on the hosts of " + a.hostfile + " that answer") +
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
                  "mpirun's hostfile; re-read at each attempt, which runs on the hosts that answer "
                  "(a lost node is left out, one back in service used again)")
      ->check(CLI::ExistingFile);
  cmd->add_option("--max-restarts", args->max_restarts, "Restarts before giving up (default 3)");
  cmd->add_option("--host-timeout-s", args->host_timeout_s,
                  "With --hostfile: seconds a host has to start a process before an attempt, or "
                  "it is left out of that attempt (default 30)");
  cmd->add_option("--mpirun", args->mpirun, "The mpirun to run (default: mpirun on PATH)");
  cmd->add_option("--mpirun-args", args->mpirun_args,
                  "Extra mpirun options, as one string (e.g. \"--oversubscribe --bind-to none\")");
  cmd->add_option("train", args->train_args, "-- CONFIG and strata train's options")->required();
  return [args] { return run_launch(*args); };
}

}  // namespace strata::cli
