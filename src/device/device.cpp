// Backend-independent parts of the device interface and the backend registry.
#include "strata/device/device.h"

#include <array>
#include <charconv>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>

#include "src/device/cpu/cpu_device.h"
#include "strata/build_config.h"
#include "strata/core/json.h"
#if STRATA_HAVE_CUDA
#include "src/device/cuda/cuda_probe.h"
#endif

namespace strata::device {

template <MemoryKind K>
void DeviceMemory<K>::reset() {
  if (data_ != nullptr) {
    if constexpr (K == MemoryKind::kDevice) {
      device_->deallocate_impl(data_, size_);
    } else if constexpr (K == MemoryKind::kPinned) {
      device_->free_pinned_impl(data_, size_, page_locked_);
    } else {
      device_->unregister_host_impl(data_, size_, page_locked_);
    }
  }
  device_ = nullptr;
  data_ = nullptr;
  size_ = 0;
  page_locked_ = false;
}

template class DeviceMemory<MemoryKind::kDevice>;
template class DeviceMemory<MemoryKind::kPinned>;
template class DeviceMemory<MemoryKind::kRegistered>;

Result<DeviceBuffer> Device::allocate(std::size_t size_bytes, std::string_view what) {
  if (size_bytes == 0) return DeviceBuffer();
  auto r = allocate_impl(size_bytes);
  if (!r.is_ok()) {
    const MemoryStats s = memory_stats();
    return out_of_memory("cannot allocate " + format_bytes(size_bytes) + " on " + name() + " for " +
                         std::string(what) + ": " + format_bytes(s.in_use_bytes) + " of the " +
                         format_bytes(s.limit_bytes) + " device_memory_limit already in use (" +
                         r.status().message() +
                         "); raise device_memory_limit, lower micro_batch_size or seq_len, or "
                         "enable activation_checkpointing");
  }
  return DeviceBuffer(this, *r, size_bytes);
}

std::string_view device_kind_name(DeviceKind kind) {
  return kind == DeviceKind::kCpu ? "cpu" : "cuda";
}

Result<std::unique_ptr<Device>> create_device(const DeviceOptions& options) {
  if (options.kind == DeviceKind::kCpu) return make_cpu_device(options);
#if STRATA_HAVE_CUDA
  return cuda::create_cuda_device(options);
#else
  return unavailable(
      "device 'cuda' requested, but this build of Strata has no CUDA backend (nvcc was not "
      "found when it was configured); rebuild on a machine with the CUDA toolkit or set "
      "device: \"cpu\"");
#endif
}

Result<LocalRank> local_rank_from_environment(const char* (*getenv)(const char*)) {
  if (getenv == nullptr) getenv = [](const char* name) -> const char* { return std::getenv(name); };
  // Launchers in the order of how sure their variables are: each names rank and size.
  static constexpr std::array<std::pair<const char*, const char*>, 4> kVars = {{
      {"OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"},
      {"MPI_LOCALRANKID", "MPI_LOCALNRANKS"},
      {"LOCAL_RANK", "LOCAL_WORLD_SIZE"},
      {"SLURM_LOCALID", nullptr},
  }};
  const auto parse = [](const char* name, const char* text, int min) -> Result<int> {
    int v = 0;
    const char* end = text + std::strlen(text);
    const auto [ptr, ec] = std::from_chars(text, end, v);
    if (ec != std::errc() || ptr != end || text == end || v < min) {
      return invalid_argument("environment variable " + std::string(name) + "=\"" + text +
                              "\" is not an integer >= " + std::to_string(min));
    }
    return v;
  };
  for (const auto& [rank_var, size_var] : kVars) {
    const char* r = getenv(rank_var);
    if (r == nullptr) continue;
    LocalRank lr;
    lr.source = rank_var;
    STRATA_ASSIGN_OR_RETURN(lr.rank, parse(rank_var, r, 0));
    lr.size = 0;
    if (const char* n = size_var != nullptr ? getenv(size_var) : nullptr) {
      STRATA_ASSIGN_OR_RETURN(lr.size, parse(size_var, n, 1));
      if (lr.rank >= lr.size) {
        return invalid_argument(std::string(rank_var) + "=" + r + " is not below " + size_var +
                                "=" + n);
      }
    }
    return lr;
  }
  return LocalRank{};
}

Result<int> choose_device_index(int configured, const LocalRank& local, int visible_devices) {
  if (visible_devices <= 0) return unavailable("no GPU is visible to this process");
  const std::string ranks =
      local.size > 0 ? std::to_string(local.size) + " ranks on this node" : "several ranks";
  const std::string gpus =
      std::to_string(visible_devices) + " visible GPU" + (visible_devices == 1 ? "" : "s");
  if (configured != kAutoDeviceIndex) {
    if (configured < 0 || configured >= visible_devices) {
      return invalid_argument("device_index " + std::to_string(configured) + " is not one of the " +
                              gpus + " (0.." + std::to_string(visible_devices - 1) +
                              "; -1 picks the node-local rank's)");
    }
    if (local.size > 1) {
      return invalid_argument("device_index " + std::to_string(configured) + " puts all " + ranks +
                              " on one GPU, which NCCL refuses; leave device_index at -1 so " +
                              "each rank takes its node-local rank's GPU");
    }
    return configured;
  }
  if (visible_devices == 1) return 0;  // one GPU each (CUDA_VISIBLE_DEVICES), or one rank
  if (local.rank >= visible_devices) {
    return invalid_argument("node-local rank " + std::to_string(local.rank) + " (" + local.source +
                            ") has no GPU of its own: " + ranks + " but " + gpus +
                            "; start at most one rank per GPU");
  }
  return local.rank;
}

std::string describe_backends() {
#if STRATA_HAVE_CUDA
  return "cpu; cuda: " + cuda::describe_cuda();
#else
  return "cpu; cuda: not built";
#endif
}

}  // namespace strata::device
