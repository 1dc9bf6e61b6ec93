// CPU causal GQA attention against a double-precision reference, whose backward is in turn
// checked against finite differences; plus thread-count independence of the results.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "tests/unit/device/ops_test_util.h"

namespace strata::device {
namespace {

using testing::expect_close;
using testing::HostTensor;
using testing::make_device;

struct Ref {
  std::vector<double> out, lse;
};

// q/out: [b, s, h, d]; k/v: [b, s, kvh, d]; lse: [b, h, s].
Ref attention_ref(const AttentionShape& sh, const std::vector<double>& q,
                  const std::vector<double>& k, const std::vector<double>& v) {
  const std::int64_t S = sh.seq, H = sh.heads, KV = sh.kv_heads, D = sh.head_dim;
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  Ref r{std::vector<double>(q.size()), std::vector<double>(sh.batch * H * S)};
  std::vector<double> p(S);
  for (std::int64_t b = 0; b < sh.batch; ++b) {
    for (std::int64_t h = 0; h < H; ++h) {
      const std::int64_t g = h / (H / KV);
      for (std::int64_t i = 0; i < S; ++i) {
        double mx = -INFINITY;
        for (std::int64_t j = 0; j <= i; ++j) {
          double s = 0;
          for (std::int64_t x = 0; x < D; ++x)
            s += q[((b * S + i) * H + h) * D + x] * k[((b * S + j) * KV + g) * D + x];
          p[j] = s * scale;
          mx = std::max(mx, p[j]);
        }
        double sum = 0;
        for (std::int64_t j = 0; j <= i; ++j) sum += std::exp(p[j] - mx);
        for (std::int64_t x = 0; x < D; ++x) {
          double o = 0;
          for (std::int64_t j = 0; j <= i; ++j)
            o += std::exp(p[j] - mx) / sum * v[((b * S + j) * KV + g) * D + x];
          r.out[((b * S + i) * H + h) * D + x] = o;
        }
        r.lse[(b * H + h) * S + i] = mx + std::log(sum);
      }
    }
  }
  return r;
}

struct Grads {
  std::vector<double> dq, dk, dv;
};

// Analytic backward of attention_ref for upstream gradient dout.
Grads attention_backward_ref(const AttentionShape& sh, const std::vector<double>& q,
                             const std::vector<double>& k, const std::vector<double>& v,
                             const std::vector<double>& dout) {
  const std::int64_t S = sh.seq, H = sh.heads, KV = sh.kv_heads, D = sh.head_dim;
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  const Ref f = attention_ref(sh, q, k, v);
  Grads g{std::vector<double>(q.size()), std::vector<double>(k.size()),
          std::vector<double>(v.size())};
  for (std::int64_t b = 0; b < sh.batch; ++b) {
    for (std::int64_t h = 0; h < H; ++h) {
      const std::int64_t kvh = h / (H / KV);
      for (std::int64_t i = 0; i < S; ++i) {
        const std::int64_t qo = ((b * S + i) * H + h) * D;
        double di = 0;
        for (std::int64_t x = 0; x < D; ++x) di += dout[qo + x] * f.out[qo + x];
        for (std::int64_t j = 0; j <= i; ++j) {
          const std::int64_t ko = ((b * S + j) * KV + kvh) * D;
          double s = 0, dp = 0;
          for (std::int64_t x = 0; x < D; ++x) {
            s += q[qo + x] * k[ko + x];
            dp += dout[qo + x] * v[ko + x];
          }
          const double p = std::exp(s * scale - f.lse[(b * H + h) * S + i]);
          const double ds = p * (dp - di) * scale;
          for (std::int64_t x = 0; x < D; ++x) {
            g.dv[ko + x] += p * dout[qo + x];
            g.dk[ko + x] += ds * q[qo + x];
            g.dq[qo + x] += ds * k[ko + x];
          }
        }
      }
    }
  }
  return g;
}

struct Case {
  AttentionShape shape;
  bool check_reference_with_differences;
};

const Case kCases[] = {
    {{2, 7, 4, 2, 8}, true},     // GQA, tiny: reference backward checked numerically
    {{1, 5, 3, 3, 4}, true},     // plain multi-head
    {{2, 64, 4, 1, 32}, false},  // multi-query, longer
    {{1, 130, 2, 2, 64}, false},
    {{1, 1100, 4, 2, 8}, false},  // 4 [seq, seq] score blocks exceed one chunk: heads split 3 + 1
};

TEST(CpuAttentionTest, ReferenceBackwardMatchesFiniteDifferences) {
  for (const Case& c : kCases) {
    if (!c.check_reference_with_differences) continue;
    const auto& sh = c.shape;
    Rng rng(31);
    const std::int64_t nq = sh.batch * sh.seq * sh.heads * sh.head_dim;
    const std::int64_t nk = sh.batch * sh.seq * sh.kv_heads * sh.head_dim;
    auto rand = [&](std::int64_t n) {
      std::vector<double> v(n);
      for (auto& x : v) x = 2 * rng.uniform() - 1;
      return v;
    };
    const auto q = rand(nq), k = rand(nk), v = rand(nk), dout = rand(nq);
    const Grads g = attention_backward_ref(sh, q, k, v, dout);
    expect_close(
        "ref dq",
        testing::numeric_grad(
            [&](const auto& x) { return testing::dot(dout, attention_ref(sh, x, k, v).out); }, q),
        g.dq, 1e-6);
    expect_close(
        "ref dk",
        testing::numeric_grad(
            [&](const auto& x) { return testing::dot(dout, attention_ref(sh, q, x, v).out); }, k),
        g.dk, 1e-6);
    expect_close(
        "ref dv",
        testing::numeric_grad(
            [&](const auto& x) { return testing::dot(dout, attention_ref(sh, q, k, x).out); }, v),
        g.dv, 1e-6);
  }
}

TEST(CpuAttentionTest, ForwardAndBackwardMatchReference) {
  auto dev = make_device();
  for (DType dt : {DType::kF32, DType::kBF16}) {
    for (const Case& c : kCases) {
      const auto& sh = c.shape;
      SCOPED_TRACE(std::string(dtype_name(dt)) + " b,s,h,kvh,d=" + std::to_string(sh.batch) + "," +
                   std::to_string(sh.seq) + "," + std::to_string(sh.heads) + "," +
                   std::to_string(sh.kv_heads) + "," + std::to_string(sh.head_dim));
      Rng rng(32);
      const std::int64_t nq = sh.batch * sh.seq * sh.heads * sh.head_dim;
      const std::int64_t nk = sh.batch * sh.seq * sh.kv_heads * sh.head_dim;
      HostTensor q(dt, nq), k(dt, nk), v(dt, nk), out(dt, nq), dout(dt, nq);
      HostTensor dq(dt, nq), dk(dt, nk), dv(dt, nk);
      // Scores of a few units so the softmax is far from uniform.
      q.fill_uniform(rng, -1.5, 1.5);
      k.fill_uniform(rng, -1.5, 1.5);
      v.fill_uniform(rng, -1, 1);
      dout.fill_uniform(rng, -1, 1);
      for (HostTensor* t : {&out, &dq, &dk, &dv}) t->poison();
      std::vector<float> lse(static_cast<std::size_t>(sh.batch * sh.heads * sh.seq), NAN);
      dev->ops().attention_forward(q.data(), k.data(), v.data(), out.data(), lse.data(), sh, dt);
      const Ref want = attention_ref(sh, q.values(), k.values(), v.values());
      expect_close("out", out.values(), want.out, testing::tolerance(dt));
      expect_close("lse", std::vector<double>(lse.begin(), lse.end()), want.lse,
                   dt == DType::kF32 ? 1e-5 : 1e-3);
      dev->ops().attention_backward(dout.data(), q.data(), k.data(), v.data(), out.data(),
                                    lse.data(), dq.data(), dk.data(), dv.data(), sh, dt);
      const Grads g = attention_backward_ref(sh, q.values(), k.values(), v.values(), dout.values());
      // f32: 1e-5 relative to the tensor's rms. bf16 also sees the rounded forward output in
      // D_i = dout_i . out_i, whose error grows with the number of keys (~2% at seq 1100).
      const double tol = dt == DType::kF32 ? 1e-5 : 3e-2;
      expect_close("dq", dq.values(), g.dq, tol);
      expect_close("dk", dk.values(), g.dk, tol);
      expect_close("dv", dv.values(), g.dv, tol);
    }
  }
}

// Results must not depend on the number of threads (checkpointed recomputation and
// multi-rank runs rely on bitwise reproducibility).
TEST(CpuAttentionTest, ResultsIndependentOfThreadCount) {
  auto one = make_device(1), two = make_device(2);
  const AttentionShape sh{3, 33, 4, 2, 16};
  const DType dt = DType::kF32;
  Rng rng(33);
  const std::int64_t nq = sh.batch * sh.seq * sh.heads * sh.head_dim;
  const std::int64_t nk = sh.batch * sh.seq * sh.kv_heads * sh.head_dim;
  HostTensor q(dt, nq), k(dt, nk), v(dt, nk), dout(dt, nq);
  for (HostTensor* t : {&q, &k, &v, &dout}) t->fill_uniform(rng, -1, 1);
  std::vector<HostTensor> outs, dqs, dks, dvs;
  for (Device* d : {one.get(), two.get()}) {
    HostTensor out(dt, nq), dq(dt, nq), dk(dt, nk), dv(dt, nk);
    std::vector<float> lse(static_cast<std::size_t>(sh.batch * sh.heads * sh.seq));
    d->ops().attention_forward(q.data(), k.data(), v.data(), out.data(), lse.data(), sh, dt);
    d->ops().attention_backward(dout.data(), q.data(), k.data(), v.data(), out.data(), lse.data(),
                                dq.data(), dk.data(), dv.data(), sh, dt);
    outs.push_back(out);
    dqs.push_back(dq);
    dks.push_back(dk);
    dvs.push_back(dv);
  }
  EXPECT_TRUE(outs[0].bitwise_equal(outs[1]));
  EXPECT_TRUE(dqs[0].bitwise_equal(dqs[1]));
  EXPECT_TRUE(dks[0].bitwise_equal(dks[1]));
  EXPECT_TRUE(dvs[0].bitwise_equal(dvs[1]));
}

}  // namespace
}  // namespace strata::device
