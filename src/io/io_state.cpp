// IoHandle completion and request statistics.
#include "src/io/io_state.h"

#include <utility>

namespace strata::io {

void StatsTracker::begin(IoOp op) {
  std::lock_guard lock(mu_);
  PerOp& p = ops_[static_cast<int>(op)];
  if (p.in_flight++ == 0) p.busy_since_ns = now_ns();
}

void StatsTracker::end(IoOp op, std::uint64_t bytes, bool ok) {
  std::lock_guard lock(mu_);
  PerOp& p = ops_[static_cast<int>(op)];
  STRATA_CHECK(p.in_flight > 0, "request finished that never began");
  if (--p.in_flight == 0) p.busy_ns += now_ns() - p.busy_since_ns;
  p.bytes += bytes;
  p.requests += 1;
  if (!ok) errors_ += 1;
}

IoStats StatsTracker::snapshot() const {
  std::lock_guard lock(mu_);
  const std::int64_t now = now_ns();
  auto busy_s = [now](const PerOp& p) {
    const std::int64_t ns = p.busy_ns + (p.in_flight > 0 ? now - p.busy_since_ns : 0);
    return static_cast<double>(ns) * 1e-9;
  };
  const PerOp& r = ops_[static_cast<int>(IoOp::kRead)];
  const PerOp& w = ops_[static_cast<int>(IoOp::kWrite)];
  IoStats s;
  s.bytes_read = r.bytes;
  s.bytes_written = w.bytes;
  s.reads = r.requests;
  s.writes = w.requests;
  s.read_busy_s = busy_s(r);
  s.write_busy_s = busy_s(w);
  s.errors = errors_ + rejected_.load(std::memory_order_relaxed);
  return s;
}

IoHandle::State::State(IoOp op, std::uint32_t chunks, StatsTracker* tracker)
    : op_(op), tracker_(tracker), pending_(chunks) {
  STRATA_CHECK(chunks > 0, "a tracked request needs at least one chunk");
  if (tracker_ != nullptr) tracker_->begin(op_);
}

std::shared_ptr<IoHandle::State> IoHandle::State::finished(IoOp op, Status status) {
  auto state = std::make_shared<State>(op, 1, nullptr);
  state->finish_chunk(0, std::move(status));
  return state;
}

void IoHandle::State::finish_chunk(std::uint64_t bytes, Status status) {
  std::unique_lock lock(mu_);
  STRATA_CHECK(pending_ > 0, "more chunks finished than were submitted");
  bytes_ += bytes;
  if (!status.is_ok() && status_.is_ok()) status_ = std::move(status);
  if (--pending_ > 0) return;
  // The tracker is told before waiters wake, so stats() after wait() already counts this request.
  if (tracker_ != nullptr) tracker_->end(op_, bytes_, status_.is_ok());
  done_.store(true, std::memory_order_release);
  lock.unlock();
  cv_.notify_all();
}

Status IoHandle::State::wait() {
  std::unique_lock lock(mu_);
  cv_.wait(lock, [this] { return pending_ == 0; });
  return status_;
}

Status IoHandle::wait() {
  if (state_ == nullptr) return Status::ok();  // an empty handle has nothing to wait for
  return state_->wait();
}

bool IoHandle::done() const { return state_ == nullptr || state_->done(); }

}  // namespace strata::io
