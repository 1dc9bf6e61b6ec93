// Host-callable wrappers around the CUDA runtime, so that src/device/cuda never includes CUDA
// headers in public code.
#pragma once

#include <cstddef>
#include <string>

namespace strata::kernels {

struct GpuInfo {
  int count = 0;
  std::string error;  // why count is 0, from the CUDA runtime
  std::string name;
  int major = 0, minor = 0;
  std::size_t total_bytes = 0;
  std::size_t max_smem_optin_bytes = 0;  // shared memory one block may opt in to
};

GpuInfo query_gpus();
// The NCCL version the binary was linked against ("no NCCL" without it). cuBLAS is opened at
// run time (src/device/cuda/cublas_library.h), so its version is not here.
std::string library_versions();

}  // namespace strata::kernels
