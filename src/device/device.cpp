// Backend-independent parts of the device interface and the backend registry.
#include "strata/device/device.h"

#include <algorithm>
#include <array>
#include <charconv>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>

#include "src/device/cpu/cpu_device.h"
#include "strata/build_config.h"
#include "strata/core/check.h"
#include "strata/core/json.h"
#include "strata/device/ops.h"
#if STRATA_HAVE_CUDA
#include "src/device/cuda/cuda_probe.h"
#endif

namespace strata::device {

void check_gemm_args(const GemmArgs& g, const char* who) {
  STRATA_CHECK(g.m >= 0 && g.n >= 0 && g.k >= 0, who, "negative gemm size", g.m, g.n, g.k);
  const std::int64_t a_cols = g.trans_a ? g.m : g.k;
  const std::int64_t b_cols = g.trans_b ? g.k : g.n;
  STRATA_CHECK(g.lda >= std::max<std::int64_t>(a_cols, 1), who, "gemm lda too small", g.lda,
               a_cols);
  STRATA_CHECK(g.ldb >= std::max<std::int64_t>(b_cols, 1), who, "gemm ldb too small", g.ldb,
               b_cols);
  STRATA_CHECK(g.ldc >= std::max<std::int64_t>(g.n, 1), who, "gemm ldc too small", g.ldc, g.n);
}

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

void Device::add_reclaimer(const void* owner, Reclaimer reclaimer) {
  std::lock_guard lock(reclaim_mu_);
  STRATA_CHECK(std::none_of(reclaimers_.begin(), reclaimers_.end(),
                            [&](const auto& r) { return r.first == owner; }),
               "a second reclaimer for one owner");
  reclaimers_.emplace_back(owner, std::move(reclaimer));
}

void Device::remove_reclaimer(const void* owner) {
  std::lock_guard lock(reclaim_mu_);
  std::erase_if(reclaimers_, [&](const auto& r) { return r.first == owner; });
}

std::uint64_t Device::reclaim(std::uint64_t bytes) {
  std::vector<Reclaimer> each;
  {
    std::lock_guard lock(reclaim_mu_);
    for (const auto& r : reclaimers_) each.push_back(r.second);
  }
  std::uint64_t freed = 0;
  for (const Reclaimer& r : each) {
    if (freed >= bytes) break;
    freed += r(bytes - freed);
  }
  return freed;
}

Result<DeviceBuffer> Device::allocate(std::size_t size_bytes, std::string_view what,
                                      bool reclaim_cache) {
  if (size_bytes == 0) return DeviceBuffer();
  auto r = allocate_impl(size_bytes);
  while (!r.is_ok() && reclaim_cache && reclaim(size_bytes) > 0) r = allocate_impl(size_bytes);
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
