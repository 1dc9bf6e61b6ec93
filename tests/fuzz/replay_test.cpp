// Every seed of tests/fuzz/corpus/<target> and every input the fuzzer once crashed on,
// tests/fuzz/regressions/<target>, through its harness: a harness that crashes, trips a
// check or hangs fails the suite without clang or libFuzzer.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <string>
#include <vector>

#include "strata/core/file.h"
#include "tests/fuzz/fuzz_target.h"

namespace strata::fuzz {
namespace {

namespace fs = std::filesystem;

const fs::path kFuzzDir = fs::path(STRATA_SOURCE_DIR) / "tests" / "fuzz";

std::vector<std::string> target_names() {
  std::vector<std::string> names;
  for (const auto& [name, target] : targets()) names.push_back(name);
  return names;
}

std::vector<fs::path> inputs_of(const fs::path& dir) {
  std::vector<fs::path> files;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return files;
  for (const auto& e : fs::directory_iterator(dir)) {
    if (e.is_regular_file() && e.path().filename() != "README.md") files.push_back(e.path());
  }
  std::sort(files.begin(), files.end());
  return files;
}

TEST(FuzzCorpus, EveryHarnessHasSeedsAndEverySeedAHarness) {
  ASSERT_FALSE(targets().empty());
  for (const auto& name : target_names()) {
    EXPECT_FALSE(inputs_of(kFuzzDir / "corpus" / name).empty())
        << "harness " << name << " has no seeds in tests/fuzz/corpus/" << name;
  }
  for (const char* kind : {"corpus", "regressions"}) {
    for (const auto& e : fs::directory_iterator(kFuzzDir / kind)) {
      if (!e.is_directory()) continue;
      EXPECT_TRUE(targets().contains(e.path().filename().string()))
          << e.path() << " names no harness";
    }
  }
}

class FuzzReplay : public testing::TestWithParam<std::string> {};

TEST_P(FuzzReplay, SeedsAndRegressions) {
  const Target& target = targets().at(GetParam());
  int ran = 0;
  for (const char* kind : {"corpus", "regressions"}) {
    for (const auto& path : inputs_of(kFuzzDir / kind / GetParam())) {
      SCOPED_TRACE(path.string());
      auto bytes = read_file(path.string());
      ASSERT_TRUE(bytes.is_ok()) << bytes.status().to_string();
      target({reinterpret_cast<const std::uint8_t*>(bytes->data()), bytes->size()});
      ++ran;
    }
  }
  EXPECT_GT(ran, 0);
}

INSTANTIATE_TEST_SUITE_P(Harnesses, FuzzReplay, testing::ValuesIn(target_names()),
                         [](const testing::TestParamInfo<std::string>& info) {
                           return info.param;
                         });

}  // namespace
}  // namespace strata::fuzz
