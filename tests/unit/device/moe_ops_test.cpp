// The mixture-of-experts ops on the CPU backend: moe_route picks the k most probable experts
// (the lower one first among equals) with transformers' weights, and moe_route_backward is the
// gradient of sum_j dw_j w_j + sum_e a_e p_e, checked against central differences of the same
// routing computed in double; scale_rows and row_dots on rows.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "strata/core/rng.h"
#include "strata/device/device.h"

namespace strata::device {
namespace {

std::unique_ptr<Device> cpu() {
  DeviceOptions o;
  o.compute_threads = 1;
  return std::move(*create_device(o));
}

// The routing in double with the choice held fixed: probabilities and the k weights.
void route64(const std::vector<double>& z, const std::vector<std::int32_t>& chosen, bool normalize,
             std::vector<double>* p, std::vector<double>* w) {
  const double top = *std::max_element(z.begin(), z.end());
  double sum = 0;
  p->resize(z.size());
  for (std::size_t e = 0; e < z.size(); ++e) sum += (*p)[e] = std::exp(z[e] - top);
  for (double& v : *p) v /= sum;
  w->resize(chosen.size());
  double picked = 0;
  for (std::size_t j = 0; j < chosen.size(); ++j) picked += (*w)[j] = (*p)[chosen[j]];
  if (normalize) {
    for (double& v : *w) v /= picked;
  }
}

TEST(MoeOpsTest, RouteChoosesTheMostProbableExpertsWithTransformersWeights) {
  auto dev = cpu();
  const std::int64_t E = 5, K = 2;
  // Token 0: distinct logits; token 1: experts 1 and 3 tie for first, 4 third.
  const std::vector<float> logits = {0.5f, -1.0f, 2.0f, 1.0f, 0.0f,  //
                                     0.0f, 1.5f,  -2.f, 1.5f, 1.0f};
  std::vector<float> probs(2 * E), weights(2 * K);
  std::vector<std::int32_t> chosen(2 * K);
  for (const bool normalize : {false, true}) {
    dev->ops().moe_route(logits.data(), 2, E, K, normalize, probs.data(), chosen.data(),
                         weights.data());
    EXPECT_EQ(chosen, (std::vector<std::int32_t>{2, 3, 1, 3}));
    for (int t = 0; t < 2; ++t) {
      const float* p = probs.data() + t * E;
      EXPECT_NEAR(std::accumulate(p, p + E, 0.0), 1.0, 1e-6);
      const double picked = p[chosen[t * K]] + p[chosen[t * K + 1]];
      for (int j = 0; j < K; ++j) {
        const double want = p[chosen[t * K + j]] / (normalize ? picked : 1.0);
        EXPECT_NEAR(weights[t * K + j], want, 1e-6);
      }
    }
  }
}

TEST(MoeOpsTest, RouteBackwardIsTheGradientOfTheWeightsAndTheAuxTerm) {
  auto dev = cpu();
  const std::int64_t T = 6, E = 8, K = 3;
  Rng rng(7);
  std::vector<float> logits(T * E), dweights(T * K), aux(E);
  for (float& v : logits) v = static_cast<float>(rng.normal());
  for (float& v : dweights) v = static_cast<float>(rng.normal());
  for (float& v : aux) v = static_cast<float>(rng.normal());
  std::vector<float> probs(T * E), weights(T * K), dlogits(T * E);
  std::vector<std::int32_t> chosen(T * K);
  for (const bool normalize : {false, true}) {
    for (const bool with_aux : {false, true}) {
      SCOPED_TRACE(std::string(normalize ? "normalized" : "raw") + (with_aux ? " + aux" : ""));
      dev->ops().moe_route(logits.data(), T, E, K, normalize, probs.data(), chosen.data(),
                           weights.data());
      dev->ops().moe_route_backward(probs.data(), chosen.data(), dweights.data(),
                                    with_aux ? aux.data() : nullptr, T, E, K, normalize,
                                    dlogits.data());
      for (std::int64_t t = 0; t < T; ++t) {
        const std::vector<std::int32_t> c(chosen.begin() + t * K, chosen.begin() + (t + 1) * K);
        const auto objective = [&](const std::vector<double>& z) {
          std::vector<double> p, w;
          route64(z, c, normalize, &p, &w);
          double f = 0;
          for (std::int64_t j = 0; j < K; ++j) f += dweights[t * K + j] * w[j];
          if (with_aux) {
            for (std::int64_t e = 0; e < E; ++e) f += aux[e] * p[e];
          }
          return f;
        };
        std::vector<double> z(logits.begin() + t * E, logits.begin() + (t + 1) * E);
        for (std::int64_t e = 0; e < E; ++e) {
          // Central differences: error h^2 |f'''| ~ 1e-10; the f32 result carries a few
          // roundings of terms of magnitude |dw| + |a| (below 10): 1e-5 holds both.
          const double h = 1e-5;
          std::vector<double> up = z, down = z;
          up[e] += h;
          down[e] -= h;
          const double want = (objective(up) - objective(down)) / (2 * h);
          EXPECT_NEAR(dlogits[t * E + e], want, 1e-5) << "token " << t << " expert " << e;
        }
      }
    }
  }
}

TEST(MoeOpsTest, ScaleRowsAndRowDots) {
  auto dev = cpu();
  std::vector<float> x = {1, 2, 3, 4, 5, 6};
  const std::vector<float> scale = {0.5f, -2.0f};
  dev->ops().scale_rows(x.data(), scale.data(), 2, 3, DType::kF32);
  EXPECT_EQ(x, (std::vector<float>{0.5f, 1, 1.5f, -8, -10, -12}));
  const std::vector<float> b = {1, 1, 1, 0, 1, 0};
  const std::vector<std::int32_t> index = {3, 0};
  std::vector<float> out(4, -1.0f);
  dev->ops().row_dots(x.data(), b.data(), 2, 3, index.data(), out.data(), DType::kF32);
  EXPECT_EQ(out, (std::vector<float>{-10, -1, -1, 3}));
}

}  // namespace
}  // namespace strata::device
