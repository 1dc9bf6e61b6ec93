// fp16 training with a dynamic loss scale: overflows skip steps alike under every schedule and
// on every rank, and a resume restores the scale.

#include "tests/integration/train_runs.h"

namespace strata::train {
namespace {

// fp16 with a dynamic loss scale that starts too high: the first steps overflow and are
// skipped, each halving the scale (hysteresis 1), and after two clean steps (the window) it
// doubles and may overflow again; each step's scale is what optim::LossScaler gives for the
// run's own skips, and every optimizer schedule gives the serial step's bits (a guessed step
// that overflows is rolled back; one that holds runs on with the unscaling multiplier).
TEST(Fp16Training, TheLossScaleFollowsTheOverflowsUnderEverySchedule) {
  TempDir dir;
  Json j = tiny_config(dir);
  j["precision"] = "fp16";
  j["fp16"] = {{"initial_scale_power", 20}, {"hysteresis", 1}, {"loss_scale_window", 2}};
  j["max_steps"] = 10;
  j["grad_clip"] = 0.0;  // a step that does not overflow holds its guess
  j["offload_optimizer"] = "cpu";
  const Schedules r = run_schedules(j, dir);
  ASSERT_EQ(r.serial.scales.size(), 10u);
  expect_same_bits(r.forward, r.serial);
  expect_same_bits(r.backward, r.serial);
  optim::LossScalerConfig lc;
  lc.initial_scale_power = 20;
  lc.hysteresis = 1;
  lc.loss_scale_window = 2;
  const int skipped =
      testing::expect_scales_follow_overflows(lc, r.serial.scales, r.serial.skipped);
  EXPECT_GT(skipped, 0) << "no step overflowed: raise initial_scale_power";
  EXPECT_LT(skipped, 10) << "every step overflowed: lower initial_scale_power";
  EXPECT_GT(r.backward.rolled_back, 0) << "no guessed step overflowed";
  EXPECT_GT(r.backward.guessed, r.backward.rolled_back) << "no guess held";
}

// An overflow on one rank's gradients (injected: its loss gradient times infinity) skips the
// step, lowers the scale once the hysteresis is spent, and leaves the weights as they were:
// the run goes on exactly as one whose scaler met that overflow.
TEST(Fp16Training, AnInjectedOverflowSkipsTheStepAndLowersTheScale) {
  TempDir dir;
  Json j = tiny_config(dir);
  j["precision"] = "fp16";
  j["fp16"] = {{"initial_scale_power", 8}, {"hysteresis", 2}};
  j["save_dir"] = "";
  j["max_steps"] = 5;
  auto config = parse_train_config(j, "test config");
  ASSERT_TRUE(config.is_ok()) << config.status().message();
  TrainOptions o;
  o.overflow_at = [](int, std::int64_t step) { return step == 2 || step == 4; };
  auto t = Trainer::create(*config, o);
  ASSERT_TRUE(t.is_ok()) << t.status().message();
  ASSERT_TRUE((*t)->run().is_ok());
  const auto& h = (*t)->history();
  ASSERT_EQ(h.size(), 5u);
  const bool want_skipped[] = {false, true, false, true, false};
  // The first overflow spends the hysteresis, the second halves.
  const double want_scale[] = {256, 256, 256, 256, 128};
  for (std::size_t i = 0; i < h.size(); ++i) {
    SCOPED_TRACE("step " + std::to_string(i + 1));
    EXPECT_EQ(h[i].skipped, want_skipped[i]);
    EXPECT_EQ(h[i].loss_scale.value_or(0), want_scale[i]);
    EXPECT_FALSE(std::isfinite(h[i].grad_norm) && want_skipped[i]);
  }
}

// Two ranks, the overflow on rank 1 only: both skip the step (the norm is summed over every
// rank), and both lower the scale alike.
TEST(Fp16Training, AnOverflowOnOneRankSkipsTheStepOnEveryRank) {
  TempDir dir;
  Json j = testing::config(dir, "fp16");
  j["precision"] = "fp16";
  j["fp16"] = {{"initial_scale_power", 8}, {"hysteresis", 1}};
  j["max_steps"] = 3;
  j["metrics_file"] = dir.file("fp16/metrics-{rank}.jsonl");
  ASSERT_EQ(testing::run_train(dir, j, "fp16", 2, "--inject-fault overflow:1:2"), 0)
      << std::ifstream(dir.file("fp16/err.txt")).rdbuf();
  for (const char* rank : {"0", "1"}) {
    SCOPED_TRACE(std::string("rank ") + rank);
    std::ifstream in(dir.file(std::string("fp16/metrics-") + rank + ".jsonl"));
    std::vector<Json> steps;
    for (std::string line; std::getline(in, line);) steps.push_back(Json::parse(line));
    ASSERT_EQ(steps.size(), 3u);
    EXPECT_FALSE(steps[0]["skipped"].get<bool>());
    EXPECT_TRUE(steps[1]["skipped"].get<bool>());
    EXPECT_FALSE(steps[2]["skipped"].get<bool>());
    EXPECT_EQ(steps[1]["loss_scale"].get<double>(), 256.0);
    EXPECT_EQ(steps[2]["loss_scale"].get<double>(), 128.0);
  }
}

// A resumed fp16 run takes up the saved scaler: its steps are the uninterrupted run's, bit for
// bit, scales and skips included.
TEST(Fp16Training, ResumeRestoresTheLossScale) {
  TempDir dir;
  Json j = tiny_config(dir);
  j["precision"] = "fp16";
  j["fp16"] = {{"initial_scale_power", 24}, {"hysteresis", 1}, {"loss_scale_window", 2}};
  j["max_steps"] = 6;
  j["save_every"] = 3;
  const RunBits whole = run_bits(j);
  ASSERT_EQ(whole.scales.size(), 6u);
  ASSERT_NE(whole.scales[3], std::ldexp(1.0, 24)) << "the scale never moved before the save";
  Json k = j;
  k["save_dir"] = dir.file("resumed");
  auto t = make_trainer(k, dir.file("ckpt/step-00000003"));
  ASSERT_TRUE(t.is_ok()) << t.status().message();
  ASSERT_TRUE((*t)->run().is_ok());
  const auto& h = (*t)->history();
  ASSERT_EQ(h.size(), 3u);
  for (std::size_t i = 0; i < h.size(); ++i) {
    SCOPED_TRACE("step " + std::to_string(i + 4));
    EXPECT_EQ(std::bit_cast<std::uint64_t>(h[i].loss), whole.losses[i + 3]);
    EXPECT_EQ(h[i].loss_scale.value_or(0), whole.scales[i + 3]);
    EXPECT_EQ(h[i].skipped, whole.skipped[i + 3]);
  }
}

}  // namespace
}  // namespace strata::train
