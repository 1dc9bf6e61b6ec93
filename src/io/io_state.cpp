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

void StatsTracker::count_verified(std::uint64_t bytes, bool ok) {
  verified_bytes_.fetch_add(bytes, std::memory_order_relaxed);
  if (!ok) checksum_errors_.fetch_add(1, std::memory_order_relaxed);
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
  s.verified_bytes = verified_bytes_.load(std::memory_order_relaxed);
  s.checksum_errors = checksum_errors_.load(std::memory_order_relaxed);
  return s;
}

IoHandle::State::State(IoOp op, std::uint32_t chunks, StatsTracker* tracker, CallerDriver* driver)
    : op_(op), tracker_(tracker), driver_(driver), start_ns_(now_ns()), pending_(chunks) {
  STRATA_CHECK(chunks > 0, "a tracked request needs at least one chunk");
  if (tracker_ != nullptr) tracker_->begin(op_);
}

std::shared_ptr<IoHandle::State> IoHandle::State::finished(IoOp op, Status status,
                                                           const IoCallback& callback) {
  auto state = std::make_shared<State>(op, 1, nullptr);
  state->callback_ = callback;
  state->finish_chunk(0, std::move(status));
  return state;
}

void IoHandle::State::finish_chunk(std::uint64_t bytes, Status status) {
  {
    std::lock_guard lock(mu_);
    STRATA_CHECK(pending_ > 0, "more chunks finished than were submitted");
    bytes_ += bytes;
    if (!status.is_ok() && status_.is_ok()) status_ = std::move(status);
    if (--pending_ > 0) return;
  }
  // The last chunk: nobody else touches status_ until done_ is set, so the finisher and the
  // callback run without the lock (a callback may submit more requests).
  if (finisher_) status_ = finisher_(status_);
  end_ns_ = now_ns();
  // The tracker is told before waiters wake, so stats() after wait() already counts this request.
  if (tracker_ != nullptr) tracker_->end(op_, bytes_, status_.is_ok());
  if (callback_) {
    callback_(IoCompletion{op_, status_, bytes_, static_cast<double>(end_ns_ - start_ns_) * 1e-9});
  }
  {
    std::lock_guard lock(mu_);
    done_.store(true, std::memory_order_release);
  }
  cv_.notify_all();
}

Status IoHandle::State::wait() {
  if (driver_ != nullptr) {
    const std::function<bool()> finished = [this] { return done(); };
    while (!done()) driver_->progress(finished);
  }
  std::unique_lock lock(mu_);
  cv_.wait(lock, [this] { return done(); });
  return status_;
}

bool IoHandle::State::poll() {
  if (driver_ != nullptr && !done()) driver_->progress({});
  return done();
}

std::uint64_t IoHandle::State::bytes() const {
  if (!done()) return 0;
  std::lock_guard lock(mu_);
  return bytes_;
}

double IoHandle::State::elapsed_s() const {
  if (!done()) return 0;
  std::lock_guard lock(mu_);
  return static_cast<double>(end_ns_ - start_ns_) * 1e-9;
}

Status IoHandle::wait() {
  if (state_ == nullptr) return Status::ok();  // an empty handle has nothing to wait for
  return state_->wait();
}

bool IoHandle::poll() { return state_ == nullptr || state_->poll(); }

bool IoHandle::done() const { return state_ == nullptr || state_->done(); }

std::uint64_t IoHandle::bytes() const { return state_ == nullptr ? 0 : state_->bytes(); }

double IoHandle::elapsed_s() const { return state_ == nullptr ? 0 : state_->elapsed_s(); }

}  // namespace strata::io
