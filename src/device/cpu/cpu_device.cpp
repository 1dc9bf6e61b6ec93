// CpuDevice: budgeted host allocator, inline compute stream, worker-thread copy streams.
#include "src/device/cpu/cpu_device.h"

#include <sys/mman.h>

#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <new>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "strata/core/aligned.h"
#include "strata/core/check.h"
#include "strata/core/json.h"
#include "strata/sys/environment.h"
#include "strata/sys/host_mapping.h"

namespace strata::device {
namespace {

// A completion flag set when a stream reaches the point where the event was recorded.
struct CpuEvent final : Event::Impl {
  mutable std::mutex mu;
  mutable std::condition_variable cv;
  bool done = false;
  void signal() {
    std::lock_guard lock(mu);
    done = true;
    cv.notify_all();
  }
  bool query() const override {
    std::lock_guard lock(mu);
    return done;
  }
  void wait() const override {
    std::unique_lock lock(mu);
    cv.wait(lock, [&] { return done; });
  }
};

// The compute stream: work runs immediately on the calling thread, so it is always synchronized.
class InlineStream final : public Stream {
 public:
  StreamKind kind() const override { return StreamKind::kCompute; }
  void synchronize() override {}
};

// A copy stream: one worker thread runs tasks in submission order.
class WorkerStream final : public Stream {
 public:
  explicit WorkerStream(StreamKind kind) : kind_(kind), thread_([this] { run(); }) {}
  ~WorkerStream() override {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  StreamKind kind() const override { return kind_; }
  void enqueue(std::function<void()> task) {
    {
      std::lock_guard lock(mu_);
      tasks_.push_back(std::move(task));
      ++submitted_;
    }
    cv_.notify_all();
  }
  void synchronize() override {
    std::unique_lock lock(mu_);
    const std::uint64_t target = submitted_;
    idle_cv_.wait(lock, [&] { return completed_ >= target; });
  }

 private:
  void run() {
    std::unique_lock lock(mu_);
    for (;;) {
      cv_.wait(lock, [&] { return stop_ || !tasks_.empty(); });
      if (tasks_.empty()) return;
      auto task = std::move(tasks_.front());
      tasks_.pop_front();
      lock.unlock();
      task();
      lock.lock();
      ++completed_;
      idle_cv_.notify_all();
    }
  }

  StreamKind kind_;
  std::mutex mu_;
  std::condition_variable cv_, idle_cv_;
  std::deque<std::function<void()>> tasks_;
  std::uint64_t submitted_ = 0, completed_ = 0;
  bool stop_ = false;
  std::thread thread_;
};

class CpuDevice final : public Device {
 public:
  CpuDevice(const DeviceOptions& options, sys::SimdPath simd, cpu::CpuGemmChoice gemm)
      : name_("cpu/" + std::string(sys::simd_path_name(simd)) + gemm.name_suffix()),
        limit_(options.memory_limit_bytes),
        strict_(options.strict_host_memory || strict_from_environment()),
        ops_(profile_from_environment()
                 ? cpu::profiled_ops(make_cpu_ops(options.compute_threads, simd, gemm))
                 : make_cpu_ops(options.compute_threads, simd, gemm)),
        h2d_(StreamKind::kHostToDevice),
        d2h_(StreamKind::kDeviceToHost) {}
  ~CpuDevice() override {
    for (auto& [size, blocks] : kept_) {
      for (void* b : blocks) std::free(b);
    }
  }

  // "cpu/avx2": the backend and the SIMD path of its elementwise kernels; "+onednn" where its
  // GEMMs run on oneDNN ("+onednn-bf16", "+onednn-f32": those of one dtype).
  std::string name() const override { return name_; }
  bool host_addressable() const override { return true; }

  MemoryStats memory_stats() const override {
    std::lock_guard lock(mu_);
    return MemoryStats{limit_, in_use_, peak_, num_allocations_};
  }
  void reset_peak() override {
    std::lock_guard lock(mu_);
    peak_ = in_use_;
  }

  Stream& stream(StreamKind kind) override {
    switch (kind) {
      case StreamKind::kCompute:
      case StreamKind::kCollective:  // host collectives run on the calling thread
      case StreamKind::kTensorCollective:
        return compute_;
      case StreamKind::kHostToDevice:
        return h2d_;
      case StreamKind::kDeviceToHost:
        return d2h_;
    }
    return compute_;
  }

  void copy_to_device(void* dst, const void* src, std::size_t n, Stream& s) override {
    check_pinned(src, n, "copy_to_device from");
    run_on(s, [=] { std::memcpy(dst, src, n); });
  }
  void copy_to_host(void* dst, const void* src, std::size_t n, Stream& s) override {
    check_pinned(dst, n, "copy_to_host into");
    run_on(s, [=] { std::memcpy(dst, src, n); });
  }
  void fill_zero(void* dst, std::size_t n, Stream& s) override {
    run_on(s, [=] { std::memset(dst, 0, n); });
  }

  Event record_event(Stream& s) override {
    if (s.kind() == StreamKind::kCompute) return Event();  // inline: already reached
    auto ev = std::make_shared<CpuEvent>();
    static_cast<WorkerStream&>(s).enqueue([ev] { ev->signal(); });
    return Event(ev);
  }
  void wait_event(Stream& waiter, const Event& event) override {
    if (event.ready()) return;
    if (waiter.kind() == StreamKind::kCompute) {
      event.synchronize();
      return;
    }
    static_cast<WorkerStream&>(waiter).enqueue([event] { event.synchronize(); });
  }

  const Ops& ops() const override { return *ops_; }

  Result<PinnedBuffer> allocate_pinned(std::size_t size_bytes, std::string_view what) override {
    if (size_bytes == 0) return PinnedBuffer();
    sys::HostMapping m;
    try {
      m = sys::HostMapping(size_bytes);  // pre-faulted: first touch is slow here
    } catch (const std::bad_alloc&) {
      return out_of_memory("cannot map " + format_bytes(align_up(size_bytes, kPageBytes)) +
                           " of host memory for " + std::string(what));
    }
    // A refused lock (RLIMIT_MEMLOCK) only costs copy speed on this backend, so it is not an
    // error.
    const bool locked = m.lock();
    void* p = m.release();
    add_pinned(p, align_up(size_bytes, kPageBytes));
    return PinnedBuffer(this, p, size_bytes, locked);
  }

  Result<HostRegistration> register_host(void* data, std::size_t size_bytes) override {
    if (data == nullptr || size_bytes == 0) return HostRegistration();
    const bool locked = ::mlock(data, size_bytes) == 0;
    add_pinned(data, size_bytes);
    return HostRegistration(this, data, size_bytes, locked);
  }

 protected:
  void free_pinned_impl(void* data, std::size_t size_bytes, bool page_locked) override {
    remove_pinned(data);
    sys::HostMapping::unmap(data, size_bytes, page_locked);
  }
  void unregister_host_impl(void* data, std::size_t size_bytes, bool page_locked) override {
    remove_pinned(data);
    if (page_locked) ::munlock(data, size_bytes);
  }

  // Freed blocks are kept by size and handed out again for a request of the same size, as a GPU
  // framework's caching allocator does: a training step asks for the same buffers every
  // micro-batch, and a block taken from the C library afresh (mmap'ed above its threshold) costs
  // a page fault per 4 KiB on first touch. What is kept never takes the device's memory above
  // the most it ever had in use (high_water_): a fresh block first returns kept ones, the
  // largest first, until it fits under that.
  Result<void*> allocate_impl(std::size_t size_bytes) override {
    const std::size_t rounded = align_up(size_bytes, 64);
    std::lock_guard lock(mu_);
    if (limit_ != 0 && in_use_ + rounded > limit_) {
      return out_of_memory("request of " + format_bytes(rounded) + " exceeds the budget");
    }
    void* p = nullptr;
    if (auto it = kept_.find(rounded); it != kept_.end()) {
      p = it->second.back();
      it->second.pop_back();
      if (it->second.empty()) kept_.erase(it);
      kept_bytes_ -= rounded;
    } else {
      give_back_kept(std::max(high_water_, in_use_ + rounded) - in_use_ - rounded);
      p = std::aligned_alloc(64, rounded);
      if (p == nullptr && kept_bytes_ > 0) {  // the host is short: every kept block goes back
        give_back_kept(0);
        p = std::aligned_alloc(64, rounded);
      }
      if (p == nullptr) return out_of_memory("host allocation failed");
    }
    in_use_ += rounded;
    peak_ = std::max(peak_, in_use_);
    high_water_ = std::max(high_water_, in_use_);
    ++num_allocations_;
    return p;
  }
  void deallocate_impl(void* data, std::size_t size_bytes) override {
    const std::size_t rounded = align_up(size_bytes, 64);
    std::lock_guard lock(mu_);
    in_use_ -= rounded;
    if (kKeepFreedBlocks) {
      try {
        kept_[rounded].push_back(data);
        kept_bytes_ += rounded;
        return;
      } catch (const std::bad_alloc&) {  // no room to note it: freed instead
      }
    }
    std::free(data);
  }

 private:
  template <typename F>
  void run_on(Stream& s, F&& f) {
    if (s.kind() == StreamKind::kCompute) {
      f();
    } else {
      static_cast<WorkerStream&>(s).enqueue(std::forward<F>(f));
    }
  }

  // STRATA_OP_PROFILE=1: time every op (strata/device/op_profile.h), for benchmarks.
  static bool profile_from_environment() { return sys::knob_on(sys::Knob::kOpProfile); }
  static bool strict_from_environment() { return sys::knob_on(sys::Knob::kStrictHostMemory); }
  void add_pinned(void* p, std::size_t n) {
    std::lock_guard lock(mu_);
    pinned_[reinterpret_cast<std::uintptr_t>(p)] = n;
  }
  void remove_pinned(void* p) {
    std::lock_guard lock(mu_);
    pinned_.erase(reinterpret_cast<std::uintptr_t>(p));
  }
  // Strict mode: [p, p + n) must lie inside one pinned or registered range.
  void check_pinned(const void* p, std::size_t n, const char* what) const {
    if (!strict_ || n == 0) return;
    const auto a = reinterpret_cast<std::uintptr_t>(p);
    bool inside = false;
    {
      std::lock_guard lock(mu_);
      auto it = pinned_.upper_bound(a);
      if (it != pinned_.begin()) {
        --it;
        inside = a + n <= it->first + it->second;
      }
    }
    STRATA_CHECK(inside,
                 "strict_host_memory: a copy touches host memory that is neither from "
                 "allocate_pinned nor registered with register_host (on CUDA it would be "
                 "synchronous and slow)",
                 what, n, "bytes");
  }

  mutable std::mutex mu_;
  const std::string name_;
  std::uint64_t limit_;
  bool strict_;
  std::map<std::uintptr_t, std::size_t> pinned_;  // begin -> bytes, under mu_
  std::uint64_t in_use_ = 0, peak_ = 0, num_allocations_ = 0;
  // Freed blocks by size, kept for reuse (under mu_), and the most ever in use, which in use and
  // kept together never exceed. AddressSanitizer builds free every block, so that a use after
  // free is still caught.
#if defined(__SANITIZE_ADDRESS__)
  static constexpr bool kKeepFreedBlocks = false;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
  static constexpr bool kKeepFreedBlocks = false;
#else
  static constexpr bool kKeepFreedBlocks = true;
#endif
#else
  static constexpr bool kKeepFreedBlocks = true;
#endif
  std::map<std::size_t, std::vector<void*>> kept_;
  std::uint64_t kept_bytes_ = 0, high_water_ = 0;

  // Frees kept blocks, the largest first, until at most `keep` bytes are kept (under mu_).
  void give_back_kept(std::uint64_t keep) {
    while (kept_bytes_ > keep) {
      auto largest = std::prev(kept_.end());
      std::free(largest->second.back());
      largest->second.pop_back();
      kept_bytes_ -= largest->first;
      if (largest->second.empty()) kept_.erase(largest);
    }
  }
  std::unique_ptr<Ops> ops_;
  InlineStream compute_;
  WorkerStream h2d_, d2h_;
};

}  // namespace

Result<std::unique_ptr<Device>> make_cpu_device(const DeviceOptions& options) {
  // The SIMD path of the elementwise kernels: STRATA_SIMD, else the widest this CPU allows.
  STRATA_ASSIGN_OR_RETURN(sys::SimdPath simd, sys::resolve_simd_path("auto", "SIMD path"));
  // The GEMMs' libraries: STRATA_CPU_GEMM, else oneDNN where it is faster on this CPU.
  STRATA_ASSIGN_OR_RETURN(cpu::CpuGemmChoice gemm, cpu::resolve_cpu_gemm());
  return std::unique_ptr<Device>(std::make_unique<CpuDevice>(options, simd, gemm));
}

}  // namespace strata::device
