// CUDA runtime queries: GPU presence, properties, linked library versions.
#include <cuda_runtime.h>

#include <string>

#include "launchers.h"
#include "runtime.h"
#include "strata/build_config.h"
#if STRATA_HAVE_NCCL
#include <nccl.h>
#endif

namespace strata::kernels {

GpuInfo query_gpus() {
  GpuInfo info;
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    info.error = cudaGetErrorString(err);
    return info;
  }
  info.count = count;
  if (count == 0) {
    info.error = "the CUDA driver reports no devices";
    return info;
  }
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) == cudaSuccess) {
    info.name = prop.name;
    info.major = prop.major;
    info.minor = prop.minor;
    info.total_bytes = prop.totalGlobalMem;
    info.max_smem_optin_bytes = prop.sharedMemPerBlockOptin;
  }
  return info;
}

std::string library_versions() {
#if STRATA_HAVE_NCCL
  int nccl = 0;
  ncclGetVersion(&nccl);
  return "NCCL " + std::to_string(nccl);
#else
  return "no NCCL";
#endif
}

std::string error_text(int code) {
  const auto err = static_cast<cudaError_t>(code);
  return std::string(cudaGetErrorName(err)) + ": " + cudaGetErrorString(err);
}

}  // namespace strata::kernels
