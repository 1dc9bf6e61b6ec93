// Mixture-of-experts routing of one token and its backward, as every backend computes them: the
// CPU backend's Ops::moe_route and moe_route_backward run these per token, and so do the CUDA
// kernels (kernels/moe.cu), one thread per token.
#pragma once

#include <cmath>
#include <cstdint>

#include "strata/device/host_device.h"

namespace strata::device {

// logits [experts] -> probs [experts] (softmax: the maximum subtracted, exp, divided by the sum,
// in f32), chosen [k] (the k largest probabilities, largest first, the lower expert first among
// equals) and weights [k] (their probabilities, divided by their f32 sum with `normalize`).
STRATA_HOST_DEVICE inline void moe_route_token(const float* logits, std::int64_t experts,
                                               std::int64_t k, bool normalize, float* probs,
                                               std::int32_t* chosen, float* weights) {
  float top = logits[0];
  for (std::int64_t e = 1; e < experts; ++e) top = std::fmax(top, logits[e]);
  float sum = 0.0f;
  for (std::int64_t e = 0; e < experts; ++e) {
    probs[e] = std::exp(logits[e] - top);
    sum += probs[e];
  }
  for (std::int64_t e = 0; e < experts; ++e) probs[e] /= sum;
  // The j-th pick is the largest probability not yet picked, the lower expert on ties.
  float picked_sum = 0.0f;
  for (std::int64_t j = 0; j < k; ++j) {
    std::int32_t best = -1;
    for (std::int64_t e = 0; e < experts; ++e) {
      bool taken = false;
      for (std::int64_t i = 0; i < j; ++i) taken = taken || chosen[i] == e;
      if (!taken && (best < 0 || probs[e] > probs[best])) best = static_cast<std::int32_t>(e);
    }
    chosen[j] = best;
    weights[j] = probs[best];
    picked_sum += weights[j];
  }
  if (normalize) {
    for (std::int64_t j = 0; j < k; ++j) weights[j] /= picked_sum;
  }
}

// dlogits [experts] from dweights [k] and aux_grad [experts] (null: none): with dp the gradient
// of the probabilities (aux_grad, plus dweights through the top-k and the renormalization),
// dlogits[e] = probs[e] (dp[e] - sum_m probs[m] dp[m]).
STRATA_HOST_DEVICE inline void moe_route_token_backward(
    const float* probs, const std::int32_t* chosen, const float* dweights, const float* aux_grad,
    std::int64_t experts, std::int64_t k, bool normalize, float* dlogits) {
  // dlogits holds dp, the gradient of the probabilities, until the softmax's backward.
  for (std::int64_t e = 0; e < experts; ++e) dlogits[e] = aux_grad != nullptr ? aux_grad[e] : 0.0f;
  if (normalize) {
    // w_j = p_j / S: dp_j += (dw_j - sum_i dw_i w_i) / S.
    float picked_sum = 0.0f;
    for (std::int64_t j = 0; j < k; ++j) picked_sum += probs[chosen[j]];
    float dot = 0.0f;
    for (std::int64_t j = 0; j < k; ++j) dot += dweights[j] * (probs[chosen[j]] / picked_sum);
    for (std::int64_t j = 0; j < k; ++j) dlogits[chosen[j]] += (dweights[j] - dot) / picked_sum;
  } else {
    for (std::int64_t j = 0; j < k; ++j) dlogits[chosen[j]] += dweights[j];
  }
  float dot = 0.0f;
  for (std::int64_t e = 0; e < experts; ++e) dot += probs[e] * dlogits[e];
  for (std::int64_t e = 0; e < experts; ++e) dlogits[e] = probs[e] * (dlogits[e] - dot);
}

}  // namespace strata::device
