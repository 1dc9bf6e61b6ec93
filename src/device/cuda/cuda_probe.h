// Entry points of the CUDA backend that the backend registry calls (CUDA builds only).
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "kernels/launchers.h"
#include "strata/device/device.h"

namespace strata::device::cuda {

// Knobs below DeviceOptions, for tests and benchmarks.
struct CudaTuning {
  kernels::AttentionKernel attention = kernels::AttentionKernel::kAuto;
  // Synchronize and check after every op, so a kernel fault names its op (slow; debugging).
  // create_cuda_device(options) turns it on when the environment has STRATA_CUDA_SYNC=1.
  bool sync_after_each_op = false;
  // cuBLAS workspace carved from the arena once; 0 = min(32 MiB, device_memory_limit / 16).
  std::size_t gemm_workspace_bytes = 0;
};

// Fails with `unavailable` naming the reason when no usable GPU is present, and with
// invalid_argument when device_memory_limit is 0 (the CUDA arena is allocated up front).
Result<std::unique_ptr<Device>> create_cuda_device(const DeviceOptions& options);
Result<std::unique_ptr<Device>> create_cuda_device(const DeviceOptions& options,
                                                   const CudaTuning& tuning);
// "no GPU present (CUDA driver: ...)" or "1 GPU: NVIDIA H200, sm_90, 139 GiB".
std::string describe_cuda();

}  // namespace strata::device::cuda
