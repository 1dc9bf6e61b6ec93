// A training config file and its "--set key=value" overrides, read as `strata train` reads them.
// Input: override lines, a line "---", then the config's JSON (no "---" line: the config alone).
// A config that reads is written back as JSON (as a checkpoint saves it) and read again: that
// must give the same JSON.
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "strata/train/config.h"
#include "tests/fuzz/fuzz_target.h"

STRATA_FUZZ_TARGET(train_config) {
  using namespace strata::fuzz;
  auto [head, config] = split_once(as_text(data), "\n---\n");
  if (config.empty() && head == as_text(data)) std::swap(head, config);
  std::vector<std::string> overrides;
  while (!head.empty()) {
    auto [line, rest] = split_once(head, "\n");
    overrides.emplace_back(line);
    if (rest.empty() && line == head) break;
    head = rest;
  }
  const std::string path = write_input("train.json", config);
  auto read = strata::train::load_train_config(path, overrides);
  if (!read.is_ok()) return;
  const strata::Json saved = read->to_json();
  auto again = strata::train::parse_train_config(saved, "the config written back");
  if (!again.is_ok() || again->to_json() != saved) {
    std::fprintf(
        stderr, "config does not survive being written back: %s\n%s\n",
        again.is_ok() ? again->to_json().dump().c_str() : again.status().to_string().c_str(),
        saved.dump().c_str());
    std::abort();
  }
}
