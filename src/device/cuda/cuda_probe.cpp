// The CUDA backend's registry entry: reports whether a GPU is usable and creates the device.
#include "src/device/cuda/cuda_probe.h"

#include <cstdlib>
#include <cstring>

#include "runtime.h"
#include "src/device/cuda/cuda_device.h"
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

Result<std::unique_ptr<Device>> create_cuda_device(const DeviceOptions& options) {
  CudaTuning tuning;
  // Read once, at creation; nothing in the process sets it.
  const char* sync = std::getenv("STRATA_CUDA_SYNC");  // NOLINT(concurrency-mt-unsafe)
  tuning.sync_after_each_op = sync != nullptr && std::strcmp(sync, "1") == 0;
  return create_cuda_device(options, tuning);
}

Result<std::unique_ptr<Device>> create_cuda_device(const DeviceOptions& options,
                                                   const CudaTuning& tuning) {
  const kernels::GpuInfo info = kernels::query_gpus();
  if (info.count == 0) {
    return unavailable("device 'cuda' requested, but no GPU is usable on this machine (" +
                       info.error + "); set device: \"cpu\" to train on the CPU backend");
  }
  STRATA_ASSIGN_OR_RETURN(const LocalRank local, local_rank_from_environment());
  STRATA_ASSIGN_OR_RETURN(const int index,
                          choose_device_index(options.device_index, local, info.count));
  if (options.memory_limit_bytes == 0) {
    return invalid_argument(
        "device 'cuda' needs device_memory_limit: the backend reserves that many bytes of GPU "
        "memory up front (the GPU has " +
        format_bytes(info.total_bytes) + "; e.g. \"" + format_bytes(info.total_bytes / 10 * 9) +
        "\")");
  }
  DeviceOptions chosen = options;
  chosen.device_index = index;
  return CudaDevice::create(chosen, tuning);
}

}  // namespace strata::device::cuda
