// STRATA_GPU_TESTS_ON_CPU=1: the GPU tests rehearse where there is no GPU, on the CPU backend
// (device "cuda" trains on "cpu" in the training tests; the op tests get a CPU device in the
// GPU's place), so their configs, set-up, indexing and comparisons run, not the GPU's kernels, and
// a test that could not run is found before a GPU is lent. CI runs them so (the ctests
// gpu_tests.rehearsal and gpu_tests.device_rehearsal).
#pragma once

#include <cstdlib>
#include <string_view>

namespace strata::testing {

inline bool rehearsing_gpu_tests() {
  const char* v = std::getenv("STRATA_GPU_TESTS_ON_CPU");
  return v != nullptr && std::string_view(v) == "1";
}

}  // namespace strata::testing
