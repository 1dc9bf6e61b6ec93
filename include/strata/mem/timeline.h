// Timeline: what each stream of the engine was doing and when. Busy time per stream always;
// individual spans only when recording (they become a Chrome trace, one row per stream).
#pragma once

#include <array>
#include <cstdint>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "strata/core/status.h"

namespace strata::mem {

// One row of the trace. kCompute is the thread that runs the model; the copy and I/O lanes are
// the tiered store's; kCpuOptimizer is the optimizer step.
enum class Lane : std::uint8_t {
  kCompute,
  kHostToDevice,
  kDeviceToHost,
  kNvmeRead,
  kNvmeWrite,
  kCpuOptimizer,
};
inline constexpr int kNumLanes = 6;
std::string_view lane_name(Lane lane);  // "compute", "h2d", "d2h", "nvme read", ...

struct Span {
  Lane lane = Lane::kCompute;
  std::string name;
  std::int64_t begin_ns = 0;  // now_ns() clock
  std::int64_t end_ns = 0;
  std::uint64_t bytes = 0;  // 0 for compute spans
};

class Timeline {
 public:
  // `record_spans`: keep every span (for write_chrome_trace), at most `max_spans` of them (the
  // rest are counted but dropped, so a long run cannot grow without bound).
  explicit Timeline(bool record_spans = false, std::size_t max_spans = 1'000'000);

  // Thread-safe. Busy time is the union of a lane's spans, assuming spans on one lane arrive in
  // roughly increasing begin order (true for ordered streams and for in-order completion lanes).
  void add(Lane lane, std::string_view name, std::int64_t begin_ns, std::int64_t end_ns,
           std::uint64_t bytes = 0);

  // Busy milliseconds of each lane since construction.
  std::array<double, kNumLanes> busy_ms() const;
  bool recording() const { return record_spans_; }
  std::size_t num_spans() const;
  std::size_t dropped_spans() const;
  std::vector<Span> spans() const;

  // JSON trace-event format ("X" complete events, one tid per lane, thread names as metadata),
  // readable by Perfetto and chrome://tracing. Times are microseconds since construction.
  Status write_chrome_trace(const std::string& path) const;

 private:
  const bool record_spans_;
  const std::size_t max_spans_;
  const std::int64_t origin_ns_;
  mutable std::mutex mu_;
  std::array<std::int64_t, kNumLanes> busy_ns_{};
  std::array<std::int64_t, kNumLanes> busy_until_ns_{};
  std::vector<Span> spans_;
  std::size_t dropped_ = 0;
};

}  // namespace strata::mem
