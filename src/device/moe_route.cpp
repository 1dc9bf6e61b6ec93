// One token's mixture-of-experts routing and its backward (strata/device/moe_route.h).
#include "strata/device/moe_route.h"

#include <cmath>

namespace strata::device {

void moe_route_reference(const float* logits, std::int64_t experts, std::int64_t k, bool normalize,
                         float* probs, std::int32_t* chosen, float* weights) {
  float top = logits[0];
  for (std::int64_t e = 1; e < experts; ++e) top = std::fmax(top, logits[e]);
  float sum = 0.0f;
  for (std::int64_t e = 0; e < experts; ++e) {
    probs[e] = std::exp(logits[e] - top);
    sum += probs[e];
  }
  for (std::int64_t e = 0; e < experts; ++e) probs[e] /= sum;
  // Selection: the j-th pick is the largest probability not yet picked, lower expert on ties.
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

void moe_route_backward_reference(const float* probs, const std::int32_t* chosen,
                                  const float* dweights, const float* aux_grad,
                                  std::int64_t experts, std::int64_t k, bool normalize,
                                  float* dlogits) {
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
