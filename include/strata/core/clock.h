// Monotonic clock helpers.
#pragma once

#include <chrono>
#include <cstdint>

namespace strata {

using Clock = std::chrono::steady_clock;

inline std::int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch())
      .count();
}

class Stopwatch {
 public:
  Stopwatch() : start_(Clock::now()) {}
  void reset() { start_ = Clock::now(); }
  double elapsed_s() const { return std::chrono::duration<double>(Clock::now() - start_).count(); }
  double elapsed_ms() const { return elapsed_s() * 1e3; }

 private:
  Clock::time_point start_;
};

}  // namespace strata
