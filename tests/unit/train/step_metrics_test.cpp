// The progress line a person reads: the loss first, the run's elapsed time and what is left at
// the end; durations as a person writes them.
#include "strata/train/step_metrics.h"

#include <gtest/gtest.h>

namespace strata::train {
namespace {

TEST(StepMetricsTest, DurationsReadAsAPersonWritesThem) {
  EXPECT_EQ(format_duration(0), "0s");
  EXPECT_EQ(format_duration(42.4), "42s");
  EXPECT_EQ(format_duration(59.6), "1m00s");
  EXPECT_EQ(format_duration(723), "12m03s");
  EXPECT_EQ(format_duration(3600), "1h00m");
  EXPECT_EQ(format_duration(7530), "2h05m");
  EXPECT_EQ(format_duration(-3), "0s");
}

TEST(StepMetricsTest, TheProgressLineEndsWithElapsedTimeAndTheTimeLeft) {
  StepMetrics m;
  m.step = 3;
  m.loss = 2.5;
  m.elapsed_s = 125;
  m.eta_s = 4080;
  const std::string line = progress_line(m, 100);
  EXPECT_EQ(line.rfind("step 3/100 | loss 2.5000 | ", 0), 0u) << line;
  EXPECT_TRUE(line.ends_with(" | 2m05s elapsed, ETA 1h08m")) << line;
  // The last step has nothing left.
  m.step = 100;
  EXPECT_TRUE(progress_line(m, 100).ends_with(" | 2m05s elapsed")) << progress_line(m, 100);
  const Json j = m.to_json();
  EXPECT_EQ(j.at("elapsed_s"), 125.0);
  EXPECT_EQ(j.at("eta_s"), 4080.0);
}

}  // namespace
}  // namespace strata::train
