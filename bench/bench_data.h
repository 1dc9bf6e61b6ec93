// A text data file for the training-step benchmarks: 400,000 pseudo-random lowercase letters in
// 7-letter words, written once to the temporary directory and reused.
#pragma once

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>

namespace strata::bench {

inline std::string text_data_file() {
  const std::string path =
      (std::filesystem::temp_directory_path() / "strata-bench-data.txt").string();
  if (!std::filesystem::exists(path)) {
    std::ofstream out(path);
    std::uint64_t x = 7;
    for (int i = 0; i < 400000; ++i) {
      x = x * 6364136223846793005ull + 1442695040888963407ull;
      out << static_cast<char>('a' + (x >> 33) % 26);
      if (i % 7 == 6) out << ' ';
    }
  }
  return path;
}

}  // namespace strata::bench
