// Timeline: busy time is the union of a lane's spans, and the Chrome trace is valid trace-event
// JSON with one named row per lane.
#include "strata/mem/timeline.h"

#include <gtest/gtest.h>

#include "strata/core/file.h"
#include "strata/core/json.h"
#include "tests/testing/temp_dir.h"

namespace strata::mem {
namespace {

TEST(Timeline, BusyTimeIsTheUnionOfSpans) {
  Timeline t(false);
  const std::int64_t ms = 1'000'000;
  t.add(Lane::kNvmeRead, "a", 0, 10 * ms);
  t.add(Lane::kNvmeRead, "b", 5 * ms, 12 * ms);   // overlaps a
  t.add(Lane::kNvmeRead, "c", 20 * ms, 21 * ms);  // after a gap
  t.add(Lane::kHostToDevice, "d", 0, 3 * ms);
  const auto busy = t.busy_ms();
  EXPECT_DOUBLE_EQ(busy[static_cast<int>(Lane::kNvmeRead)], 13.0);
  EXPECT_DOUBLE_EQ(busy[static_cast<int>(Lane::kHostToDevice)], 3.0);
  EXPECT_EQ(t.num_spans(), 0u);  // not recording
}

TEST(Timeline, ChromeTraceHasOneRowPerLane) {
  Timeline t(true, /*max_spans=*/3);
  t.add(Lane::kCompute, "forward \"layer\" 0", 1000, 5000);
  t.add(Lane::kNvmeRead, "fetch layer 1", 2000, 9000, 4096);
  t.add(Lane::kCpuOptimizer, "optimizer step", 10000, 20000);
  t.add(Lane::kCompute, "dropped", 30000, 40000);
  EXPECT_EQ(t.num_spans(), 3u);
  EXPECT_EQ(t.dropped_spans(), 1u);
  testing::TempDir dir;
  const std::string path = dir.file("trace.json");
  ASSERT_TRUE(t.write_chrome_trace(path).is_ok());
  auto text = read_file(path);
  ASSERT_TRUE(text.is_ok());
  const Json j = Json::parse(*text);
  std::map<int, std::string> rows;
  int complete = 0;
  for (const Json& e : j["traceEvents"]) {
    if (e["ph"] == "M" && e["name"] == "thread_name") {
      rows[e["tid"].get<int>()] = e["args"]["name"].get<std::string>();
    }
    if (e["ph"] == "X") {
      ++complete;
      EXPECT_GE(e["dur"].get<double>(), 0.0);
    }
  }
  EXPECT_EQ(complete, 3);
  ASSERT_EQ(rows.size(), 6u);
  EXPECT_EQ(rows[0], "compute");
  EXPECT_EQ(rows[1], "h2d");
  EXPECT_EQ(rows[2], "d2h");
  EXPECT_EQ(rows[3], "nvme read");
  EXPECT_EQ(rows[4], "nvme write");
  EXPECT_EQ(rows[5], "cpu optimizer");
}

}  // namespace
}  // namespace strata::mem
