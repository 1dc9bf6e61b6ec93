// CUDA runtime queries: GPU presence, properties, linked library versions.
#include <cublasLt.h>
#include <cuda_runtime.h>
#include <nccl.h>

#include <string>

#include "runtime.h"

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
  }
  return info;
}

std::string library_versions() {
  int nccl = 0;
  ncclGetVersion(&nccl);
  return "cuBLASLt " + std::to_string(cublasLtGetVersion()) + ", NCCL " + std::to_string(nccl);
}

}  // namespace strata::kernels
