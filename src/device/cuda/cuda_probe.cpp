// The CUDA backend's registry entry: reports whether a GPU is usable.
#include "src/device/cuda/cuda_probe.h"

#include "runtime.h"
#include "strata/core/json.h"

namespace strata::device::cuda {

std::string describe_cuda() {
  const kernels::GpuInfo info = kernels::query_gpus();
  if (info.count == 0)
    return "built (" + kernels::library_versions() + "); no GPU usable: " + info.error;
  return "built (" + kernels::library_versions() + "); " + std::to_string(info.count) +
         " GPU(s), first: " + info.name + " sm_" + std::to_string(info.major) +
         std::to_string(info.minor) + ", " + format_bytes(info.total_bytes);
}

Result<std::unique_ptr<Device>> create_cuda_device(const DeviceOptions& /*options*/) {
  const kernels::GpuInfo info = kernels::query_gpus();
  if (info.count == 0) {
    return unavailable("device 'cuda' requested, but no GPU is usable on this machine (" +
                       info.error + "); set device: \"cpu\" to train on the CPU backend");
  }
  return unavailable("a GPU is present (" + info.name +
                     "), but the CUDA device backend is not part of this build yet; set "
                     "device: \"cpu\"");
}

}  // namespace strata::device::cuda
