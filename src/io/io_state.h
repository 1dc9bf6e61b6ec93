// Completion state behind an IoHandle, and the swap space's request statistics.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>

#include "strata/core/clock.h"
#include "strata/io/swap.h"

namespace strata::io {

enum class IoOp : std::uint8_t { kRead, kWrite };

// Counts whole requests (one read() or write() each) and the wall time with at least one request
// of a kind in flight. Thread-safe; must outlive every request it tracks.
class StatsTracker {
 public:
  void begin(IoOp op);
  void end(IoOp op, std::uint64_t bytes, bool ok);
  void count_rejected() { rejected_.fetch_add(1, std::memory_order_relaxed); }
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
};

// A request split into `pending` chunks; the last chunk to finish wakes the waiters. Chunks keep
// the state alive through shared_ptr, so dropping an IoHandle early is safe.
struct IoHandle::State {
  State(IoOp op, std::uint32_t chunks, StatsTracker* tracker);
  // A request that failed validation, or an empty one: done from the start, never tracked.
  static std::shared_ptr<State> finished(IoOp op, Status status);

  // Called once per chunk from engine threads. Keeps the first error.
  void finish_chunk(std::uint64_t bytes, Status status);

  Status wait();
  bool done() const { return done_.load(std::memory_order_acquire); }
  IoOp op() const { return op_; }

 private:
  const IoOp op_;
  StatsTracker* const tracker_;  // null for finished() states
  std::mutex mu_;
  std::condition_variable cv_;
  std::uint32_t pending_;
  std::uint64_t bytes_ = 0;
  Status status_;
  std::atomic<bool> done_{false};
};

}  // namespace strata::io
