// Mixture-of-experts routing of one token, as every backend computes it (Ops::moe_route and
// Ops::moe_route_backward): the CPU backend runs these, the CUDA kernels the same operations in
// the same order (their exp may round otherwise).
#pragma once

#include <cstdint>

namespace strata::device {

// logits [experts] -> probs [experts] (softmax: the maximum subtracted, exp, divided by the sum,
// in f32), chosen [k] (the k largest probabilities, largest first, the lower expert first among
// equals) and weights [k] (their probabilities, divided by their f32 sum with `normalize`).
void moe_route_reference(const float* logits, std::int64_t experts, std::int64_t k, bool normalize,
                         float* probs, std::int32_t* chosen, float* weights);

// dlogits [experts] from dweights [k] and aux_grad [experts] (null: none): with dp the gradient
// of the probabilities (aux_grad, plus dweights through the top-k and the renormalization),
// dlogits[e] = probs[e] (dp[e] - sum_m probs[m] dp[m]).
void moe_route_backward_reference(const float* probs, const std::int32_t* chosen,
                                  const float* dweights, const float* aux_grad,
                                  std::int64_t experts, std::int64_t k, bool normalize,
                                  float* dlogits);

}  // namespace strata::device
