// CudaDevice: the Device interface on one NVIDIA GPU. Device memory is one cudaMalloc arena of
// device_memory_limit bytes with a first-fit allocator; three non-blocking streams; events are
// cudaEvents. Private to the CUDA backend (CUDA builds only).
#pragma once

#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "kernels/launchers.h"
#include "src/device/cuda/cuda_arena.h"
#include "src/device/cuda/cuda_check.h"
#include "src/device/cuda/cuda_probe.h"
#include "strata/device/device.h"

namespace strata::device::cuda {

class CudaStream final : public Stream {
 public:
  CudaStream(StreamKind kind, std::shared_ptr<ErrorState> errors)
      : kind_(kind), errors_(std::move(errors)) {}
  ~CudaStream() override;
  CudaStream(const CudaStream&) = delete;
  CudaStream& operator=(const CudaStream&) = delete;

  Status init();
  StreamKind kind() const override { return kind_; }
  void synchronize() override;
  void* native_handle() override { return stream_; }
  cudaStream_t get() const { return stream_; }

 private:
  StreamKind kind_;
  std::shared_ptr<ErrorState> errors_;
  cudaStream_t stream_ = nullptr;
};

class CudaDevice final : public Device {
 public:
  static Result<std::unique_ptr<Device>> create(const DeviceOptions& options,
                                                const CudaTuning& tuning);
  ~CudaDevice() override;

  std::string name() const override { return name_; }
  bool host_addressable() const override { return false; }
  MemoryStats memory_stats() const override;
  void reset_peak() override;

  Stream& stream(StreamKind kind) override;
  void copy_to_device(void* dst_device, const void* src_host, std::size_t size_bytes,
                      Stream& stream) override;
  void copy_to_host(void* dst_host, const void* src_device, std::size_t size_bytes,
                    Stream& stream) override;
  void fill_zero(void* dst_device, std::size_t size_bytes, Stream& stream) override;
  Event record_event(Stream& stream) override;
  void wait_event(Stream& waiter, const Event& event) override;
  const Ops& ops() const override { return *ops_; }
  Status last_error() const override { return errors_->first(); }

  Result<PinnedBuffer> allocate_pinned(std::size_t size_bytes, std::string_view what) override;
  Result<HostRegistration> register_host(void* data, std::size_t size_bytes) override;

  // For the op table.
  int index() const { return index_; }
  // The CUDA runtime's current device is per host thread; calls that enqueue work make it ours
  // first, so a device other than GPU 0 works from any thread.
  // A failure (a lost device) becomes the sticky error, so the work that follows is not
  // silently enqueued on another GPU.
  void bind() const {
    if (index_ != 0) errors_->record(STRATA_CUDA_STATUS(cudaSetDevice(index_)));
  }
  cudaStream_t compute_stream() const { return compute_.get(); }
  ErrorState& errors() const { return *errors_; }
  const kernels::LaunchContext& launch_context() const { return launch_; }

 protected:
  Result<void*> allocate_impl(std::size_t size_bytes) override;
  void deallocate_impl(void* data, std::size_t size_bytes) override;
  void free_pinned_impl(void* data, std::size_t size_bytes, bool page_locked) override;
  void unregister_host_impl(void* data, std::size_t size_bytes, bool page_locked) override;

 private:
  // A freed block goes back to the arena only once all work enqueued before the free, on every
  // stream, has finished: a kernel may still read a buffer whose owner released it, and the next
  // owner may write it from another stream.
  static constexpr int kNumStreams = 5;  // compute, h2d, d2h, collective, tensor collective
  struct PendingFree {
    std::size_t offset;
    cudaEvent_t done[kNumStreams];  // one per stream, in all_streams() order
  };

  CudaDevice(const DeviceOptions& options, const CudaTuning& tuning, std::size_t capacity);
  Status init(const cudaDeviceProp& prop);
  CudaStream& as_cuda(Stream& s);
  CudaStream& by_kind(StreamKind kind);
  std::array<CudaStream*, kNumStreams> all_streams() {
    return {&compute_, &h2d_, &d2h_, &collective_, &tensor_collective_};
  }
  bool check(cudaError_t err, const char* call, const char* file, int line) const;
  // Both with mu_ held. reclaim returns completed pending frees to the arena; wait_oldest
  // blocks on the oldest. They return false if there was nothing to do.
  bool reclaim_completed();
  bool wait_oldest();
  void release(PendingFree& p);
  cudaEvent_t take_event();

  int index_;
  std::string name_;
  std::uint64_t limit_;
  CudaTuning tuning_;
  bool allow_tf32_;
  std::shared_ptr<ErrorState> errors_;
  CudaStream compute_, h2d_, d2h_, collective_, tensor_collective_;
  kernels::LaunchContext launch_;
  std::byte* base_ = nullptr;

  mutable std::mutex mu_;
  ArenaAllocator arena_;
  std::uint64_t in_use_ = 0, peak_ = 0, num_allocations_ = 0;
  std::deque<PendingFree> pending_;
  std::vector<cudaEvent_t> free_events_;

  std::unique_ptr<Ops> ops_;
};

// The op table over the kernels and cuBLASLt (cuda_ops.cpp).
Result<std::unique_ptr<Ops>> make_cuda_ops(CudaDevice& device, const CudaTuning& tuning,
                                           bool allow_tf32, std::uint64_t limit_bytes);

}  // namespace strata::device::cuda
