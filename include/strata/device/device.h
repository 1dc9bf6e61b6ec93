// Device, Stream and Event interfaces shared by the CPU and CUDA backends.
//
// A Device owns a byte-budgeted memory arena, a compute stream and two copy streams. Everything
// above this module (mem, zero, model, train) uses only this interface, so the same code runs on
// the CPU backend (device memory is host memory, streams are ordered worker queues) and on CUDA.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "strata/core/status.h"
#include "strata/device/ops.h"

namespace strata::device {

enum class StreamKind : std::uint8_t { kCompute, kHostToDevice, kDeviceToHost };

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

// Move-only owner of one device allocation; returns the bytes to the budget when destroyed.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(Device* device, void* data, std::size_t size_bytes)
      : device_(device), data_(data), size_(size_bytes) {}
  ~DeviceBuffer() { reset(); }
  DeviceBuffer(DeviceBuffer&& o) noexcept { *this = std::move(o); }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* data() const { return data_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(data_);
  }
  std::size_t size() const { return size_; }
  bool empty() const { return data_ == nullptr; }
  void reset();

 private:
  Device* device_ = nullptr;
  void* data_ = nullptr;
  std::size_t size_ = 0;
};

class Device {
 public:
  virtual ~Device() = default;

  virtual std::string name() const = 0;
  // True when device pointers can be dereferenced by host code (the CPU backend).
  virtual bool host_addressable() const = 0;

  // Allocates from the budget. Exceeding device_memory_limit is an out_of_memory error naming
  // `what`, the request and the budget; it never over-commits.
  Result<DeviceBuffer> allocate(std::size_t size_bytes, std::string_view what);
  virtual MemoryStats memory_stats() const = 0;
  virtual void reset_peak() = 0;

  virtual Stream& stream(StreamKind kind) = 0;
  // Asynchronous copies, ordered on `stream`. Host memory should be pinned for real overlap.
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

 protected:
  friend class DeviceBuffer;
  virtual Result<void*> allocate_impl(std::size_t size_bytes) = 0;
  virtual void deallocate_impl(void* data, std::size_t size_bytes) = 0;
};

struct DeviceOptions {
  std::string kind = "cpu";              // "cpu" or "cuda"
  std::uint64_t memory_limit_bytes = 0;  // 0 = no limit on the CPU backend; required on CUDA
  int device_index = 0;
  int compute_threads = 0;  // CPU backend: threads for BLAS and ops; 0 = all cores
};

// Creates a backend. "cuda" without a CUDA build or without a GPU is an `unavailable` error that
// says which.
Result<std::unique_ptr<Device>> create_device(const DeviceOptions& options);

// One line on what this build and machine offer, e.g. "cpu (built with CUDA; no GPU present: ...)".
std::string describe_backends();

}  // namespace strata::device
