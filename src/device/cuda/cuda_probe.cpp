// The CUDA backend's registry entry: reports whether a GPU is usable and creates the device.
#include "src/device/cuda/cuda_probe.h"

#include <cstdlib>
#include <cstring>
#include <string>

#include "runtime.h"
#include "src/device/cuda/cublas_library.h"
#include "src/device/cuda/cuda_device.h"
#include "strata/core/json.h"
#include "strata/sys/environment.h"

namespace strata::device::cuda {

std::string describe_cuda() {
  // cuBLAS is opened here (as a CUDA device opens it), so a library that cannot be opened
  // shows in `strata info` before a run needs it.
  const Result<const CublasLibrary*> lib = cublas_library();
  const std::string libraries =
      (lib.is_ok() ? "cuBLASLt " + std::to_string((*lib)->cublasLtGetVersion())
                   : "cuBLAS not usable: " + lib.status().message()) +
      ", " + kernels::library_versions();
  const kernels::GpuInfo info = kernels::query_gpus();
  if (info.count == 0) return "built (" + libraries + "); no GPU usable: " + info.error;
  return "built (" + libraries + "); " + std::to_string(info.count) +
         " GPU(s), first: " + info.name + " sm_" + std::to_string(info.major) +
         std::to_string(info.minor) + ", " + format_bytes(info.total_bytes);
}

namespace {

kernels::AttentionKernel kernel_of(AttentionVariant variant) {
  switch (variant) {
    case AttentionVariant::kFlash2:
      return kernels::AttentionKernel::kFlash2;
    case AttentionVariant::kSimple:
      return kernels::AttentionKernel::kSimple;
    case AttentionVariant::kAuto:
      break;
  }
  return kernels::AttentionKernel::kAuto;
}

}  // namespace

bool sync_requested_by_environment(const char* (*getenv)(const char*)) {
  return sys::knob_on(sys::Knob::kCudaSync, getenv);
}

Result<CudaTuning> tuning_from_environment(const DeviceOptions& options,
                                           const char* (*getenv)(const char*)) {
  AttentionVariant variant = options.attention;
  if (const std::string asked = sys::knob(sys::Knob::kAttention, getenv); !asked.empty()) {
    std::string choices;
    bool known = false;
    for (const AttentionVariant v : kAttentionVariants) {
      choices += (choices.empty() ? "" : "|") + std::string(attention_variant_name(v));
      if (attention_variant_name(v) == asked) {
        variant = v;
        known = true;
      }
    }
    if (!known) {
      return invalid_argument("STRATA_ATTENTION '" + std::string(asked) +
                              "' is not an attention variant; expected one of " + choices +
                              " (or unset it to use the config's attention)");
    }
  }
  CudaTuning tuning;
  tuning.attention = kernel_of(variant);
  tuning.attention_falls_back = true;
  tuning.sync_after_each_op = sync_requested_by_environment(getenv);
  return tuning;
}

Result<std::unique_ptr<Device>> create_cuda_device(const DeviceOptions& options) {
  STRATA_ASSIGN_OR_RETURN(const CudaTuning tuning, tuning_from_environment(options));
  return create_cuda_device(options, tuning);
}

Result<std::unique_ptr<Device>> create_cuda_device(const DeviceOptions& options,
                                                   const CudaTuning& tuning) {
  const kernels::GpuInfo info = kernels::query_gpus();
  if (info.count == 0) {
    return unavailable("device 'cuda' requested, but no GPU is usable on this machine (" +
                       info.error + "); set device: \"cpu\" to train on the CPU backend");
  }
  STRATA_ASSIGN_OR_RETURN(const sys::Launch launch, sys::read_launch());
  const LocalRank local{launch.local_rank, launch.local_size, launch.source};
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
