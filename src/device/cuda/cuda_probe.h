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
  // With kFlash2 above: the calls the flash kernels do not apply to (not bf16, another
  // head_dim, unaligned, too little shared memory) run the simple kernels, as the config key
  // `attention` promises. Off, such a call fails: tests choose a variant strictly.
  bool attention_falls_back = false;
  // Synchronize and check after every op, so a kernel fault names its op (slow; debugging).
  // create_cuda_device(options) turns it on when the environment has STRATA_CUDA_SYNC=1.
  bool sync_after_each_op = false;
  // cuBLAS workspace carved from the arena once; 0 = min(32 MiB, device_memory_limit / 16).
  std::size_t gemm_workspace_bytes = 0;
};

// Whether the environment asks every CUDA op to synchronize and check: STRATA_CUDA_SYNC=1.
// `getenv` is injectable for tests.
bool sync_requested_by_environment(const char* (*getenv)(const char*) = nullptr);

// The tuning create_cuda_device(options) runs with: options.attention, unless STRATA_ATTENTION
// in the environment names another variant (auto, flash2 or simple), and
// sync_requested_by_environment(). Any other STRATA_ATTENTION is invalid_argument naming the
// variable, its value and the choices.
Result<CudaTuning> tuning_from_environment(const DeviceOptions& options,
                                           const char* (*getenv)(const char*) = nullptr);

// Fails with invalid_argument for a bad STRATA_ATTENTION (tuning_from_environment), with
// `unavailable` naming the reason when no usable GPU is present, and with invalid_argument when
// device_memory_limit is 0 (the CUDA arena is allocated up front).
Result<std::unique_ptr<Device>> create_cuda_device(const DeviceOptions& options);
Result<std::unique_ptr<Device>> create_cuda_device(const DeviceOptions& options,
                                                   const CudaTuning& tuning);
// "no GPU present (CUDA driver: ...)" or "1 GPU: NVIDIA H200, sm_90, 139 GiB".
std::string describe_cuda();

}  // namespace strata::device::cuda
