// ScheduleChooser: which optimizer schedule runs, from the step cycles fed to it.
#include "strata/zero/schedule_chooser.h"

#include <gtest/gtest.h>

#include <vector>

namespace strata::zero {
namespace {

constexpr std::int64_t kMs = 1'000'000;

// Feeds one cycle per step: `cost(schedule)` ms for whichever schedule the chooser runs, and
// returns the schedule of each step.
template <typename Cost>
std::vector<OptimizerOverlap> run(ScheduleChooser& c, int steps, Cost cost, std::int64_t& now) {
  std::vector<OptimizerOverlap> out;
  for (int i = 0; i < steps; ++i) {
    now += cost(c.current()) * kMs;
    c.step_began(now);
    out.push_back(c.current());
  }
  return out;
}

constexpr auto kB = OptimizerOverlap::kBackward;
constexpr auto kN = OptimizerOverlap::kNone;

// Cycles of `serial_ms` under the serial schedule and `overlapped_ms` under the other.
auto costs(std::int64_t serial_ms, std::int64_t overlapped_ms) {
  return [=](OptimizerOverlap s) { return s == kN ? serial_ms : overlapped_ms; };
}

ScheduleChooserOptions options(int samples, std::int64_t hold_steps) {
  ScheduleChooserOptions o;
  o.samples = samples;
  o.hold_steps = hold_steps;
  return o;
}

TEST(ScheduleChooserTest, TakesTheSerialScheduleWhenItIsClearlyFaster) {
  ScheduleChooser c(kB, options(3, 10));
  std::int64_t now = 0;
  const auto serial_cheaper = costs(80, 100);
  // Step 1 opens the first cycle, step 2 closes it uncounted; steps 3-5 count three overlapped
  // cycles, then the serial one is probed: one cycle uncounted (step 6), three counted (7-9).
  const auto got = run(c, 9, serial_cheaper, now);
  const std::vector<OptimizerOverlap> want = {kB, kB, kB, kB, kN, kN, kN, kN, kN};
  EXPECT_EQ(got, want);
  EXPECT_EQ(c.probes(), 1);
  EXPECT_EQ(c.switches(), 1);
  // Held for ten counted cycles, then the overlapped schedule is probed again and loses.
  const auto later = run(c, 16, serial_cheaper, now);
  EXPECT_EQ(later[8], kN);
  EXPECT_EQ(later[9], kB) << "probe after the hold";
  EXPECT_EQ(later.back(), kN) << "the probe lost";
  EXPECT_EQ(c.probes(), 2);
  EXPECT_EQ(c.switches(), 1);
}

TEST(ScheduleChooserTest, KeepsTheOverlappedScheduleWithinTheMargin) {
  ScheduleChooserOptions o = options(1, 3);
  o.margin = 0.05;
  ScheduleChooser c(OptimizerOverlap::kForward, o);
  std::int64_t now = 0;
  // Serial 3% faster: within the margin, so the overlapped schedule stays after every probe.
  const auto got = run(c, 30, costs(97, 100), now);
  EXPECT_EQ(got.back(), OptimizerOverlap::kForward);
  EXPECT_GE(c.probes(), 3);
  EXPECT_EQ(c.switches(), 0);
}

TEST(ScheduleChooserTest, FollowsAChangeOfTheMachine) {
  ScheduleChooser c(kB, options(1, 2));
  std::int64_t now = 0;
  run(c, 5, costs(50, 100), now);
  EXPECT_EQ(c.current(), kN);
  // Now the overlapped schedule is the faster: the next probe takes it back.
  const auto got = run(c, 5, costs(100, 50), now);
  EXPECT_EQ(got.back(), kB);
  EXPECT_EQ(c.switches(), 2);
}

TEST(ScheduleChooserTest, TheCycleOfASwitchIsNotCounted) {
  ScheduleChooser c(kB, options(1, 2));
  std::int64_t now = 0;
  run(c, 3, costs(100, 100), now);  // the probe of the serial schedule begins at step 3
  ASSERT_EQ(c.current(), kN);
  // The cycle in which the schedule changed is huge (half of each, and a checkpoint, say): it
  // must not count against the serial schedule, whose next cycle is cheap.
  now += 10'000 * kMs;
  c.step_began(now);
  now += 50 * kMs;
  c.step_began(now);
  EXPECT_EQ(c.current(), kN);
  EXPECT_EQ(c.switches(), 1);
}

}  // namespace
}  // namespace strata::zero
