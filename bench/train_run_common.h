// What the training benchmarks share: a token file of seeded random tokens, and the GPUs'
// specified bf16 peaks by the name the driver reports.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace strata::bench {

// Dense (no sparsity) bf16 tensor-core peaks from the vendors' datasheets, in TFLOP/s, by a part
// of the name the driver reports; the most specific first ("GH200" also contains "H200").
struct SpecPeak {
  const char* name_part;
  double tflops;
};
inline constexpr SpecPeak kSpecPeaks[] = {
    {"GH200", 989}, {"H200 NVL", 835}, {"H200", 989}, {"H100 NVL", 835},  {"H100 PCIe", 756},
    {"H100", 989},  {"A100", 312},     {"L40S", 362}, {"RTX 4090", 165.2}};

// The specified peak of the GPU named in `device_name`: STRATA_GPU_SPEC_TFLOPS, else kSpecPeaks;
// 0 when unknown.
inline double spec_bf16_tflops(const std::string& device_name) {
  if (const char* forced = std::getenv("STRATA_GPU_SPEC_TFLOPS"); forced != nullptr) {
    if (const double t = std::atof(forced); t > 0) return t;
  }
  for (const SpecPeak& p : kSpecPeaks) {
    if (device_name.find(p.name_part) != std::string::npos) return p.tflops;
  }
  return 0;
}

// A file of 4M seeded random tokens below `vocab` in `dir` (u16 where the vocabulary fits, else
// u32), made once; returns its path.
inline std::string token_file(const std::string& dir, std::int64_t vocab) {
  const bool wide = vocab > 65536;
  const std::string path = dir + "/tokens-" + std::to_string(vocab) + (wide ? ".u32" : ".u16");
  if (std::filesystem::exists(path)) return path;
  std::filesystem::create_directories(dir);
  constexpr std::size_t kTokens = std::size_t{1} << 22;
  std::vector<std::uint32_t> tokens(kTokens);
  std::uint64_t x = 7;
  for (auto& t : tokens) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    t = static_cast<std::uint32_t>((x >> 33) % static_cast<std::uint64_t>(vocab));
  }
  std::ofstream f(path, std::ios::binary);
  if (wide) {
    f.write(reinterpret_cast<const char*>(tokens.data()),
            static_cast<std::streamsize>(tokens.size() * sizeof(std::uint32_t)));
  } else {
    std::vector<std::uint16_t> narrow(tokens.begin(), tokens.end());
    f.write(reinterpret_cast<const char*>(narrow.data()),
            static_cast<std::streamsize>(narrow.size() * sizeof(std::uint16_t)));
  }
  return path;
}

}  // namespace strata::bench
