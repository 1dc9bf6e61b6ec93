// The loss scaler's transitions against DeepSpeed's DynamicLossScaler, step by step: overflows
// skip and (after the hysteresis) halve, clean windows double, the floor is an error, and a
// saved state resumes the same sequence.
#include "strata/optim/loss_scaler.h"

#include <gtest/gtest.h>

#include <vector>

namespace strata::optim {
namespace {

// The scale after each of `overflows`' steps.
std::vector<double> scales(LossScaler& s, const std::vector<bool>& overflows) {
  std::vector<double> out;
  for (bool o : overflows) {
    EXPECT_TRUE(s.update(o).is_ok());
    out.push_back(s.scale());
  }
  return out;
}

TEST(LossScalerTest, AnOverflowHalvesOnceTheHysteresisIsUsedUp) {
  LossScalerConfig c;
  c.initial_scale_power = 4;  // 16
  c.loss_scale_window = 1000;
  c.hysteresis = 2;
  LossScaler s(c);
  EXPECT_TRUE(s.dynamic());
  EXPECT_EQ(s.scale(), 16.0);
  // The first overflow spends the hysteresis (the step is skipped, the scale stays), the second
  // halves, and so does every later one until a growth restores the hysteresis.
  EXPECT_EQ(scales(s, {true, true, false, true, true}), (std::vector<double>{16, 8, 8, 4, 2}));
  EXPECT_EQ(s.state().last_overflow, 4);
  EXPECT_EQ(s.state().iteration, 5);
}

TEST(LossScalerTest, AWindowOfCleanStepsDoublesAndRestoresTheHysteresis) {
  LossScalerConfig c;
  c.initial_scale_power = 3;  // 8
  c.loss_scale_window = 3;
  c.hysteresis = 2;
  LossScaler s(c);
  // No overflow yet: (iteration - (-1)) % 3 == 0 at iterations 2, 5: doubles there.
  EXPECT_EQ(scales(s, {false, false, false, false, false, false}),
            (std::vector<double>{8, 8, 16, 16, 16, 32}));
  // An overflow at iteration 6 spends the hysteresis; the window counts from it (no growth at
  // 7, 8); the overflow at 9 halves, as do the next ones: no growth came between to restore it.
  EXPECT_EQ(scales(s, {true, false, false, true, true, true}),
            (std::vector<double>{32, 32, 32, 16, 8, 4}));
  // A growth restores it: the overflow after one only spends it again.
  LossScaler t(c);
  EXPECT_EQ(scales(t, {true, false, false, false, true}), (std::vector<double>{8, 8, 8, 16, 16}));
  EXPECT_EQ(t.state().hysteresis_left, 1);
}

TEST(LossScalerTest, ConsecutiveHysteresisIsRestoredByEveryCleanStep) {
  LossScalerConfig c;
  c.initial_scale_power = 4;
  c.hysteresis = 2;
  c.consecutive_hysteresis = true;
  LossScaler s(c);
  // Overflows separated by clean steps never use the hysteresis up.
  EXPECT_EQ(scales(s, {true, false, true, false, true}), (std::vector<double>{16, 16, 16, 16, 16}));
  EXPECT_EQ(scales(s, {true}), (std::vector<double>{8}));
}

TEST(LossScalerTest, TheFloorIsAnErrorAndAStaticScaleNeverMoves) {
  LossScalerConfig c;
  c.initial_scale_power = 1;  // 2
  c.hysteresis = 1;
  c.min_loss_scale = 1;
  LossScaler s(c);
  ASSERT_TRUE(s.update(true).is_ok());
  EXPECT_EQ(s.scale(), 1.0);
  const Status floor = s.update(true);
  ASSERT_FALSE(floor.is_ok());
  EXPECT_NE(floor.message().find("min_loss_scale"), std::string::npos) << floor.message();

  LossScalerConfig fixed;
  fixed.loss_scale = 128;
  LossScaler f(fixed);
  EXPECT_FALSE(f.dynamic());
  EXPECT_EQ(scales(f, {true, true, true, false}), (std::vector<double>{128, 128, 128, 128}));
}

TEST(LossScalerTest, ASavedStateResumesTheSameSequenceAndBadOnesAreRefused) {
  LossScalerConfig c;
  c.initial_scale_power = 5;
  c.loss_scale_window = 2;
  const std::vector<bool> run = {false, true, true, false, false, true, false, false};
  LossScaler whole(c);
  const std::vector<double> want = scales(whole, run);
  LossScaler first(c);
  scales(first, {run.begin(), run.begin() + 4});
  LossScaler resumed(c);
  ASSERT_TRUE(resumed.restore(first.state()).is_ok());
  std::vector<double> got = scales(resumed, {run.begin() + 4, run.end()});
  EXPECT_EQ(got, std::vector<double>(want.begin() + 4, want.end()));

  LossScaler::State bad = first.state();
  bad.scale = -1;
  EXPECT_FALSE(resumed.restore(bad).is_ok());
  bad = first.state();
  bad.last_overflow = bad.iteration;
  EXPECT_FALSE(resumed.restore(bad).is_ok());
  bad = first.state();
  bad.hysteresis_left = 0;
  EXPECT_FALSE(resumed.restore(bad).is_ok());
}

}  // namespace
}  // namespace strata::optim
