// Runs the `strata` binary (STRATA_CLI) as a user would, capturing exit code and output.
#pragma once

#include <sys/wait.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

#include "tests/testing/temp_dir.h"

namespace strata::testing {

struct RunResult {
  int exit_code = -1;
  std::string out;
  std::string err;
};

inline std::string slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Runs the shell command `command` with stdout and stderr captured in files under `out_dir`.
inline RunResult run_command(const TempDir& out_dir, const std::string& command) {
  const std::string out = out_dir.file("stdout.txt"), err = out_dir.file("stderr.txt");
  const std::string cmd = command + " >" + out + " 2>" + err;
  const int rc = std::system(cmd.c_str());
  return RunResult{WIFEXITED(rc) ? WEXITSTATUS(rc) : -1, slurp(out), slurp(err)};
}

// Runs `strata ARGS` with stdout and stderr captured in files under `out_dir`.
inline RunResult run_cli(const TempDir& out_dir, const std::string& args) {
  return run_command(out_dir, std::string(STRATA_CLI) + " " + args);
}

}  // namespace strata::testing
