// io_uring engine: one ring owned by one driver thread that submits, reaps and resubmits.
#include "src/io/engine.h"
#include "src/io/errno_text.h"
#include "strata/build_config.h"

#if STRATA_HAVE_URING

#include <liburing.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <deque>
#include <future>
#include <thread>
#include <utility>

#include "strata/core/logging.h"

namespace strata::io {
namespace {

// user_data of the eventfd read that lets callers wake the driver while it waits on the ring.
constexpr std::uint64_t kWakeTag = ~std::uint64_t{0};

// Callers hand chunks over through a locked backlog and an eventfd; only the driver thread
// touches the ring, which is what IORING_SETUP_SINGLE_ISSUER promises the kernel. The driver
// keeps at most queue_depth chunks in the kernel and the rest in the backlog, so callers never
// block on a full submission queue.
class UringEngine final : public Engine {
 public:
  UringEngine(std::vector<EngineFile> files, const EngineOptions& options)
      : Engine(std::move(files), options), slots_(queue_depth_) {}

  ~UringEngine() override {
    if (driver_.joinable()) {
      drain();
      {
        std::lock_guard lock(mu_);
        stop_ = true;
      }
      wake();
      driver_.join();
    }
    if (event_fd_ >= 0) ::close(event_fd_);
  }

  std::string_view name() const override { return "io_uring"; }

  // Creates the eventfd, then the ring on the driver thread. Returns why io_uring is unusable.
  Status start() {
    event_fd_ = ::eventfd(0, EFD_CLOEXEC);
    if (event_fd_ < 0) return unavailable("eventfd failed: " + errno_text(errno));
    std::promise<Status> ready;
    std::future<Status> ready_future = ready.get_future();
    // The promise lives on the driver thread so it outlives its own set_value().
    driver_ = std::thread([this, p = std::move(ready)]() mutable { run(p); });
    Status status = ready_future.get();
    if (!status.is_ok()) driver_.join();
    return status;
  }

 protected:
  void enqueue(std::vector<IoChunk> chunks) override {
    {
      std::lock_guard lock(mu_);
      for (IoChunk& c : chunks) backlog_.push_back(std::move(c));
    }
    wake();
  }

 private:
  void wake() {
    const std::uint64_t one = 1;
    ssize_t n;
    do {
      n = ::write(event_fd_, &one, sizeof(one));
    } while (n < 0 && errno == EINTR);
    // EAGAIN means the counter is saturated, so the driver is certain to wake anyway.
    STRATA_CHECK(n == sizeof(one) || errno == EAGAIN, "eventfd write failed", errno_text(errno));
  }

  Status init_ring() {
    const unsigned entries = static_cast<unsigned>(queue_depth_) + 1;  // + the wake read
    io_uring_params params{};
    // Only this thread submits; deferring task work to our own waits saves interrupts.
    params.flags = IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN;
    int rc = io_uring_queue_init_params(entries, &ring_, &params);
    if (rc == -EINVAL) {  // kernels before 6.1 do not know these flags
      params = io_uring_params{};
      rc = io_uring_queue_init_params(entries, &ring_, &params);
    }
    if (rc < 0) {
      return unavailable("io_uring_queue_init failed: " + errno_text(-rc) +
                         " (io_uring may be disabled by the kernel, the container's seccomp "
                         "profile or kernel.io_uring_disabled)");
    }
    std::vector<int> fds;
    for (const EngineFile& f : files_) fds.push_back(f.fd);
    rc = io_uring_register_files(&ring_, fds.data(), static_cast<unsigned>(fds.size()));
    fixed_files_ = rc == 0;
    if (!fixed_files_) {
      log_debug("io_uring: registering swap files failed (" + errno_text(-rc) +
                "); using plain descriptors");
    }
    return Status::ok();
  }

  void run(std::promise<Status>& ready) {
    Status status = init_ring();
    const bool ok = status.is_ok();
    ready.set_value(std::move(status));
    if (!ok) return;
    free_slots_.reserve(slots_.size());
    for (int i = static_cast<int>(slots_.size()) - 1; i >= 0; --i) free_slots_.push_back(i);
    loop();
    io_uring_queue_exit(&ring_);
  }

  void loop() {
    for (;;) {
      bool stopping;
      {
        std::lock_guard lock(mu_);
        while (!backlog_.empty() && !free_slots_.empty()) {
          const int s = free_slots_.back();
          free_slots_.pop_back();
          slots_[s] = ChunkRun{std::move(backlog_.front())};
          backlog_.pop_front();
          ready_.push_back(s);
        }
        stopping = stop_ && backlog_.empty();
      }
      if (!wake_armed_) wake_armed_ = arm_wake();
      const bool completed_here = prepare_ready();
      if (stopping && in_kernel_ == 0 && ready_.empty()) return;
      if (completed_here) {
        // An injected failure finished or requeued a chunk without the kernel: its slot may
        // take backlog work now, so go round again instead of waiting on the ring.
        submit();
        continue;
      }
      submit_and_reap();
    }
  }

  bool arm_wake() {
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
    if (sqe == nullptr) return false;  // the SQ is full; retried on the next round
    io_uring_prep_read(sqe, event_fd_, &wake_value_, sizeof(wake_value_), 0);
    io_uring_sqe_set_data64(sqe, kWakeTag);
    return true;
  }

  // Turns ready slots into SQEs while the SQ has room; the rest wait for the next round.
  // Returns whether an injected fault completed or requeued a chunk without an SQE.
  bool prepare_ready() {
    bool completed_here = false;
    while (!ready_.empty() && io_uring_sq_space_left(&ring_) > 0) {
      const int s = ready_.front();
      ready_.pop_front();
      ChunkRun& run = slots_[s];
      const FaultDecision fault = before_attempt(run);
      if (fault.error != 0) {
        complete(s, -fault.error);
        completed_here = true;
        continue;
      }
      io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
      STRATA_CHECK(sqe != nullptr, "no SQE although the SQ had space");
      const int fd = fixed_files_ ? run.chunk.file : files_[run.chunk.file].fd;
      const auto len = static_cast<unsigned>(fault.size_bytes);
      if (run.chunk.op == IoOp::kRead) {
        io_uring_prep_read(sqe, fd, run.buf(), len, run.file_offset());
      } else {
        io_uring_prep_write(sqe, fd, run.buf(), len, run.file_offset());
      }
      if (fixed_files_) io_uring_sqe_set_flags(sqe, IOSQE_FIXED_FILE);
      io_uring_sqe_set_data64(sqe, static_cast<std::uint64_t>(s));
      ++in_kernel_;
    }
    return completed_here;
  }

  // Submits what is queued without waiting. A kernel push-back (EAGAIN, EBUSY) leaves the
  // entries in the SQ for the next submit.
  void submit() {
    int rc;
    do {
      rc = io_uring_submit(&ring_);
    } while (rc == -EINTR);
    check_submit(rc);
  }

  static void check_submit(int rc) {
    // Anything but these means a malformed SQE or a broken ring, which is a bug here.
    STRATA_CHECK(rc >= 0 || rc == -EINTR || rc == -EAGAIN || rc == -EBUSY,
                 "io_uring submit failed:", errno_text(-rc));
  }

  // Submits everything queued and waits for at least one completion in a single system call,
  // then handles every completion already posted.
  void submit_and_reap() {
    int rc = io_uring_submit_and_wait(&ring_, 1);
    check_submit(rc);
    if (rc == -EAGAIN || rc == -EBUSY) {
      // The kernel will not take new entries until some complete: wait for completions only,
      // with a bound, since none of ours may be in the kernel yet.
      __kernel_timespec timeout{};
      timeout.tv_nsec = 1'000'000;
      io_uring_cqe* cqe = nullptr;
      rc = io_uring_wait_cqe_timeout(&ring_, &cqe, &timeout);
      STRATA_CHECK(rc == 0 || rc == -ETIME || rc == -EINTR || rc == -EAGAIN || rc == -EBUSY,
                   "io_uring wait failed:", errno_text(-rc));
    }
    io_uring_cqe* cqe = nullptr;
    unsigned head;
    unsigned seen = 0;
    io_uring_for_each_cqe(&ring_, head, cqe) {
      ++seen;
      const std::uint64_t tag = io_uring_cqe_get_data64(cqe);
      if (tag == kWakeTag) {
        wake_armed_ = false;  // its result does not matter: any completion means "look again"
        continue;
      }
      --in_kernel_;
      complete(static_cast<int>(tag), cqe->res);
    }
    io_uring_cq_advance(&ring_, seen);
  }

  void complete(int slot, std::int64_t res) {
    if (on_result(slots_[slot], res) == Step::kResubmit) {
      ready_.push_back(slot);
    } else {
      free_slots_.push_back(slot);
    }
  }

  // Shared with callers.
  std::mutex mu_;
  std::deque<IoChunk> backlog_;
  bool stop_ = false;
  int event_fd_ = -1;

  // Driver thread only.
  io_uring ring_{};
  bool fixed_files_ = false;
  std::vector<ChunkRun> slots_;  // chunks in the kernel or about to be
  std::vector<int> free_slots_;
  std::deque<int> ready_;  // slots that need an SQE (new chunks and resubmissions)
  int in_kernel_ = 0;
  bool wake_armed_ = false;
  std::uint64_t wake_value_ = 0;

  std::thread driver_;
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
