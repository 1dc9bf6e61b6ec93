// io_uring engine: one or more rings, each driven by its own thread or by the threads that use
// it, with registered files and buffers, optional SQPOLL and batched submission.
#include "src/io/engine.h"
#include "src/io/errno_text.h"
#include "strata/build_config.h"

#if STRATA_HAVE_URING

#include <liburing.h>
#include <sys/eventfd.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <deque>
#include <functional>
#include <future>
#include <thread>
#include <utility>

#include "strata/core/logging.h"

namespace strata::io {
namespace {

// user_data of the eventfd read that lets callers wake a driver thread waiting on its ring.
constexpr std::uint64_t kWakeTag = ~std::uint64_t{0};
// The kernel refuses a single registered buffer above 1 GiB; larger ones are registered in
// pieces.
constexpr std::size_t kMaxFixedBufferBytes = std::size_t{1} << 30;
// How long an SQPOLL kernel thread spins without work before it sleeps.
constexpr unsigned kSqpollIdleMs = 50;

// The ring a driver thread owns (thread-driven rings), so a callback that submits from that
// thread does not wake its own driver; and whether this thread is inside a caller-driven pump,
// where it must not start driving another ring (its locks are not recursive).
thread_local const void* tls_driver_of = nullptr;
thread_local bool tls_in_pump = false;

// [addr, addr + size) is registered under `index` in a ring's buffer table.
struct FixedBuffer {
  std::uintptr_t addr = 0;
  std::size_t size = 0;
  int index = 0;
};

// One ring and the chunks it owns. Submitters hand chunks over through the locked backlog; only
// the thread driving the ring (its driver thread, or the caller holding drive_mu) touches the
// ring itself, its slots and its buffer table. Each ring keeps at most queue_depth chunks in the
// kernel and the rest in the backlog, so submitters never block on a full submission queue.
struct Ring {
  explicit Ring(int queue_depth) : slots(queue_depth) {
    free_slots.reserve(slots.size());
    for (int i = static_cast<int>(slots.size()) - 1; i >= 0; --i) free_slots.push_back(i);
  }

  // Shared with submitters, under mu.
  std::mutex mu;
  std::deque<IoChunk> backlog;
  std::vector<std::function<void()>> tasks;  // run by the driving thread (buffer registration)
  bool stop = false;
  int event_fd = -1;  // thread-driven: wakes the driver

  std::mutex drive_mu;  // caller-driven: held by the thread driving the ring
  std::atomic<int> in_kernel_shared{0};

  // Driving thread only.
  io_uring ring{};
  bool ring_ready = false;
  bool fixed_files = false;
  std::vector<ChunkRun> slots;  // chunks in the kernel or about to be
  std::vector<int> free_slots;
  std::deque<int> ready;  // slots that need an SQE (new chunks and resubmissions)
  int in_kernel = 0;
  bool wake_armed = false;
  std::uint64_t wake_value = 0;
  std::vector<FixedBuffer> fixed;  // sorted by address

  std::thread driver;
};

// Marks the current thread as driving a caller-driven ring.
class PumpScope {
 public:
  PumpScope() { tls_in_pump = true; }
  ~PumpScope() { tls_in_pump = false; }
  PumpScope(const PumpScope&) = delete;
  PumpScope& operator=(const PumpScope&) = delete;
};

class UringEngine final : public Engine, public CallerDriver {
 public:
  UringEngine(std::vector<EngineFile> files, const EngineOptions& options)
      : Engine(std::move(files), options),
        caller_driven_(options.caller_driven),
        sqpoll_(options.sqpoll),
        simulate_setup_failure_(options.faults.fail_uring_setup) {
    STRATA_CHECK(options.rings > 0, "an io_uring engine needs at least one ring", options.rings);
    for (int i = 0; i < options.rings; ++i) rings_.push_back(std::make_unique<Ring>(queue_depth_));
  }

  ~UringEngine() override {
    if (started_) drain();
    stop_rings();
    for (auto& r : rings_) {
      if (r->ring_ready) io_uring_queue_exit(&r->ring);  // caller-driven rings only by now
      if (r->event_fd >= 0) ::close(r->event_fd);
    }
  }

  std::string_view name() const override { return "io_uring"; }
  CallerDriver* caller_driver() override { return caller_driven_ ? this : nullptr; }

  std::string setup_warning() const override {
    std::lock_guard lock(setup_mu_);
    return setup_warning_;
  }

  // Creates every ring (on its driver thread, or here when caller-driven). Returns why io_uring
  // is unusable; then nothing is left running.
  Status start() {
    Status status;
    if (caller_driven_) {
      for (auto& r : rings_) {
        status = init_ring(*r);
        if (!status.is_ok()) break;
      }
    } else {
      std::vector<std::future<Status>> ready;
      for (auto& r : rings_) {
        r->event_fd = ::eventfd(0, EFD_CLOEXEC);
        if (r->event_fd < 0) {
          status = unavailable("eventfd failed: " + errno_text(errno));
          break;
        }
        std::promise<Status> promise;
        ready.push_back(promise.get_future());
        // The promise lives on the driver thread so it outlives its own set_value().
        r->driver = std::thread(
            [this, ring = r.get(), p = std::move(promise)]() mutable { drive(*ring, p); });
      }
      for (auto& f : ready) {
        Status s = f.get();
        if (status.is_ok() && !s.is_ok()) status = std::move(s);
      }
    }
    if (!status.is_ok()) {
      stop_rings();
      return status;
    }
    started_ = true;
    return Status::ok();
  }

  Status register_buffers(std::span<const std::span<std::byte>> buffers) override {
    std::vector<iovec> iov;
    std::vector<FixedBuffer> table;
    std::size_t total = 0;
    for (const std::span<std::byte>& b : buffers) {
      for (std::size_t off = 0; off < b.size(); off += kMaxFixedBufferBytes) {
        const std::size_t len = std::min(kMaxFixedBufferBytes, b.size() - off);
        iov.push_back({b.data() + off, len});
        table.push_back({reinterpret_cast<std::uintptr_t>(b.data() + off), len,
                         static_cast<int>(table.size())});
        total += len;
      }
    }
    std::sort(table.begin(), table.end(),
              [](const FixedBuffer& a, const FixedBuffer& b) { return a.addr < b.addr; });
    int err = 0;
    for (auto& r : rings_) {
      Ring* ring = r.get();
      const int rc = run_on_ring(*ring, [ring, &iov, &table] {
        if (!ring->fixed.empty()) io_uring_unregister_buffers(&ring->ring);
        ring->fixed.clear();
        if (iov.empty()) return 0;
        const int res =
            io_uring_register_buffers(&ring->ring, iov.data(), static_cast<unsigned>(iov.size()));
        if (res == 0) ring->fixed = table;
        return res;
      });
      if (rc < 0) {
        err = -rc;
        break;
      }
    }
    if (err == 0) return Status::ok();
    (void)register_buffers({});  // an empty table: every ring without fixed buffers
    return io_error("registering " + std::to_string(iov.size()) + " buffer(s) of " +
                    std::to_string(total) + " bytes with io_uring failed: " + errno_text(err) +
                    (err == ENOMEM || err == EPERM
                         ? " (pinned memory counts against RLIMIT_MEMLOCK; raise `ulimit -l`)"
                         : "") +
                    "; I/O continues without registered buffers");
  }

  // CallerDriver: one pass over every ring, then, if that did not satisfy the caller, a wait for
  // one completion on a ring that has chunks in the kernel.
  void progress(const std::function<bool()>& satisfied) override {
    STRATA_CHECK(!tls_in_pump, "an I/O callback waited on a request; callbacks must not wait");
    int progressed = 0;
    for (auto& r : rings_) {
      std::lock_guard lock(r->drive_mu);
      PumpScope scope;
      progressed += pump(*r, /*block=*/false);
    }
    if (!satisfied || progressed > 0 || satisfied()) return;
    const std::size_t n = rings_.size();
    const std::size_t first = next_wait_.fetch_add(1, std::memory_order_relaxed);
    for (std::size_t k = 0; k < n; ++k) {
      Ring& r = *rings_[(first + k) % n];
      if (r.in_kernel_shared.load(std::memory_order_acquire) == 0) continue;
      std::lock_guard lock(r.drive_mu);
      PumpScope scope;
      pump(r, /*block=*/true);
      return;
    }
  }

 protected:
  // Deals the chunks round-robin over the rings, one hand-over (and one wake-up) per ring.
  void enqueue(std::vector<IoChunk> chunks) override {
    const std::size_t n = rings_.size();
    const std::size_t first = next_ring_.fetch_add(chunks.size(), std::memory_order_relaxed);
    std::vector<bool> touched(n, false);
    for (std::size_t i = 0; i < chunks.size(); ++i) touched[(first + i) % n] = true;
    for (std::size_t k = 0; k < n; ++k) {
      if (!touched[k]) continue;
      Ring& r = *rings_[k];
      {
        std::lock_guard lock(r.mu);
        for (std::size_t i = (k + n - first % n) % n; i < chunks.size(); i += n) {
          r.backlog.push_back(std::move(chunks[i]));
        }
      }
      kick(r);
    }
  }

 private:
  // Gets newly queued chunks moving: wakes the ring's driver thread, or, caller-driven, submits
  // them now unless another thread is driving the ring (it will see them).
  void kick(Ring& r) {
    if (!caller_driven_) {
      if (tls_driver_of != &r) wake(r);  // a driver's own callbacks: it looks again anyway
      return;
    }
    if (tls_in_pump) return;  // the next progress() picks them up
    std::unique_lock lock(r.drive_mu, std::try_to_lock);
    if (!lock.owns_lock()) return;
    PumpScope scope;
    pump(r, /*block=*/false);
  }

  void wake(Ring& r) {
    const std::uint64_t one = 1;
    ssize_t n;
    do {
      n = ::write(r.event_fd, &one, sizeof(one));
    } while (n < 0 && errno == EINTR);
    // EAGAIN means the counter is saturated, so the driver is certain to wake anyway.
    STRATA_CHECK(n == sizeof(one) || errno == EAGAIN, "eventfd write failed", errno_text(errno));
  }

  // Runs fn on the thread that may touch the ring and returns its result.
  int run_on_ring(Ring& r, std::function<int()> fn) {
    if (caller_driven_) {
      std::lock_guard lock(r.drive_mu);
      return fn();
    }
    STRATA_CHECK(tls_driver_of != &r, "a ring's own driver thread cannot wait for its tasks");
    std::promise<int> done;
    std::future<int> result = done.get_future();
    {
      std::lock_guard lock(r.mu);
      r.tasks.push_back([&fn, &done] { done.set_value(fn()); });
    }
    wake(r);
    return result.get();
  }

  void stop_rings() {
    for (auto& r : rings_) {
      if (!r->driver.joinable()) continue;
      {
        std::lock_guard lock(r->mu);
        r->stop = true;
      }
      wake(*r);
      r->driver.join();
    }
  }

  Status init_ring(Ring& r) {
    if (simulate_setup_failure_) {
      return unavailable("io_uring_queue_init failed: " + errno_text(EPERM) +
                         " (simulated by FaultInjection::fail_uring_setup)");
    }
    const unsigned entries = static_cast<unsigned>(queue_depth_) + 1;  // + the wake read
    io_uring_params params{};
    if (sqpoll_) {
      params.flags = IORING_SETUP_SQPOLL;
      params.sq_thread_idle = kSqpollIdleMs;
    } else if (!caller_driven_) {
      // Only the driver thread submits; deferring task work to its own waits saves interrupts.
      params.flags = IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN;
    } else {
      params.flags = IORING_SETUP_COOP_TASKRUN;
    }
    int rc = io_uring_queue_init_params(entries, &r.ring, &params);
    if (rc < 0 && sqpoll_) {
      std::lock_guard lock(setup_mu_);
      if (setup_warning_.empty()) {
        setup_warning_ = "io_uring refused SQPOLL (" + errno_text(-rc) +
                         "); swap submits with system calls instead";
      }
    }
    if (rc == -EINVAL || (rc < 0 && sqpoll_)) {
      params = io_uring_params{};  // kernels before 6.1 do not know the flags above
      rc = io_uring_queue_init_params(entries, &r.ring, &params);
    }
    if (rc < 0) {
      return unavailable("io_uring_queue_init failed: " + errno_text(-rc) +
                         " (io_uring may be disabled by the kernel, the container's seccomp "
                         "profile or kernel.io_uring_disabled)");
    }
    r.ring_ready = true;
    std::vector<int> fds;
    for (const EngineFile& f : files_) fds.push_back(f.fd);
    // A table with empty slots (FileIo's) changes as files come and go: descriptors, not a
    // registered table.
    const bool complete = std::all_of(fds.begin(), fds.end(), [](int fd) { return fd >= 0; });
    rc = complete ? io_uring_register_files(&r.ring, fds.data(), static_cast<unsigned>(fds.size()))
                  : -EBADF;
    r.fixed_files = rc == 0;
    if (!r.fixed_files) {
      log_debug("io_uring: registering swap files failed (" + errno_text(-rc) +
                "); using plain descriptors");
    }
    return Status::ok();
  }

  // A driver thread: owns one ring from creation to exit.
  void drive(Ring& r, std::promise<Status>& ready) {
    Status status = init_ring(r);
    const bool ok = status.is_ok();
    ready.set_value(std::move(status));
    if (!ok) return;
    tls_driver_of = &r;
    for (;;) {
      std::vector<std::function<void()>> tasks;
      bool stopping;
      {
        std::lock_guard lock(r.mu);
        tasks.swap(r.tasks);
        take_backlog_locked(r);
        stopping = r.stop && r.backlog.empty();
      }
      for (auto& task : tasks) task();
      if (!r.wake_armed) r.wake_armed = arm_wake(r);
      const bool completed_here = prepare_ready(r);
      if (stopping && r.in_kernel == 0 && r.ready.empty()) break;
      if (completed_here) {
        // An injected failure finished or requeued a chunk without the kernel: its slot may
        // take backlog work now, so go round again instead of waiting on the ring.
        submit_and_reap(r, /*wait=*/false);
        continue;
      }
      submit_and_reap(r, /*wait=*/true);
    }
    io_uring_queue_exit(&r.ring);
    r.ring_ready = false;
  }

  // Caller-driven: submits what is queued and reaps what finished, refilling the ring while
  // completions free slots. With `block` and nothing finished yet, waits for one completion.
  // Returns how many chunks finished or were requeued.
  int pump(Ring& r, bool block) {
    int total = 0;
    for (;;) {
      std::vector<std::function<void()>> tasks;
      {
        std::lock_guard lock(r.mu);
        tasks.swap(r.tasks);
        take_backlog_locked(r);
      }
      for (auto& task : tasks) task();
      if (prepare_ready(r)) ++total;
      const int reaped = submit_and_reap(r, block && total == 0 && r.in_kernel > 0);
      total += reaped;
      if (reaped == 0) return total;
      block = false;
      std::lock_guard lock(r.mu);
      if (r.backlog.empty() && r.ready.empty()) return total;
    }
  }

  static void take_backlog_locked(Ring& r) {
    while (!r.backlog.empty() && !r.free_slots.empty()) {
      const int s = r.free_slots.back();
      r.free_slots.pop_back();
      r.slots[s] = ChunkRun{std::move(r.backlog.front())};
      r.backlog.pop_front();
      r.ready.push_back(s);
    }
  }

  static bool arm_wake(Ring& r) {
    io_uring_sqe* sqe = io_uring_get_sqe(&r.ring);
    if (sqe == nullptr) return false;  // the SQ is full; retried on the next round
    io_uring_prep_read(sqe, r.event_fd, &r.wake_value, sizeof(r.wake_value), 0);
    io_uring_sqe_set_data64(sqe, kWakeTag);
    return true;
  }

  // The index of the registered buffer holding [buf, buf + len), or -1.
  static int fixed_index(const Ring& r, const std::byte* buf, std::size_t len) {
    if (r.fixed.empty()) return -1;
    const auto addr = reinterpret_cast<std::uintptr_t>(buf);
    auto it = std::upper_bound(r.fixed.begin(), r.fixed.end(), addr,
                               [](std::uintptr_t a, const FixedBuffer& b) { return a < b.addr; });
    if (it == r.fixed.begin()) return -1;
    --it;
    return addr - it->addr + len <= it->size ? it->index : -1;
  }

  // Turns ready slots into SQEs while the SQ has room; the rest wait for the next round.
  // Returns whether an injected fault completed or requeued a chunk without an SQE.
  bool prepare_ready(Ring& r) {
    bool completed_here = false;
    while (!r.ready.empty() && io_uring_sq_space_left(&r.ring) > 0) {
      const int s = r.ready.front();
      r.ready.pop_front();
      ChunkRun& run = r.slots[s];
      const FaultDecision fault = before_attempt(run);
      if (fault.error != 0) {
        complete(r, s, -fault.error);
        completed_here = true;
        continue;
      }
      io_uring_sqe* sqe = io_uring_get_sqe(&r.ring);
      STRATA_CHECK(sqe != nullptr, "no SQE although the SQ had space");
      const int fd = r.fixed_files ? run.chunk.file : files_[run.chunk.file].fd;
      const auto len = static_cast<unsigned>(fault.size_bytes);
      const int buf_index = fixed_index(r, run.buf(), len);
      const bool read = run.chunk.op == IoOp::kRead;
      if (buf_index >= 0) {
        if (read) {
          io_uring_prep_read_fixed(sqe, fd, run.buf(), len, run.file_offset(), buf_index);
        } else {
          io_uring_prep_write_fixed(sqe, fd, run.buf(), len, run.file_offset(), buf_index);
        }
        count_fixed();
      } else if (read) {
        io_uring_prep_read(sqe, fd, run.buf(), len, run.file_offset());
      } else {
        io_uring_prep_write(sqe, fd, run.buf(), len, run.file_offset());
      }
      if (r.fixed_files) io_uring_sqe_set_flags(sqe, IOSQE_FIXED_FILE);
      io_uring_sqe_set_data64(sqe, static_cast<std::uint64_t>(s));
      ++r.in_kernel;
    }
    r.in_kernel_shared.store(r.in_kernel, std::memory_order_release);
    return completed_here;
  }

  static void check_submit(int rc) {
    // Anything but these means a malformed SQE or a broken ring, which is a bug here.
    STRATA_CHECK(rc >= 0 || rc == -EINTR || rc == -EAGAIN || rc == -EBUSY || rc == -ETIME,
                 "io_uring submit failed:", errno_text(-rc));
  }

  // Submits everything queued (one system call for all of it, none with SQPOLL unless the
  // poller sleeps) and, with `wait`, waits for at least one completion in the same call; then
  // handles every completion already posted. A kernel push-back (EAGAIN, EBUSY) leaves the
  // entries in the SQ for the next round. Returns the chunk completions handled.
  int submit_and_reap(Ring& r, bool wait) {
    int rc;
    if (wait) {
      rc = io_uring_submit_and_wait(&r.ring, 1);
    } else {
      do {
        rc = io_uring_submit(&r.ring);
      } while (rc == -EINTR);
    }
    check_submit(rc);
    if (wait && (rc == -EAGAIN || rc == -EBUSY)) {
      // The kernel will not take new entries until some complete: wait for completions only,
      // with a bound, since none of ours may be in the kernel yet.
      __kernel_timespec timeout{};
      timeout.tv_nsec = 1'000'000;
      io_uring_cqe* cqe = nullptr;
      rc = io_uring_wait_cqe_timeout(&r.ring, &cqe, &timeout);
      STRATA_CHECK(rc == 0 || rc == -ETIME || rc == -EINTR || rc == -EAGAIN || rc == -EBUSY,
                   "io_uring wait failed:", errno_text(-rc));
    }
    io_uring_cqe* cqe = nullptr;
    unsigned head;
    unsigned seen = 0;
    int completed = 0;
    io_uring_for_each_cqe(&r.ring, head, cqe) {
      ++seen;
      const std::uint64_t tag = io_uring_cqe_get_data64(cqe);
      if (tag == kWakeTag) {
        r.wake_armed = false;  // its result does not matter: any completion means "look again"
        continue;
      }
      --r.in_kernel;
      ++completed;
      complete(r, static_cast<int>(tag), cqe->res);
    }
    io_uring_cq_advance(&r.ring, seen);
    r.in_kernel_shared.store(r.in_kernel, std::memory_order_release);
    return completed;
  }

  void complete(Ring& r, int slot, std::int64_t res) {
    if (on_result(r.slots[slot], res) == Step::kResubmit) {
      r.ready.push_back(slot);
    } else {
      r.free_slots.push_back(slot);
    }
  }

  const bool caller_driven_;
  const bool sqpoll_;
  const bool simulate_setup_failure_;
  bool started_ = false;
  std::vector<std::unique_ptr<Ring>> rings_;
  std::atomic<std::size_t> next_ring_{0};
  std::atomic<std::size_t> next_wait_{0};
  mutable std::mutex setup_mu_;
  std::string setup_warning_;
};

}  // namespace

Result<std::unique_ptr<Engine>> make_uring_engine(std::vector<EngineFile> files,
                                                  const EngineOptions& options) {
  auto engine = std::make_unique<UringEngine>(std::move(files), options);
  STRATA_RETURN_IF_ERROR(engine->start());
  return std::unique_ptr<Engine>(std::move(engine));
}

}  // namespace strata::io

#else  // !STRATA_HAVE_URING

namespace strata::io {

Result<std::unique_ptr<Engine>> make_uring_engine(std::vector<EngineFile>, const EngineOptions&) {
  return unavailable(
      "this build has no io_uring support (configured with STRATA_URING=OFF or "
      "without liburing)");
}

}  // namespace strata::io

#endif  // STRATA_HAVE_URING
