// Device, Stream and Event interfaces shared by the CPU and CUDA backends.
//
// A Device owns a byte-budgeted memory arena, a compute stream and two copy streams. Everything
// above this module (mem, zero, model, train) uses only this interface, so the same code runs on
// the CPU backend (device memory is host memory, streams are ordered worker queues) and on CUDA.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "strata/core/status.h"
#include "strata/device/ops.h"

namespace strata::device {

// kCollective carries device collectives (NCCL). Freed device memory is reused only after the
// work queued on every stream before the free has finished, collectives included, so a buffer a
// collective still reads or writes is never handed to a new owner. On the CPU backend host
// collectives run on the calling thread: kCollective is the compute stream there.
// kCollective: ZeRO's collectives (and every other axis's); kTensorCollective: the tensor-parallel
// group's, apart, so that an all-reduce compute waits for never queues behind a prefetched gather.
enum class StreamKind : std::uint8_t {
  kCompute,
  kHostToDevice,
  kDeviceToHost,
  kCollective,
  kTensorCollective
};

struct MemoryStats {
  std::uint64_t limit_bytes = 0;
  std::uint64_t in_use_bytes = 0;
  std::uint64_t peak_bytes = 0;
  std::uint64_t num_allocations = 0;
};

class Device;

// An ordered queue of work. Work enqueued on one stream runs in order; streams run concurrently.
class Stream {
 public:
  virtual ~Stream() = default;
  virtual StreamKind kind() const = 0;
  // Blocks the calling thread until everything enqueued so far has finished.
  virtual void synchronize() = 0;
  // The backend's own stream object (a cudaStream_t on CUDA) for libraries such as NCCL that
  // enqueue work themselves; nullptr on backends without one.
  virtual void* native_handle() { return nullptr; }
};

// A point in a stream's order. Copyable handle; default-constructed events are already complete.
class Event {
 public:
  struct Impl {
    virtual ~Impl() = default;
    virtual bool query() const = 0;  // true once reached
    virtual void wait() const = 0;   // host blocks until reached
  };
  Event() = default;
  explicit Event(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
  bool ready() const { return impl_ == nullptr || impl_->query(); }
  void synchronize() const {
    if (impl_) impl_->wait();
  }
  const Impl* impl() const { return impl_.get(); }

 private:
  std::shared_ptr<Impl> impl_;
};

// What a DeviceMemory gives back when it is destroyed or reset.
enum class MemoryKind : std::uint8_t {
  kDevice,      // Device::allocate: the bytes return to the device budget
  kPinned,      // Device::allocate_pinned: host memory, page-locked where the OS allows
  kRegistered,  // Device::register_host: an existing host range, unregistered (it must outlive
                // the registration)
};

// Move-only owner of one range a Device handed out.
template <MemoryKind K>
class DeviceMemory {
 public:
  DeviceMemory() = default;
  DeviceMemory(Device* device, void* data, std::size_t size_bytes, bool page_locked = false)
      : device_(device), data_(data), size_(size_bytes), page_locked_(page_locked) {}
  ~DeviceMemory() { reset(); }
  DeviceMemory(DeviceMemory&& o) noexcept { *this = std::move(o); }
  DeviceMemory& operator=(DeviceMemory&& o) noexcept {
    if (this != &o) {
      reset();
      device_ = std::exchange(o.device_, nullptr);
      data_ = std::exchange(o.data_, nullptr);
      size_ = std::exchange(o.size_, 0);
      page_locked_ = std::exchange(o.page_locked_, false);
    }
    return *this;
  }
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;

  void* data() const { return data_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(data_);
  }
  std::size_t size() const { return size_; }
  bool empty() const { return data_ == nullptr; }
  // Host memory: locked in RAM, so copies run at full speed and truly overlap.
  bool page_locked() const { return page_locked_; }
  void reset();
  // Forgets the memory without giving it back: for a buffer that a collective which never
  // finished may still write into. The device keeps counting it as in use.
  void abandon() {
    device_ = nullptr;
    data_ = nullptr;
    size_ = 0;
  }

 private:
  Device* device_ = nullptr;
  void* data_ = nullptr;
  std::size_t size_ = 0;
  bool page_locked_ = false;
};

using DeviceBuffer = DeviceMemory<MemoryKind::kDevice>;
using PinnedBuffer = DeviceMemory<MemoryKind::kPinned>;
using HostRegistration = DeviceMemory<MemoryKind::kRegistered>;

class Device {
 public:
  virtual ~Device() = default;

  virtual std::string name() const = 0;
  // True when device pointers can be dereferenced by host code (the CPU backend).
  virtual bool host_addressable() const = 0;

  // Allocates from the budget. Exceeding device_memory_limit is an out_of_memory error naming
  // `what`, the request and the budget; it never over-commits. Where the budget has no room, the
  // reclaimers free what their owners hold only as a cache and the allocation is tried again
  // while one frees anything; `reclaim_cache` false skips them (the tiered store makes room for its
  // own allocations its own way, under its own lock).
  Result<DeviceBuffer> allocate(std::size_t size_bytes, std::string_view what,
                                bool reclaim_cache = true);
  // A reclaimer frees device memory its owner keeps only as a cache (the tiered store: freed
  // blocks and clean copies it keeps for reuse) toward `bytes` and returns the bytes it freed;
  // it is called from the allocating thread, outside every device lock. One per owner.
  using Reclaimer = std::function<std::uint64_t(std::uint64_t bytes)>;
  void add_reclaimer(const void* owner, Reclaimer reclaimer);
  void remove_reclaimer(const void* owner);
  virtual MemoryStats memory_stats() const = 0;
  virtual void reset_peak() = 0;

  virtual Stream& stream(StreamKind kind) = 0;
  // Asynchronous copies, ordered on `stream`. Host memory must be pinned (allocate_pinned or
  // register_host) for the copy to overlap; see DeviceOptions::strict_host_memory.
  virtual void copy_to_device(void* dst_device, const void* src_host, std::size_t size_bytes,
                              Stream& stream) = 0;
  virtual void copy_to_host(void* dst_host, const void* src_device, std::size_t size_bytes,
                            Stream& stream) = 0;
  virtual void fill_zero(void* dst_device, std::size_t size_bytes, Stream& stream) = 0;
  // Records the current end of `stream`; wait_event makes `waiter` wait for it without blocking
  // the host.
  virtual Event record_event(Stream& stream) = 0;
  virtual void wait_event(Stream& waiter, const Event& event) = 0;

  // The op table. Ops run on the compute stream in order.
  virtual const Ops& ops() const = 0;

  // Sticky error from asynchronous work (a failed copy, a kernel fault); ok when none.
  virtual Status last_error() const { return Status::ok(); }

  // Host memory for the staging side of copies, 4096-byte aligned (usable with O_DIRECT) and
  // outside the device budget. CUDA: a huge-page mapping (sys/host_mapping.h) registered with
  // cudaHostRegister (always page-locked; failure is an error), memory io_uring can register too.
  // CPU: an aligned allocation locked with mlock where RLIMIT_MEMLOCK allows (best effort).
  virtual Result<PinnedBuffer> allocate_pinned(std::size_t size_bytes, std::string_view what) = 0;
  // Page-locks an existing host range (e.g. a pool the tiered store owns) for fast copies until
  // the registration is destroyed. CUDA: cudaHostRegister; CPU: mlock, best effort.
  virtual Result<HostRegistration> register_host(void* data, std::size_t size_bytes) = 0;

 protected:
  template <MemoryKind>
  friend class DeviceMemory;
  virtual Result<void*> allocate_impl(std::size_t size_bytes) = 0;
  virtual void deallocate_impl(void* data, std::size_t size_bytes) = 0;
  virtual void free_pinned_impl(void* data, std::size_t size_bytes, bool page_locked) = 0;
  virtual void unregister_host_impl(void* data, std::size_t size_bytes, bool page_locked) = 0;

 private:
  // Asks the reclaimers for `bytes`; the bytes they freed.
  std::uint64_t reclaim(std::uint64_t bytes);
  std::mutex reclaim_mu_;
  std::vector<std::pair<const void*, Reclaimer>> reclaimers_;
};

enum class DeviceKind : std::uint8_t { kCpu, kCuda };
inline constexpr std::array<DeviceKind, 2> kDeviceKinds = {DeviceKind::kCpu, DeviceKind::kCuda};
inline std::string_view device_kind_name(DeviceKind kind) {
  return kind == DeviceKind::kCpu ? "cpu" : "cuda";
}

inline constexpr int kAutoDeviceIndex = -1;

// CUDA backend: the attention kernels (config key `attention`; STRATA_ATTENTION in the
// environment overrides it). kFlash2 serves the calls it applies to (bf16, head_dim 64 or 128,
// sm_80+) and the simple kernels the rest; kAuto is the same choice (the default); kSimple is the
// simple kernels everywhere. The CPU backend has one kind of kernel.
enum class AttentionVariant : std::uint8_t { kAuto, kFlash2, kSimple };
inline constexpr std::array<AttentionVariant, 3> kAttentionVariants = {
    AttentionVariant::kAuto, AttentionVariant::kFlash2, AttentionVariant::kSimple};
constexpr std::string_view attention_variant_name(AttentionVariant variant) {
  switch (variant) {
    case AttentionVariant::kFlash2:
      return "flash2";
    case AttentionVariant::kSimple:
      return "simple";
    case AttentionVariant::kAuto:
      break;
  }
  return "auto";
}

struct DeviceOptions {
  DeviceKind kind = DeviceKind::kCpu;
  std::uint64_t memory_limit_bytes = 0;  // 0 = no limit on the CPU backend; required on CUDA
  // CUDA backend: which GPU. kAutoDeviceIndex: the node-local rank's (choose_device_index).
  int device_index = kAutoDeviceIndex;
  int compute_threads = 0;  // CPU backend: threads for BLAS and ops; 0 = all cores
  // CUDA backend: fp32 GEMMs may use TF32 tensor cores (about 10 mantissa bits per product);
  // off by default so that fp32 runs match the CPU backend to 1e-5.
  bool allow_tf32 = false;
  AttentionVariant attention = AttentionVariant::kAuto;  // CUDA backend; see AttentionVariant
  // CPU backend: a copy between the device and host memory that neither allocate_pinned nor
  // register_host covers stops the process with a message naming the copy. On CUDA such a copy
  // from pageable memory is synchronous and slow, so the suite runs with this on (also set by
  // the environment variable STRATA_STRICT_HOST_MEMORY=1) to catch one without a GPU.
  bool strict_host_memory = false;
};

// Creates a backend. CUDA without a CUDA build or without a GPU is an `unavailable` error that
// says which.
Result<std::unique_ptr<Device>> create_device(const DeviceOptions& options);

// The node-local rank and rank count as the launcher set them (sys::read_launch's local_rank,
// local_size and source).
struct LocalRank {
  int rank = 0;
  int size = 1;        // 0 when the launcher does not say
  std::string source;  // the variable it came from; empty when none was set
};

// The GPU a rank uses, from the configured index (kAutoDeviceIndex or an explicit one), its
// node-local rank and the number of GPUs it can see. Auto gives local rank r GPU r, and GPU 0
// when a rank sees one GPU (the launcher gave each rank its own through CUDA_VISIBLE_DEVICES);
// more local ranks than visible GPUs, or one explicit index for several local ranks, is an error
// naming the counts, since two ranks on one GPU cannot form an NCCL communicator.
Result<int> choose_device_index(int configured, const LocalRank& local, int visible_devices);

// One line on what this build and machine offer, e.g. "cpu (built with CUDA; no GPU present: ...)".
std::string describe_backends();

}  // namespace strata::device
