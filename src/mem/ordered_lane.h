// OrderedLane: one thread that runs jobs in submission order. The tiered store gives each kind
// of transfer (NVMe read, NVMe write, host->device, device->host) a lane whose jobs block on one
// completion (an IoHandle, a device Event) and then advance the transfer, so completions of one
// kind are observed in the order they were issued, without polling.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

namespace strata::mem::detail {

class OrderedLane {
 public:
  OrderedLane() : thread_([this] { run(); }) {}
  // Runs every job already queued, then stops.
  ~OrderedLane() {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  OrderedLane(const OrderedLane&) = delete;
  OrderedLane& operator=(const OrderedLane&) = delete;

  void push(std::function<void()> job) {
    {
      std::lock_guard lock(mu_);
      jobs_.push_back(std::move(job));
    }
    cv_.notify_one();
  }

 private:
  void run() {
    std::unique_lock lock(mu_);
    for (;;) {
      cv_.wait(lock, [&] { return stop_ || !jobs_.empty(); });
      if (jobs_.empty()) return;
      std::function<void()> job = std::move(jobs_.front());
      jobs_.pop_front();
      lock.unlock();
      job();
      lock.lock();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> jobs_;
  bool stop_ = false;
  std::thread thread_;  // last: starts after the members it uses exist
};

}  // namespace strata::mem::detail
