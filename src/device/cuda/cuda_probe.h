// Entry points of the CUDA backend that the backend registry calls (CUDA builds only).
#pragma once

#include <memory>
#include <string>

#include "strata/device/device.h"

namespace strata::device::cuda {

// Fails with `unavailable` naming the reason when no usable GPU is present.
Result<std::unique_ptr<Device>> create_cuda_device(const DeviceOptions& options);
// "no GPU present (CUDA driver: ...)" or "1 GPU: NVIDIA H200, sm_90, 139 GiB".
std::string describe_cuda();

}  // namespace strata::device::cuda
