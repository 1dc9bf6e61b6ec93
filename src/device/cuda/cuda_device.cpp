// CudaDevice: arena allocation with stream-safe reuse, streams, events, copies and pinned host
// memory on one GPU.
#include "src/device/cuda/cuda_device.h"

#include <algorithm>
#include <cstdlib>
#include <new>
#include <utility>

#include "strata/core/aligned.h"
#include "strata/core/json.h"
#include "strata/sys/host_mapping.h"

namespace strata::device::cuda {
namespace {

// Events a host thread may wait on (Event::wait, an allocation waiting for a free): the waiting
// thread blocks instead of spinning a core.
constexpr unsigned kHostWaitedEvent = cudaEventDisableTiming | cudaEventBlockingSync;

// A cudaEvent recorded on a stream. The CUDA context outlives every device object, so an event
// handle may outlive the CudaDevice that made it.
struct CudaEvent final : Event::Impl {
  CudaEvent(cudaEvent_t e, std::shared_ptr<ErrorState> errs) : event(e), errors(std::move(errs)) {}
  ~CudaEvent() override { cudaEventDestroy(event); }
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;

  bool query() const override {
    const cudaError_t e = cudaEventQuery(event);
    if (e == cudaErrorNotReady) return false;
    // A failed query (a fault in the work before it) counts as reached, so no caller spins
    // forever; the error is sticky on the device.
    errors->record(STRATA_CUDA_STATUS(e));
    return true;
  }
  void wait() const override { errors->record(STRATA_CUDA_STATUS(cudaEventSynchronize(event))); }

  cudaEvent_t event;
  std::shared_ptr<ErrorState> errors;
};

}  // namespace

// ---- streams

CudaStream::~CudaStream() {
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

Status CudaStream::init() {
  // Non-blocking: never implicitly ordered with the legacy default stream, which other
  // libraries in the process may use.
  return STRATA_CUDA_STATUS(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
}

void CudaStream::synchronize() {
  errors_->record(STRATA_CUDA_STATUS(cudaStreamSynchronize(stream_)));
}

// ---- creation

CudaDevice::CudaDevice(const DeviceOptions& options, const CudaTuning& tuning, std::size_t capacity)
    : index_(options.device_index),
      limit_(capacity),
      tuning_(tuning),
      allow_tf32_(options.allow_tf32),
      errors_(std::make_shared<ErrorState>()),
      compute_(StreamKind::kCompute, errors_),
      h2d_(StreamKind::kHostToDevice, errors_),
      d2h_(StreamKind::kDeviceToHost, errors_),
      collective_(StreamKind::kCollective, errors_),
      tensor_collective_(StreamKind::kTensorCollective, errors_),
      arena_(capacity) {}

Result<std::unique_ptr<Device>> CudaDevice::create(const DeviceOptions& options,
                                                   const CudaTuning& tuning) {
  STRATA_CUDA_RETURN_IF_ERROR(cudaSetDevice(options.device_index));
  // A host thread waiting for the GPU sleeps instead of spinning: the store's lane threads and
  // the main thread wait often, and a spinning one takes a core from the CPU optimizer.
  STRATA_CUDA_RETURN_IF_ERROR(cudaSetDeviceFlags(cudaDeviceScheduleBlockingSync));
  cudaDeviceProp prop{};
  STRATA_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, options.device_index));
  std::size_t free_bytes = 0, total_bytes = 0;
  STRATA_CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&free_bytes, &total_bytes));
  const std::size_t capacity =
      options.memory_limit_bytes / ArenaAllocator::kAlignBytes * ArenaAllocator::kAlignBytes;
  if (capacity == 0) {
    return invalid_argument("device_memory_limit of " + format_bytes(options.memory_limit_bytes) +
                            " is too small for the CUDA backend; it needs at least 256 B");
  }
  if (capacity > free_bytes) {
    return out_of_memory("device_memory_limit " + format_bytes(capacity) + " exceeds the " +
                         format_bytes(free_bytes) + " free on GPU " +
                         std::to_string(options.device_index) + " (" + prop.name + ", " +
                         format_bytes(total_bytes) +
                         " in all); lower device_memory_limit or free the GPU");
  }
  std::unique_ptr<CudaDevice> dev(new CudaDevice(options, tuning, capacity));
  STRATA_RETURN_IF_ERROR(dev->init(prop));
  return std::unique_ptr<Device>(std::move(dev));
}

Status CudaDevice::init(const cudaDeviceProp& prop) {
  name_ = "cuda:" + std::to_string(index_) + " (" + prop.name + ", sm_" +
          std::to_string(prop.major) + std::to_string(prop.minor) + ")";
  void* base = nullptr;
  STRATA_CUDA_RETURN_IF_ERROR(cudaMalloc(&base, limit_));
  base_ = static_cast<std::byte*>(base);
  STRATA_RETURN_IF_ERROR(compute_.init());
  STRATA_RETURN_IF_ERROR(h2d_.init());
  STRATA_RETURN_IF_ERROR(d2h_.init());
  STRATA_RETURN_IF_ERROR(collective_.init());
  STRATA_RETURN_IF_ERROR(tensor_collective_.init());
  int smem_optin = 0;
  STRATA_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, index_));
  launch_.stream = compute_.get();
  launch_.max_smem_optin_bytes = static_cast<std::size_t>(smem_optin);
  launch_.compute_major = prop.major;
  STRATA_ASSIGN_OR_RETURN(ops_, make_cuda_ops(*this, tuning_, allow_tf32_, limit_));
  return Status::ok();
}

CudaDevice::~CudaDevice() {
  ops_.reset();  // returns its workspace and scratch to the arena
  cudaSetDevice(index_);
  for (CudaStream* s : all_streams()) {
    if (s->get() != nullptr) cudaStreamSynchronize(s->get());
  }
  for (PendingFree& p : pending_) {
    for (cudaEvent_t e : p.done) cudaEventDestroy(e);
  }
  for (cudaEvent_t e : free_events_) cudaEventDestroy(e);
  if (base_ != nullptr) cudaFree(base_);
}

bool CudaDevice::check(cudaError_t err, const char* call, const char* file, int line) const {
  return errors_->record(cuda_status(err, call, file, line));
}

#define STRATA_CUDA_CHECK_STICKY(call) check((call), #call, __FILE__, __LINE__)

// ---- memory

MemoryStats CudaDevice::memory_stats() const {
  std::lock_guard lock(mu_);
  return MemoryStats{limit_, in_use_, peak_, num_allocations_};
}

void CudaDevice::reset_peak() {
  std::lock_guard lock(mu_);
  peak_ = in_use_;
}

cudaEvent_t CudaDevice::take_event() {
  if (!free_events_.empty()) {
    cudaEvent_t e = free_events_.back();
    free_events_.pop_back();
    return e;
  }
  cudaEvent_t e = nullptr;
  if (!STRATA_CUDA_CHECK_STICKY(cudaEventCreateWithFlags(&e, kHostWaitedEvent))) return nullptr;
  return e;
}

void CudaDevice::release(PendingFree& p) {
  arena_.free(p.offset);
  for (cudaEvent_t e : p.done) {
    if (e != nullptr) free_events_.push_back(e);
  }
}

bool CudaDevice::reclaim_completed() {
  bool any = false;
  // Frees record events on all four streams in order, so they complete in queue order.
  while (!pending_.empty()) {
    PendingFree& p = pending_.front();
    bool done = true;
    for (cudaEvent_t e : p.done) {
      if (e == nullptr) continue;
      const cudaError_t err = cudaEventQuery(e);
      if (err == cudaErrorNotReady) {
        done = false;
        break;
      }
      STRATA_CUDA_CHECK_STICKY(err);
    }
    if (!done) break;
    release(p);
    pending_.pop_front();
    any = true;
  }
  return any;
}

bool CudaDevice::wait_oldest() {
  if (pending_.empty()) return false;
  PendingFree& p = pending_.front();
  for (cudaEvent_t e : p.done) {
    if (e != nullptr) STRATA_CUDA_CHECK_STICKY(cudaEventSynchronize(e));
  }
  release(p);
  pending_.pop_front();
  return true;
}

Result<void*> CudaDevice::allocate_impl(std::size_t size_bytes) {
  bind();
  const std::size_t rounded = ArenaAllocator::round(size_bytes);
  std::lock_guard lock(mu_);
  if (in_use_ + rounded > limit_) {
    return out_of_memory("request of " + format_bytes(rounded) + " exceeds the budget");
  }
  reclaim_completed();
  auto offset = arena_.allocate(rounded);
  // Within budget but no block big enough: blocks freed while GPU work still used them are
  // on their way back; wait for them, oldest first.
  while (!offset && wait_oldest()) offset = arena_.allocate(rounded);
  if (!offset) {
    return out_of_memory("the device arena is fragmented: " + format_bytes(arena_.free_bytes()) +
                         " free, but the largest free block is " +
                         format_bytes(arena_.largest_free_block()));
  }
  in_use_ += rounded;
  peak_ = std::max(peak_, in_use_);
  ++num_allocations_;
  return static_cast<void*>(base_ + *offset);
}

void CudaDevice::deallocate_impl(void* data, std::size_t size_bytes) {
  bind();
  const std::size_t rounded = ArenaAllocator::round(size_bytes);
  std::lock_guard lock(mu_);
  in_use_ -= rounded;
  PendingFree p{static_cast<std::size_t>(static_cast<std::byte*>(data) - base_), {}};
  int slot = 0;
  bool recorded = true;
  for (CudaStream* s : all_streams()) {
    cudaEvent_t e = take_event();
    p.done[slot++] = e;
    if (e == nullptr || !STRATA_CUDA_CHECK_STICKY(cudaEventRecord(e, s->get()))) recorded = false;
  }
  if (!recorded) {
    // Without events the reuse point is unknown: wait for the streams instead.
    for (CudaStream* s : all_streams()) cudaStreamSynchronize(s->get());
    release(p);
    return;
  }
  pending_.push_back(p);
  reclaim_completed();  // keeps the queue short when the GPU is ahead
}

// ---- streams, copies, events

CudaStream& CudaDevice::as_cuda(Stream& s) { return by_kind(s.kind()); }

Stream& CudaDevice::stream(StreamKind kind) { return by_kind(kind); }

CudaStream& CudaDevice::by_kind(StreamKind kind) {
  switch (kind) {
    case StreamKind::kCompute:
      return compute_;
    case StreamKind::kHostToDevice:
      return h2d_;
    case StreamKind::kDeviceToHost:
      return d2h_;
    case StreamKind::kCollective:
      return collective_;
    case StreamKind::kTensorCollective:
      return tensor_collective_;
  }
  return compute_;
}

void CudaDevice::copy_to_device(void* dst, const void* src, std::size_t n, Stream& s) {
  if (n == 0) return;
  bind();
  STRATA_CUDA_CHECK_STICKY(cudaMemcpyAsync(dst, src, n, cudaMemcpyHostToDevice, as_cuda(s).get()));
}

void CudaDevice::copy_to_host(void* dst, const void* src, std::size_t n, Stream& s) {
  if (n == 0) return;
  bind();
  STRATA_CUDA_CHECK_STICKY(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToHost, as_cuda(s).get()));
}

void CudaDevice::fill_zero(void* dst, std::size_t n, Stream& s) {
  if (n == 0) return;
  bind();
  STRATA_CUDA_CHECK_STICKY(cudaMemsetAsync(dst, 0, n, as_cuda(s).get()));
}

Event CudaDevice::record_event(Stream& s) {
  bind();
  cudaEvent_t e = nullptr;
  if (!STRATA_CUDA_CHECK_STICKY(cudaEventCreateWithFlags(&e, kHostWaitedEvent))) {
    as_cuda(s).synchronize();  // no event: make "already complete" true
    return Event();
  }
  auto impl = std::make_shared<CudaEvent>(e, errors_);
  if (!STRATA_CUDA_CHECK_STICKY(cudaEventRecord(e, as_cuda(s).get()))) {
    as_cuda(s).synchronize();
    return Event();
  }
  return Event(std::move(impl));
}

void CudaDevice::wait_event(Stream& waiter, const Event& event) {
  bind();
  const Event::Impl* impl = event.impl();
  if (impl == nullptr) return;
  if (const auto* ce = dynamic_cast<const CudaEvent*>(impl)) {
    STRATA_CUDA_CHECK_STICKY(cudaStreamWaitEvent(as_cuda(waiter).get(), ce->event, 0));
    return;
  }
  event.synchronize();  // an event from elsewhere: the host waits instead
}

// ---- pinned host memory

// A huge-page mapping registered with CUDA (cudaHostRegister) rather than cudaHostAlloc's
// memory: the same kind of host memory as every other DMA buffer (sys/host_mapping.h), which
// io_uring can register too.
Result<PinnedBuffer> CudaDevice::allocate_pinned(std::size_t size_bytes, std::string_view what) {
  if (size_bytes == 0) return PinnedBuffer();
  const std::size_t rounded = align_up(size_bytes, kPageBytes);
  sys::HostMapping m;
  try {
    m = sys::HostMapping(size_bytes);
  } catch (const std::bad_alloc&) {
    return out_of_memory("cannot map " + format_bytes(rounded) + " of host memory for " +
                         std::string(what));
  }
  bind();
  const cudaError_t err = cudaHostRegister(m.data(), rounded, cudaHostRegisterPortable);
  if (err != cudaSuccess) {
    return STRATA_CUDA_STATUS(err).with_context("pinning " + format_bytes(rounded) +
                                                " of host memory for " + std::string(what));
  }
  return PinnedBuffer(this, m.release(), size_bytes, true);
}

Result<HostRegistration> CudaDevice::register_host(void* data, std::size_t size_bytes) {
  if (data == nullptr || size_bytes == 0) return HostRegistration();
  STRATA_CUDA_RETURN_IF_ERROR(cudaHostRegister(data, size_bytes, cudaHostRegisterPortable));
  return HostRegistration(this, data, size_bytes, true);
}

void CudaDevice::free_pinned_impl(void* data, std::size_t size_bytes, bool /*page_locked*/) {
  STRATA_CUDA_CHECK_STICKY(cudaHostUnregister(data));
  sys::HostMapping::unmap(data, size_bytes, /*locked=*/false);  // cudaHostUnregister unlocked it
}

void CudaDevice::unregister_host_impl(void* data, std::size_t /*size_bytes*/,
                                      bool /*page_locked*/) {
  STRATA_CUDA_CHECK_STICKY(cudaHostUnregister(data));
}

#undef STRATA_CUDA_CHECK_STICKY

}  // namespace strata::device::cuda
