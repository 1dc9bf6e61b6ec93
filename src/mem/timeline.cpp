// Timeline: per-lane busy time, recorded spans and the Chrome trace writer.
#include "strata/mem/timeline.h"

#include <algorithm>
#include <cstdio>

#include "strata/core/clock.h"
#include "strata/core/file.h"
#include "strata/core/json.h"

namespace strata::mem {

std::string_view lane_name(Lane lane) {
  switch (lane) {
    case Lane::kCompute:
      return "compute";
    case Lane::kHostToDevice:
      return "h2d";
    case Lane::kDeviceToHost:
      return "d2h";
    case Lane::kNvmeRead:
      return "nvme read";
    case Lane::kNvmeWrite:
      return "nvme write";
    case Lane::kCpuOptimizer:
      return "cpu optimizer";
  }
  return "?";
}

Timeline::Timeline(bool record_spans, std::size_t max_spans)
    : record_spans_(record_spans), max_spans_(max_spans), origin_ns_(now_ns()) {}

void Timeline::add(Lane lane, std::string_view name, std::int64_t begin_ns, std::int64_t end_ns,
                   std::uint64_t bytes) {
  if (end_ns < begin_ns) end_ns = begin_ns;
  const auto i = static_cast<std::size_t>(lane);
  std::lock_guard lock(mu_);
  const std::int64_t from = std::max(begin_ns, busy_until_ns_[i]);
  if (end_ns > from) busy_ns_[i] += end_ns - from;
  busy_until_ns_[i] = std::max(busy_until_ns_[i], end_ns);
  if (!record_spans_) return;
  if (spans_.size() >= max_spans_) {
    ++dropped_;
    return;
  }
  spans_.push_back(Span{lane, std::string(name), begin_ns, end_ns, bytes});
}

std::array<double, kNumLanes> Timeline::busy_ms() const {
  std::lock_guard lock(mu_);
  std::array<double, kNumLanes> out{};
  for (int i = 0; i < kNumLanes; ++i) out[static_cast<std::size_t>(i)] = busy_ns_[i] * 1e-6;
  return out;
}

std::size_t Timeline::num_spans() const {
  std::lock_guard lock(mu_);
  return spans_.size();
}

std::size_t Timeline::dropped_spans() const {
  std::lock_guard lock(mu_);
  return dropped_;
}

std::vector<Span> Timeline::spans() const {
  std::lock_guard lock(mu_);
  return spans_;
}

Status Timeline::write_chrome_trace(const std::string& path) const {
  std::vector<Span> spans = this->spans();
  std::sort(spans.begin(), spans.end(),
            [](const Span& a, const Span& b) { return a.begin_ns < b.begin_ns; });
  // Streamed by hand: a long run has many spans and one Json tree of them would double the memory.
  // otherData's clock_origin_ns: where ts 0 is on the machine's monotonic clock, so the traces of
  // several ranks on one machine line up.
  std::string out = "{\"displayTimeUnit\":\"ms\",\"otherData\":{\"clock_origin_ns\":" +
                    std::to_string(origin_ns_) + "},\"traceEvents\":[\n";
  auto us = [this](std::int64_t ns) { return static_cast<double>(ns - origin_ns_) * 1e-3; };
  char buf[160];
  bool first = true;
  auto sep = [&] {
    if (!first) out += ",\n";
    first = false;
  };
  sep();
  out += R"({"name":"process_name","ph":"M","pid":1,"tid":0,"args":{"name":"strata"}})";
  for (int i = 0; i < kNumLanes; ++i) {
    sep();
    const Json name = std::string(lane_name(static_cast<Lane>(i)));
    std::snprintf(buf, sizeof(buf), R"({"name":"thread_name","ph":"M","pid":1,"tid":%d,"args":)",
                  i);
    out += buf;
    out += Json{{"name", name}}.dump() + "}";
    sep();
    std::snprintf(
        buf, sizeof(buf),
        R"({"name":"thread_sort_index","ph":"M","pid":1,"tid":%d,"args":{"sort_index":%d}})", i, i);
    out += buf;
  }
  for (const Span& s : spans) {
    sep();
    out += "{\"name\":" + Json(s.name).dump();
    std::snprintf(buf, sizeof(buf), R"(,"ph":"X","pid":1,"tid":%d,"ts":%.3f,"dur":%.3f)",
                  static_cast<int>(s.lane), us(s.begin_ns),
                  static_cast<double>(s.end_ns - s.begin_ns) * 1e-3);
    out += buf;
    if (s.bytes > 0) {
      std::snprintf(buf, sizeof(buf), R"(,"args":{"bytes":%llu})",
                    static_cast<unsigned long long>(s.bytes));
      out += buf;
    }
    out += "}";
  }
  out += "\n]}\n";
  return write_file_atomic(path, out).with_context("writing the Chrome trace " + path);
}

}  // namespace strata::mem
