// Completion state behind an IoHandle, and the swap space's request statistics.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>

#include "strata/core/clock.h"
#include "strata/io/swap.h"

namespace strata::io {

// Counts whole requests (one read() or write() each) and the wall time with at least one request
// of a kind in flight. Thread-safe; must outlive every request it tracks.
class StatsTracker {
 public:
  void begin(IoOp op);
  void end(IoOp op, std::uint64_t bytes, bool ok);
  void count_rejected() { rejected_.fetch_add(1, std::memory_order_relaxed); }
  void count_verified(std::uint64_t bytes, bool ok);
  IoStats snapshot() const;  // engine-level fields are left zero

 private:
  struct PerOp {
    std::uint64_t bytes = 0;
    std::uint64_t requests = 0;
    int in_flight = 0;
    std::int64_t busy_since_ns = 0;
    std::int64_t busy_ns = 0;
  };
  mutable std::mutex mu_;
  PerOp ops_[2];
  std::uint64_t errors_ = 0;
  std::atomic<std::uint64_t> rejected_{0};
  std::atomic<std::uint64_t> verified_bytes_{0};
  std::atomic<std::uint64_t> checksum_errors_{0};
};

// An engine whose rings are driven by the threads that use them (caller-driven io_uring):
// waiting on a handle must make progress itself, since no other thread will.
class CallerDriver {
 public:
  virtual ~CallerDriver() = default;
  // Submits queued chunks and reaps finished ones. With a `satisfied` test, and when that pass
  // left it false, then waits for at least one more completion.
  virtual void progress(const std::function<bool()>& satisfied) = 0;
};

// A request split into `pending` chunks; the last chunk to finish runs the finisher and the
// callback, then wakes the waiters. Chunks keep the state alive through shared_ptr, so dropping
// an IoHandle early is safe.
struct IoHandle::State {
  // Runs once on the thread that finished the last chunk, before the callback: may turn a
  // successful status into an error (a failed checksum) or record a failure (a failed write).
  using Finisher = std::function<Status(const Status& status)>;

  State(IoOp op, std::uint32_t chunks, StatsTracker* tracker, CallerDriver* driver = nullptr);
  // A request that failed validation, or an empty one: done from the start, never tracked.
  // The callback, if any, runs before this returns.
  static std::shared_ptr<State> finished(IoOp op, Status status, const IoCallback& callback = {});

  // Set before the chunks are submitted.
  void set_finisher(Finisher f) { finisher_ = std::move(f); }
  void set_callback(IoCallback cb) { callback_ = std::move(cb); }

  // Called once per chunk from engine threads. Keeps the first error.
  void finish_chunk(std::uint64_t bytes, Status status);

  Status wait();
  bool poll();
  bool done() const { return done_.load(std::memory_order_acquire); }
  IoOp op() const { return op_; }
  std::uint64_t bytes() const;
  double elapsed_s() const;

 private:
  const IoOp op_;
  StatsTracker* const tracker_;  // null for finished() states
  CallerDriver* const driver_;   // null unless the engine is caller-driven
  const std::int64_t start_ns_;
  Finisher finisher_;
  IoCallback callback_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::uint32_t pending_;
  std::uint64_t bytes_ = 0;
  std::int64_t end_ns_ = 0;
  Status status_;
  std::atomic<bool> done_{false};
};

}  // namespace strata::io
