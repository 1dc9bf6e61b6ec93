// `strata plot METRICS.jsonl... -o PICTURE`: a run's metrics drawn by tools/plot/plot_metrics.py
// (matplotlib, Debian's python3-matplotlib), run with Debian's Python.
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "tools/cli/commands.h"

namespace strata::cli {
namespace {

struct PlotArgs {
  std::vector<std::string> metrics;
  std::string output, title;
};

// The script: beside an installed binary (PREFIX/share/strata), else in the source tree it was
// built from.
std::string plot_script() {
  std::error_code ec;
  const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    const auto installed = self.parent_path().parent_path() / "share/strata/plot_metrics.py";
    if (std::filesystem::exists(installed, ec)) return installed.string();
  }
  return STRATA_PLOT_SCRIPT;
}

int run_plot(const PlotArgs& a) {
  for (const std::string& m : a.metrics) {
    if (!std::filesystem::is_regular_file(m)) {
      std::fprintf(stderr,
                   "strata plot: %s: no such metrics file (strata train --metrics FILE "
                   "writes one)\n",
                   m.c_str());
      return kExitUsage;
    }
  }
  // Debian's Python has Debian's matplotlib; a python3 earlier on PATH (pyenv) may not.
  const std::string python = access("/usr/bin/python3", X_OK) == 0 ? "/usr/bin/python3" : "python3";
  const std::string script = plot_script();
  std::vector<std::string> argv = {python, script};
  argv.insert(argv.end(), a.metrics.begin(), a.metrics.end());
  argv.insert(argv.end(), {"-o", a.output});
  if (!a.title.empty()) argv.insert(argv.end(), {"--title", a.title});
  // Whether matplotlib is there, asked first so that its absence is named.
  const std::string probe = python + " -c 'import matplotlib' 2>/dev/null";
  if (std::system(probe.c_str()) != 0) {
    std::fprintf(stderr,
                 "strata plot: %s has no matplotlib; install it (Debian: apt install "
                 "python3-matplotlib; tools/install-deps.sh does)\n",
                 python.c_str());
    return kExitError;
  }
  std::vector<char*> cargv;
  for (std::string& s : argv) cargv.push_back(s.data());
  cargv.push_back(nullptr);
  std::fflush(nullptr);
  ::execvp(cargv[0], cargv.data());
  std::perror(("strata plot: cannot run " + python).c_str());
  return kExitError;
}

}  // namespace

Runner add_plot_command(CLI::App& app) {
  auto args = std::make_shared<PlotArgs>();
  auto* cmd = app.add_subcommand(
      "plot",
      "Draw a run's metrics (loss, held-out loss, lr, tokens/s, memory by tier) as a picture");
  cmd->add_option("metrics", args->metrics, "Metrics files (metrics_file, JSON lines), one per run")
      ->required();
  cmd->add_option("-o,--output", args->output, "The picture to write: .png, .svg or .pdf")
      ->required();
  cmd->add_option("--title", args->title, "A title above the panels");
  return [args] { return run_plot(*args); };
}

}  // namespace strata::cli
