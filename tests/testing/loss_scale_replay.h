// The check that a run's fp16 loss scales follow its own overflows: each step's scale is what
// optim::LossScaler gives after the run's earlier skips.
#pragma once

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "strata/optim/loss_scaler.h"

namespace strata::testing {

// Expects scales[i] to be the replayed scaler's scale before step i + 1; returns how many steps
// were skipped.
inline int expect_scales_follow_overflows(const optim::LossScalerConfig& config,
                                          const std::vector<double>& scales,
                                          const std::vector<bool>& skipped) {
  EXPECT_EQ(scales.size(), skipped.size());
  optim::LossScaler replay(config);
  int count = 0;
  for (std::size_t i = 0; i < scales.size() && i < skipped.size(); ++i) {
    EXPECT_EQ(scales[i], replay.scale()) << "step " << i + 1;
    EXPECT_TRUE(replay.update(skipped[i]).is_ok()) << "step " << i + 1;
    count += skipped[i] ? 1 : 0;
  }
  return count;
}

}  // namespace strata::testing
