#include "strata/optim/loss_scaler.h"

#include <algorithm>
#include <cmath>

#include "strata/core/check.h"

namespace strata::optim {

LossScaler::LossScaler(const LossScalerConfig& config) : config_(config) {
  STRATA_CHECK(config.loss_scale >= 0 && config.loss_scale_window >= 1 && config.hysteresis >= 1 &&
                   config.min_loss_scale > 0,
               "a loss scaler config the config reader should have refused");
  state_.scale = dynamic() ? std::ldexp(1.0, config.initial_scale_power) : config.loss_scale;
  state_.hysteresis_left = config.hysteresis;
}

Status LossScaler::update(bool overflow) {
  const std::int64_t it = state_.iteration++;
  if (!dynamic()) return Status::ok();
  if (overflow) {
    state_.last_overflow = it;
    if (config_.hysteresis == 1 || state_.hysteresis_left == 1) {
      if (state_.scale <= config_.min_loss_scale) {
        return failed_precondition(
            "the gradients overflow at the smallest loss scale (min_loss_scale " +
            std::to_string(config_.min_loss_scale) +
            "): fp16 cannot hold them; lower the learning rate, or train in bf16 or fp32");
      }
      state_.scale = std::max(state_.scale / 2, config_.min_loss_scale);
    } else {
      --state_.hysteresis_left;
    }
    return Status::ok();
  }
  if (config_.consecutive_hysteresis) state_.hysteresis_left = config_.hysteresis;
  if ((it - state_.last_overflow) % config_.loss_scale_window == 0) {
    if (!config_.consecutive_hysteresis) state_.hysteresis_left = config_.hysteresis;
    state_.scale *= 2;
  }
  return Status::ok();
}

Status LossScaler::restore(const State& state) {
  if (!(state.scale > 0) || !std::isfinite(state.scale)) {
    return invalid_argument("loss_scaler.scale: expected a positive finite number, got " +
                            std::to_string(state.scale));
  }
  if (state.iteration < 0 || state.last_overflow < -1 || state.last_overflow >= state.iteration) {
    return invalid_argument("loss_scaler.last_overflow " + std::to_string(state.last_overflow) +
                            " must lie before iteration " + std::to_string(state.iteration));
  }
  if (state.hysteresis_left < 1) {
    return invalid_argument("loss_scaler.hysteresis: expected at least 1, got " +
                            std::to_string(state.hysteresis_left));
  }
  state_ = state;
  // A static scale is the config's, whatever was saved.
  if (!dynamic()) state_.scale = config_.loss_scale;
  return Status::ok();
}

}  // namespace strata::optim
