// One trainer's run for the tests that compare runs step by step: its steps' losses, gradient
// norms, skips and loss scales, its device peak and its traffic. A failure to create or run the
// trainer is the test's failure (and an empty history).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "strata/core/json.h"
#include "strata/train/config.h"
#include "strata/train/trainer.h"

namespace strata::train {

struct History {
  std::vector<double> loss, grad_norm;
  std::vector<bool> skipped;
  std::vector<double> loss_scale;  // fp16's, else 0
  std::uint64_t peak_device_bytes = 0;
  std::uint64_t sent_bytes = 0, all_to_all_bytes = 0;  // over the steps
};

// Trains `j`'s max_steps with `options`.
inline History train_history(const Json& j, const TrainOptions& options = {}) {
  History r;
  auto c = parse_train_config(j, "test config");
  EXPECT_TRUE(c.is_ok()) << c.status().message();
  if (!c.is_ok()) return r;
  auto t = Trainer::create(*c, options);
  EXPECT_TRUE(t.is_ok()) << t.status().message();
  if (!t.is_ok()) return r;
  const Status s = (*t)->run_steps(c->max_steps);
  EXPECT_TRUE(s.is_ok()) << s.message();
  for (const StepMetrics& m : (*t)->history()) {
    r.loss.push_back(m.loss);
    r.grad_norm.push_back(m.grad_norm);
    r.skipped.push_back(m.skipped);
    r.loss_scale.push_back(m.loss_scale.value_or(0.0));
    r.peak_device_bytes = std::max(r.peak_device_bytes, m.peak_device_bytes);
    r.sent_bytes += m.sent_bytes;
    r.all_to_all_bytes += m.all_to_all_bytes;
  }
  return r;
}

}  // namespace strata::train
