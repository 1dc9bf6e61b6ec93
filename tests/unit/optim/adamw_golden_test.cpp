// CpuAdam against torch.optim.AdamW / torch.optim.Adam(weight_decay) over several steps: golden
// values from tools/golden/adamw_golden.py (tests/data/adamw_golden.json, torch 1.13 CPU,
// single-tensor path).
//
// Expected distance from torch, and why it is not always zero (the bound is propagated per
// element from these roundings, see Bounds):
//  - torch's vectorized add (exp_avg.mul_(beta1).add_(grad, alpha=1-beta1)) is an FMA, one
//    rounding fewer than the reference's multiply-then-add; that alone moves exp_avg by at most
//    a few ulp over the steps (adamw_exact_hyper, whose hyperparameters and 1 - beta are exact in
//    float32, isolates it).
//  - device::AdamWArgs carries the hyperparameters as double, like torch's Python floats, so
//    1 - beta, lr / bias correction and 1 - lr * weight_decay round to f32 exactly as torch's
//    do; the FMA is the only difference left.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "strata/core/json.h"
#include "strata/optim/adamw.h"
#include "strata/optim/cpu_adam.h"

namespace strata::optim {
namespace {

const char* const kGoldenPath = STRATA_TEST_DATA_DIR "/adamw_golden.json";

std::vector<float> floats(const Json& bits) {
  std::vector<float> out;
  for (const Json& b : bits) out.push_back(std::bit_cast<float>(b.get<std::uint32_t>()));
  return out;
}

// How far torch's arithmetic can be from the reference's, per element, propagated over the
// steps: each operation torch may fuse or order differently (the FMA in m and v's updates, the
// square root, the two divisions, the parameter's multiply-add) differs by at most one f32
// rounding (u = 2^-24 of its result, two for a fused multiply-add against a separate multiply
// and add), and earlier differences carry into later values:
//   dm_k = beta1 dm_{k-1} + 3u (|beta1 m_{k-1}| + |(1 - beta1) g_k|)   (the reference rounds
//          (1 - beta1) g, which torch's FMA does not, and each side rounds the sum once)
//   dv_k = beta2 dv_{k-1} + 2u beta2 v_{k-1} + 6u (1 - beta2) g_k^2   (torch's addcmul
//          associates (1 - beta2) g g differently: two product roundings on each side, and
//          each side's sum rounding)
//   dden = (dv_k / (2 sqrt(v_k)) + 2u sqrt(v_k)) / bc2_sqrt + u den
//   dp_k = |decay| dp_{k-1} + step_size (dm_k / den + |m_k| dden / den^2) + 3u |update| + 2u |p_k|
// with the values taken from the reference run. A wrong formula or hyperparameter moves the
// values by far more than these few roundings.
struct Bounds {
  std::vector<double> dp, dm, dv;
};

void propagate(Bounds& b, const AdamWHyper& h, std::int64_t step, const std::vector<float>& g,
               const std::vector<float>& p_before, const std::vector<float>& m_before,
               const std::vector<float>& v_before, const std::vector<float>& p,
               const std::vector<float>& m, const std::vector<float>& v) {
  constexpr double kU = 0x1p-24;
  const double b1 = h.beta1, b2 = h.beta2;
  const double bc1 = 1.0 - std::pow(b1, static_cast<double>(step));
  const double bc2_sqrt = std::sqrt(1.0 - std::pow(b2, static_cast<double>(step)));
  const double step_size = h.lr / bc1;
  const double decay = h.adamw_mode ? 1.0 - h.lr * h.weight_decay : 1.0;
  for (std::size_t i = 0; i < g.size(); ++i) {
    // Adam with L2 adds weight_decay * p to the gradient first: one more rounding there.
    const double gi = h.adamw_mode ? g[i] : g[i] + h.weight_decay * p_before[i];
    const double dg = h.adamw_mode ? 0.0 : 2 * kU * std::abs(gi) + h.weight_decay * b.dp[i];
    b.dm[i] = b1 * b.dm[i] + (1 - b1) * dg +
              3 * kU * (std::abs(b1 * m_before[i]) + std::abs((1 - b1) * gi));
    b.dv[i] = b2 * b.dv[i] + 2 * (1 - b2) * std::abs(gi) * dg + 2 * kU * b2 * v_before[i] +
              6 * kU * (1 - b2) * gi * gi;
    const double sv = std::sqrt(static_cast<double>(v[i]));
    const double den = sv / bc2_sqrt + h.eps;
    const double dden = (b.dv[i] / (2 * std::max(sv, 1e-30)) + 2 * kU * sv) / bc2_sqrt + kU * den;
    const double update = step_size * std::abs(m[i]) / den;
    b.dp[i] = std::abs(decay) * b.dp[i] +
              step_size * (b.dm[i] / den + std::abs(m[i]) * dden / (den * den)) + 3 * kU * update +
              2 * kU * std::abs(p[i]);
  }
}

// Every element within its bound; prints the worst fraction of the bound used.
void expect_within(const char* what, std::int64_t step, const std::vector<float>& got,
                   const std::vector<float>& want, const std::vector<double>& bound) {
  double worst = 0;
  int bad = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double err = std::abs(static_cast<double>(got[i]) - want[i]);
    if (bound[i] > 0) worst = std::max(worst, err / bound[i]);
    if (!(err <= bound[i])) ++bad;
  }
  std::printf("  %s step %lld: worst %.2f of its bound\n", what, static_cast<long long>(step),
              worst);
  EXPECT_EQ(bad, 0) << what << " at step " << step << ": worst " << worst << "x its bound";
}

TEST(AdamWGolden, MatchesTorchOverSeveralSteps) {
  auto golden = read_json_file(kGoldenPath);
  ASSERT_TRUE(golden.is_ok()) << golden.status().to_string();
  auto adam = CpuAdam::create({});
  ASSERT_TRUE(adam.is_ok()) << adam.status().to_string();
  ASSERT_GE(golden->at("cases").size(), 3u);
  for (const Json& c : golden->at("cases")) {
    const std::string name = c.at("name").get<std::string>();
    SCOPED_TRACE(name);
    AdamWHyper h;
    h.lr = c.at("lr").get<double>();
    h.beta1 = c.at("beta1").get<double>();
    h.beta2 = c.at("beta2").get<double>();
    h.eps = c.at("eps").get<double>();
    h.weight_decay = c.at("weight_decay").get<double>();
    h.adamw_mode = c.at("adamw_mode").get<bool>();
    const auto n = c.at("n").get<std::size_t>();
    std::vector<float> p = floats(c.at("param")), m(n, 0.0f), v(n, 0.0f);
    std::vector<float> rp = p, rm = m, rv = v;
    Bounds bounds{std::vector<double>(n), std::vector<double>(n), std::vector<double>(n)};
    std::int64_t step = 0;
    for (const Json& s : c.at("steps")) {
      ++step;
      std::vector<float> g = floats(s.at("grad"));
      device::AdamWArgs a = make_adamw_args(h, h.lr, step, 1.0f);
      a.grad = g.data();
      a.n = static_cast<std::int64_t>(n);
      device::AdamWArgs r = a;
      const std::vector<float> p_before = rp, m_before = rm, v_before = rv;
      a.param = p.data(), a.exp_avg = m.data(), a.exp_avg_sq = v.data();
      r.param = rp.data(), r.exp_avg = rm.data(), r.exp_avg_sq = rv.data();
      ASSERT_EQ(adam->step(a), StepOutcome::kUpdated);
      device::adamw_reference(r);
      // CpuAdam is the reference, bit for bit.
      ASSERT_EQ(p, rp) << "step " << step;
      ASSERT_EQ(m, rm) << "step " << step;
      ASSERT_EQ(v, rv) << "step " << step;
      propagate(bounds, h, step, g, p_before, m_before, v_before, rp, rm, rv);
      expect_within("param", step, p, floats(s.at("param")), bounds.dp);
      expect_within("exp_avg", step, m, floats(s.at("exp_avg")), bounds.dm);
      expect_within("exp_avg_sq", step, v, floats(s.at("exp_avg_sq")), bounds.dv);
    }
  }
}

}  // namespace
}  // namespace strata::optim
