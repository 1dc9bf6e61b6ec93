// Double-precision causal GQA attention (with an optional sliding window), forward and backward,
// with per-element bounds on the rounding error of an f32 (or bf16-in, f32-compute) implementation:
// the reference that the CPU and CUDA attention tests compare against.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "strata/device/ops.h"
#include "tests/unit/device/ops_test_util.h"

namespace strata::device::testing {

// Rounding-error bounds for the f32 computation the device runs, derived from its arithmetic:
// a sum of n terms rounded in f32 is off by at most gamma(n) * sum|terms|, gamma from
// f32_sum_error (the worst case for short sums, the probabilistic bound of Higham and Mary for
// long ones). The kernels' own orders (OpenBLAS blocks, FMA) are typically well inside it. A bf16
// run also rounds its outputs (u_out = 2^-8 relative) and its backward reads the rounded forward
// output.
struct ErrorModel {
  bool bf16 = false;
  // The CUDA flash kernels also round P and dS to bf16 for their tensor-core products: one more
  // relative 2^-8 on every P_ij and dS_ij.
  bool rounds_p_and_ds = false;
  static constexpr double kU = 0x1p-24;  // f32 unit roundoff
  double gamma(std::int64_t n) const { return f32_sum_error(n); }
  double u_out() const { return bf16 ? 0x1p-8 : 0.0; }
  double u_mid() const { return rounds_p_and_ds ? 0x1p-8 : 0.0; }
};

struct Ref {
  std::vector<double> out, lse;
  std::vector<double> out_bound, lse_bound;  // see ErrorModel
};

// q/out: [b, s, h, d]; k/v: [b, s, kvh, d]; lse: [b, h, s].
// Error bound of out_ix = sum_j P_ij v_jx: the product's own gamma(i+1) * sum_j P_ij |v_jx|, and
// each P_ij perturbed relatively by its score's error (gamma(D) * scale * sum_x |q_ix k_jx| +
// u |s_ij|) and the normalisation's gamma(i+1), counted twice (P_ij and the sum over j).
inline Ref attention_ref(const AttentionShape& sh, const std::vector<double>& q,
                         const std::vector<double>& k, const std::vector<double>& v,
                         const ErrorModel& em = {}) {
  const std::int64_t S = sh.seq, H = sh.heads, KV = sh.kv_heads, D = sh.head_dim;
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  Ref r{std::vector<double>(q.size()), std::vector<double>(sh.batch * H * S),
        std::vector<double>(q.size()), std::vector<double>(sh.batch * H * S)};
  std::vector<double> p(S), ds(S);
  for (std::int64_t b = 0; b < sh.batch; ++b) {
    for (std::int64_t h = 0; h < H; ++h) {
      const std::int64_t g = h / (H / KV);
      for (std::int64_t i = 0; i < S; ++i) {
        const std::int64_t lo = sh.window > 0 ? std::max<std::int64_t>(0, i - sh.window + 1) : 0;
        double mx = -INFINITY, ds_max = 0;
        for (std::int64_t j = lo; j <= i; ++j) {
          double s = 0, sabs = 0;
          for (std::int64_t x = 0; x < D; ++x) {
            const double t = q[((b * S + i) * H + h) * D + x] * k[((b * S + j) * KV + g) * D + x];
            s += t;
            sabs += std::abs(t);
          }
          p[j] = s * scale;
          ds[j] = em.gamma(D) * scale * sabs + ErrorModel::kU * std::abs(p[j]);
          ds_max = std::max(ds_max, ds[j]);
          mx = std::max(mx, p[j]);
        }
        double sum = 0;
        for (std::int64_t j = lo; j <= i; ++j) sum += std::exp(p[j] - mx);
        const double g_n = em.gamma(i + 1);
        for (std::int64_t x = 0; x < D; ++x) {
          double o = 0, bound = 0;
          for (std::int64_t j = lo; j <= i; ++j) {
            const double pj = std::exp(p[j] - mx) / sum;
            const double vj = v[((b * S + j) * KV + g) * D + x];
            o += pj * vj;
            bound += pj * std::abs(vj) * (g_n + 2 * (ds[j] + g_n) + em.u_mid());
          }
          const std::size_t at = static_cast<std::size_t>(((b * S + i) * H + h) * D + x);
          r.out[at] = o;
          r.out_bound[at] = bound + em.u_out() * std::abs(o);
        }
        const std::size_t at = static_cast<std::size_t>((b * H + h) * S + i);
        r.lse[at] = mx + std::log(sum);
        r.lse_bound[at] = ds_max + g_n + ErrorModel::kU * std::abs(r.lse[at]);
      }
    }
  }
  return r;
}

struct Grads {
  std::vector<double> dq, dk, dv;
  std::vector<double> dq_bound, dk_bound, dv_bound;  // see ErrorModel
};

// Analytic backward of attention_ref for upstream gradient dout, with error bounds: P_ij is off
// relatively by its score's error plus the log-sum-exp's (as in the forward); dS_ij =
// scale P_ij (dp_ij - D_i) by gamma(D) times scale P_ij (sum_x |dout_ix v_jx| + sum_x |dout_ix
// out_ix|), by the rounded forward output in bf16 (u_out * scale P_ij sum_x |dout_ix out_ix|) and
// by P_ij's error times |dS_ij|; each gradient adds its own sum's gamma(n) * sum |terms|.
inline Grads attention_backward_ref(const AttentionShape& sh, const std::vector<double>& q,
                                    const std::vector<double>& k, const std::vector<double>& v,
                                    const std::vector<double>& dout, const ErrorModel& em = {}) {
  const std::int64_t S = sh.seq, H = sh.heads, KV = sh.kv_heads, D = sh.head_dim;
  const std::int64_t group = H / KV;
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  const Ref f = attention_ref(sh, q, k, v, em);
  Grads g{std::vector<double>(q.size()), std::vector<double>(k.size()),
          std::vector<double>(v.size()), std::vector<double>(q.size()),
          std::vector<double>(k.size()), std::vector<double>(v.size())};
  for (std::int64_t b = 0; b < sh.batch; ++b) {
    for (std::int64_t h = 0; h < H; ++h) {
      const std::int64_t kvh = h / group;
      for (std::int64_t i = 0; i < S; ++i) {
        const std::int64_t lo = sh.window > 0 ? std::max<std::int64_t>(0, i - sh.window + 1) : 0;
        const std::int64_t qo = ((b * S + i) * H + h) * D;
        double di = 0, di_abs = 0;
        for (std::int64_t x = 0; x < D; ++x) {
          di += dout[qo + x] * f.out[qo + x];
          di_abs += std::abs(dout[qo + x] * f.out[qo + x]);
        }
        const double lse_err = f.lse_bound[(b * H + h) * S + i];
        const double g_q = em.gamma(i + 1);  // dq_i sums over keys j <= i
        for (std::int64_t j = lo; j <= i; ++j) {
          const std::int64_t ko = ((b * S + j) * KV + kvh) * D;
          const double g_k = em.gamma((S - j) * group);  // dk_j, dv_j sum over queries i >= j
          double s = 0, dp = 0, s_abs = 0, dp_abs = 0;
          for (std::int64_t x = 0; x < D; ++x) {
            s += q[qo + x] * k[ko + x];
            dp += dout[qo + x] * v[ko + x];
            s_abs += std::abs(q[qo + x] * k[ko + x]);
            dp_abs += std::abs(dout[qo + x] * v[ko + x]);
          }
          const double p = std::exp(s * scale - f.lse[(b * H + h) * S + i]);
          const double ds = p * (dp - di) * scale;
          const double p_rel = em.gamma(D) * scale * s_abs + ErrorModel::kU * std::abs(s * scale) +
                               lse_err + 2 * ErrorModel::kU + em.u_mid();
          const double ds_err =
              scale * p * (em.gamma(D) * (dp_abs + di_abs) + em.u_out() * di_abs) +
              std::abs(ds) * (p_rel + em.u_mid());
          for (std::int64_t x = 0; x < D; ++x) {
            g.dv[ko + x] += p * dout[qo + x];
            g.dk[ko + x] += ds * q[qo + x];
            g.dq[qo + x] += ds * k[ko + x];
            g.dv_bound[ko + x] += p * std::abs(dout[qo + x]) * (g_k + p_rel);
            g.dk_bound[ko + x] += (g_k * std::abs(ds) + ds_err) * std::abs(q[qo + x]);
            g.dq_bound[qo + x] += (g_q * std::abs(ds) + ds_err) * std::abs(k[ko + x]);
          }
        }
      }
    }
  }
  for (auto* t : {&g.dq, &g.dk, &g.dv}) {
    std::vector<double>& bound = t == &g.dq ? g.dq_bound : t == &g.dk ? g.dk_bound : g.dv_bound;
    for (std::size_t i = 0; i < t->size(); ++i) bound[i] += em.u_out() * std::abs((*t)[i]);
  }
  return g;
}

}  // namespace strata::device::testing
