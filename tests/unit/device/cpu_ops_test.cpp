// CPU op table against double-precision reference loops: GEMM, embedding, RMSNorm, RoPE,
// SwiGLU, add, cross-entropy, cast, sum of squares, AdamW; plus the device budget.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <optional>
#include <vector>

#include "src/device/cpu/cpu_ops_internal.h"
#include "strata/build_config.h"
#include "strata/device/device.h"
#include "strata/sys/cpu_features.h"
#include "tests/testing/scoped_env.h"
#include "tests/unit/device/ops_test_util.h"

namespace strata::device {
namespace {

using testing::expect_close;
using testing::HostTensor;
using testing::make_device;
using testing::tolerance;

constexpr DType kDtypes[] = {DType::kF32, DType::kBF16};

// ---------------------------------------------------------------------------------------------
// GEMM

// `run` computes the GEMM (the op table's, or one of its internal paths).
void check_gemm_with(const std::function<void(const GemmArgs&)>& run, DType dt, bool ta, bool tb,
                     std::int64_t m, std::int64_t n, std::int64_t k, float alpha, float beta,
                     std::uint64_t seed) {
  SCOPED_TRACE(std::string(dtype_name(dt)) + " ta=" + std::to_string(ta) +
               " tb=" + std::to_string(tb) + " beta=" + std::to_string(beta) +
               " m,n,k=" + std::to_string(m) + "," + std::to_string(n) + "," + std::to_string(k));
  Rng rng(seed);
  const std::int64_t a_rows = ta ? k : m, a_cols = ta ? m : k, lda = a_cols + 3;
  const std::int64_t b_rows = tb ? n : k, b_cols = tb ? k : n, ldb = b_cols + 5;
  const std::int64_t ldc = n + 2;
  HostTensor a(dt, a_rows * lda), b(dt, b_rows * ldb), c(dt, m * ldc);
  a.fill_uniform(rng, -1, 1);
  b.fill_uniform(rng, -1, 1);
  c.fill_uniform(rng, -1, 1);
  constexpr double kSentinel = 7.0;  // in the ld padding: must stay untouched
  for (std::int64_t i = 0; i < m; ++i) {
    for (std::int64_t j = n; j < ldc; ++j) c.set(i * ldc + j, kSentinel);
    if (beta == 0.0f) {
      for (std::int64_t j = 0; j < n; ++j) c.set(i * ldc + j, NAN);
    }
  }
  const auto av = a.values(), bv = b.values(), c0 = c.values();
  // The bound of each element: the f32 sum of k products (f32_sum_error(k) * |alpha| *
  // sum_p |a_ip b_pj|), the scaled C's rounding and, in bf16 or f16, the output's (2^-8 or 2^-11
  // relative: their unit roundoffs).
  const double u_out = dt == DType::kF32 ? 0x1p-24 : (dt == DType::kF16 ? 0x1p-11 : 0x1p-8);
  std::vector<double> want, got, bound;
  for (std::int64_t i = 0; i < m; ++i) {
    for (std::int64_t j = 0; j < n; ++j) {
      double s = 0, s_abs = 0;
      for (std::int64_t p = 0; p < k; ++p) {
        const double x = ta ? av[p * lda + i] : av[i * lda + p];
        const double y = tb ? bv[j * ldb + p] : bv[p * ldb + j];
        s += x * y;
        s_abs += std::abs(x * y);
      }
      const double cterm = beta == 0.0f ? 0.0 : beta * c0[i * ldc + j];
      want.push_back(alpha * s + cterm);
      bound.push_back(testing::f32_sum_error(k + 1) * (std::abs(alpha) * s_abs + std::abs(cterm)) +
                      u_out * std::abs(want.back()));
    }
  }
  GemmArgs g;
  g.trans_a = ta;
  g.trans_b = tb;
  g.m = m;
  g.n = n;
  g.k = k;
  g.alpha = alpha;
  g.a = a.data();
  g.lda = lda;
  g.b = b.data();
  g.ldb = ldb;
  g.beta = beta;
  g.c = c.data();
  g.ldc = ldc;
  g.dtype = dt;
  run(g);
  for (std::int64_t i = 0; i < m; ++i) {
    for (std::int64_t j = 0; j < n; ++j) got.push_back(c.get(i * ldc + j));
    for (std::int64_t j = n; j < ldc; ++j) ASSERT_EQ(c.get(i * ldc + j), kSentinel);
  }
  testing::expect_within("gemm", got, want, bound);
}

void check_gemm(const Ops& ops, DType dt, bool ta, bool tb, std::int64_t m, std::int64_t n,
                std::int64_t k, float alpha, float beta, std::uint64_t seed) {
  check_gemm_with([&ops](const GemmArgs& g) { ops.gemm(g); }, dt, ta, tb, m, n, k, alpha, beta,
                  seed);
}

TEST(CpuOpsTest, GemmAllTransposesNonSquareWithPadding) {
  auto dev = make_device();
  std::uint64_t seed = 1;
  for (DType dt : kDtypes) {
    for (bool ta : {false, true}) {
      for (bool tb : {false, true}) {
        for (float beta : {0.0f, 1.0f, 0.5f}) {
          check_gemm(dev->ops(), dt, ta, tb, 37, 29, 53, 1.25f, beta, seed++);
        }
      }
    }
  }
}

TEST(CpuOpsTest, GemmBf16LargerThanOneTile) {
  auto dev = make_device();
  check_gemm(dev->ops(), DType::kBF16, false, true, 530, 517, 523, 1.0f, 1.0f, 11);
  check_gemm(dev->ops(), DType::kBF16, true, false, 515, 40, 600, 0.5f, 0.0f, 12);
  // The same through a budget that fits no whole operand: 256-edge tiles in every dimension,
  // with partial tiles at the ends and C accumulated over the k tiles.
  const cpu::CpuContext ctx(2, sys::widest_simd_path());
  const auto tiled = [&ctx](const GemmArgs& g) { cpu::gemm_half_tiled(ctx, g, 1); };
  check_gemm_with(tiled, DType::kBF16, false, true, 530, 517, 523, 1.0f, 1.0f, 11);
  check_gemm_with(tiled, DType::kBF16, true, false, 515, 40, 600, 0.5f, 0.0f, 12);
  check_gemm_with(tiled, DType::kBF16, true, true, 300, 270, 700, -1.0f, 0.5f, 14);
  // f16 takes the same tiles, rounding to its own format.
  check_gemm(dev->ops(), DType::kF16, false, true, 530, 517, 523, 1.0f, 1.0f, 15);
  check_gemm_with(tiled, DType::kF16, true, true, 300, 270, 700, -1.0f, 0.5f, 16);
}

// The dtypes oneDNN's GEMM can run here: fp32 wherever this build has oneDNN (AVX2 or wider),
// bf16 where the CPU also has avx512_bf16 or AMX-BF16.
std::vector<DType> onednn_dtypes() {
  std::vector<DType> out;
  if (!STRATA_HAVE_ONEDNN) return out;
  out.push_back(DType::kF32);
  if (sys::cpu_supports_avx512_bf16() || sys::cpu_supports_amx_bf16()) out.push_back(DType::kBF16);
  return out;
}

// oneDNN's GEMM within the same bound as the other paths (in bf16: fp32 sums of exact bf16
// products), at several thread counts. Called directly, so a fallback to OpenBLAS fails.
TEST(CpuOpsTest, GemmOnOneDnnWithinTheBound) {
  if (onednn_dtypes().empty()) GTEST_SKIP() << "this build has no oneDNN";
  const cpu::OneDnnGemm dnnl;
  for (DType dt : onednn_dtypes()) {
    for (int threads : {1, 2, 3}) {
      SCOPED_TRACE("threads " + std::to_string(threads));
      const cpu::CpuContext ctx(threads, sys::widest_simd_path());
      const auto onednn = [&](const GemmArgs& g) { ASSERT_TRUE(cpu::gemm_onednn(ctx, dnnl, g)); };
      std::uint64_t seed = 100 * threads;
      for (bool ta : {false, true}) {
        for (bool tb : {false, true}) {
          for (float beta : {0.0f, 1.0f, 0.5f}) {
            check_gemm_with(onednn, dt, ta, tb, 37, 29, 53, 1.25f, beta, seed++);
            // Split into blocks of columns (n >= m) and of rows (m > n), the last one shorter.
            check_gemm_with(onednn, dt, ta, tb, 301, 650, 96, -0.5f, beta, seed++);
            check_gemm_with(onednn, dt, ta, tb, 700, 131, 64, 1.0f, beta, seed++);
          }
        }
      }
      // C larger than one block's fp32 scratch may be.
      check_gemm_with(onednn, dt, true, false, 2100, 1030, 24, 1.0f, 1.0f, seed++);
      check_gemm_with(onednn, dt, false, true, 1030, 2100, 24, 1.0f, 0.0f, seed++);
      // A row times a matrix, an outer product, a long inner dimension.
      check_gemm_with(onednn, dt, false, true, 1, 300, 257, 1.0f, 0.0f, seed++);
      check_gemm_with(onednn, dt, true, false, 300, 200, 1, 1.0f, 1.0f, seed++);
      check_gemm_with(onednn, dt, true, false, 64, 96, 4099, 1.0f, 1.0f, seed++);
    }
  }
}

// oneDNN's blocks follow the shape, not the thread count, so every thread count gives the same
// bits (fp32 training promises that across thread counts).
TEST(CpuOpsTest, GemmOnOneDnnGivesTheSameBitsOnAnyThreadCount) {
  if (onednn_dtypes().empty()) GTEST_SKIP() << "this build has no oneDNN";
  const cpu::OneDnnGemm dnnl;
  for (DType dt : onednn_dtypes()) {
    SCOPED_TRACE(dtype_name(dt));
    Rng rng(7);
    const std::int64_t m = 256, n = 1500, k = 700;
    HostTensor a(dt, m * k), b(dt, n * k), c0(dt, m * n);
    a.fill_uniform(rng, -1, 1);
    b.fill_uniform(rng, -1, 1);
    c0.fill_uniform(rng, -1, 1);
    std::optional<HostTensor> first;
    for (int threads : {1, 2, 3, 5}) {
      const cpu::CpuContext ctx(threads, sys::widest_simd_path());
      HostTensor c = c0;
      const GemmArgs g{.trans_b = true,
                       .m = m,
                       .n = n,
                       .k = k,
                       .a = a.data(),
                       .lda = k,
                       .b = b.data(),
                       .ldb = k,
                       .beta = 1.0f,
                       .c = c.data(),
                       .ldc = n,
                       .dtype = dt};
      ASSERT_TRUE(cpu::gemm_onednn(ctx, dnnl, g));
      if (!first) {
        first = c;
      } else {
        ASSERT_TRUE(c.bitwise_equal(*first)) << threads << " threads";
      }
    }
  }
}

// STRATA_CPU_GEMM picks the GEMMs' library; the device's name says when it is oneDNN, and an
// unknown value or one this CPU or build cannot run is an error naming the variable.
TEST(CpuOpsTest, StrataCpuGemmPicksTheLibrary) {
  DeviceOptions o;
  ::strata::testing::ScopedEnv env("STRATA_CPU_GEMM", "openblas");
  auto openblas = create_device(o);
  ASSERT_TRUE(openblas.is_ok()) << openblas.status().message();
  EXPECT_EQ((*openblas)->name().find("+onednn"), std::string::npos) << (*openblas)->name();
  env.set("mkl");
  auto bad = create_device(o);
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.status().message().find("STRATA_CPU_GEMM 'mkl'"), std::string::npos)
      << bad.status().message();
  env.set("onednn");
  auto forced = create_device(o);
  if (onednn_dtypes().size() == 2) {
    ASSERT_TRUE(forced.is_ok()) << forced.status().message();
    EXPECT_TRUE((*forced)->name().ends_with("+onednn")) << (*forced)->name();
  } else {
    ASSERT_FALSE(forced.is_ok());
    EXPECT_NE(forced.status().message().find("STRATA_CPU_GEMM=onednn"), std::string::npos)
        << forced.status().message();
  }
  // auto: bf16 on oneDNN exactly where the CPU has bf16 units.
  env.set("auto");
  auto chosen = cpu::resolve_cpu_gemm();
  ASSERT_TRUE(chosen.is_ok()) << chosen.status().message();
  EXPECT_EQ(chosen->bf16 == cpu::GemmLibrary::kOneDnn, onednn_dtypes().size() == 2);
}

TEST(CpuOpsTest, GemmF32LargeMatchesReference) {
  auto dev = make_device();
  check_gemm(dev->ops(), DType::kF32, true, false, 200, 130, 300, 1.0f, 1.0f, 13);
}

TEST(CpuOpsTest, GemmWithZeroInnerDimensionScalesC) {
  auto dev = make_device();
  for (DType dt : kDtypes) {
    check_gemm(dev->ops(), dt, false, false, 5, 6, 0, 1.0f, 0.0f, 21);
    check_gemm(dev->ops(), dt, false, false, 5, 6, 0, 1.0f, 0.5f, 22);
  }
}

// Both backends' gemm checks its arguments through check_gemm_args, naming itself.
TEST(CpuOpsTest, GemmRefusesNegativeSizesAndShortLeadingDimensions) {
  auto dev = make_device();
  std::vector<float> a(64), b(64), c(64);
  GemmArgs g;
  g.m = 4;
  g.n = 4;
  g.k = 4;
  g.a = a.data();
  g.b = b.data();
  g.c = c.data();
  g.lda = g.ldb = g.ldc = 4;
  dev->ops().gemm(g);  // well formed
  GemmArgs neg = g;
  neg.k = -1;
  EXPECT_DEATH(dev->ops().gemm(neg), "gemm: negative gemm size");
  GemmArgs lda = g;
  lda.trans_a = true;
  lda.m = 8;
  EXPECT_DEATH(dev->ops().gemm(lda), "gemm: gemm lda too small");
  GemmArgs ldc = g;
  ldc.ldc = 3;
  EXPECT_DEATH(check_gemm_args(ldc, "gemm (CUDA):"), "gemm \\(CUDA\\): gemm ldc too small");
}

// ---------------------------------------------------------------------------------------------
// Embedding

TEST(CpuOpsTest, EmbeddingForwardAndBackwardWithRepeatedIds) {
  auto dev = make_device();
  const auto& ops = dev->ops();
  for (DType dt : kDtypes) {
    for (std::int64_t dim : {13, 200}) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + " dim " + std::to_string(dim));
      Rng rng(3);
      const std::int64_t vocab = 11, rows = 9;
      const std::vector<std::int32_t> ids = {3, 0, 10, 3, 7, 3, 0, 5, 10};
      HostTensor table(dt, vocab * dim), out(dt, rows * dim);
      table.fill_uniform(rng, -1, 1);
      out.poison();
      ops.embedding_forward(ids.data(), rows, table.data(), dim, out.data(), dt);
      for (std::int64_t i = 0; i < rows; ++i) {
        for (std::int64_t j = 0; j < dim; ++j) {
          ASSERT_EQ(out.get(i * dim + j), table.get(ids[i] * dim + j));
        }
      }
      HostTensor dout(dt, rows * dim), dtable(dt, vocab * dim);
      dout.fill_uniform(rng, -1, 1);
      dtable.fill_uniform(rng, -1, 1);
      std::vector<double> want = dtable.values();
      std::vector<double> abs_sum(want.size()), uses(want.size(), 0.0);
      for (std::size_t e = 0; e < want.size(); ++e) abs_sum[e] = std::abs(want[e]);
      const auto dv = dout.values();
      for (std::int64_t i = 0; i < rows; ++i) {
        for (std::int64_t j = 0; j < dim; ++j) {
          const std::size_t e = static_cast<std::size_t>(ids[i] * dim + j);
          want[e] += dv[i * dim + j];
          abs_sum[e] += std::abs(dv[i * dim + j]);
          uses[e] += 1;
        }
      }
      ops.embedding_backward(ids.data(), rows, dout.data(), dim, dtable.data(), dt);
      // Each use of an id adds once to its row, rounded once (to f32, or to bf16 where every
      // partial sum is stored): at most uses * u_store * sum of |terms|.
      const double u_store = dt == DType::kF32 ? 0x1p-24 : 0x1p-8;
      std::vector<double> bound(want.size());
      for (std::size_t e = 0; e < want.size(); ++e) bound[e] = uses[e] * u_store * abs_sum[e];
      testing::expect_within("dtable", dtable.values(), want, bound);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// RMSNorm

struct RmsShape {
  std::int64_t rows, dim;
};
constexpr RmsShape kRmsShapes[] = {{7, 48}, {300, 1000}};

std::vector<double> rmsnorm_ref(const std::vector<double>& x, const std::vector<double>& w,
                                std::int64_t rows, std::int64_t dim, double eps,
                                std::vector<double>* rstd = nullptr) {
  std::vector<double> y(x.size());
  for (std::int64_t i = 0; i < rows; ++i) {
    double ss = 0;
    for (std::int64_t j = 0; j < dim; ++j) ss += x[i * dim + j] * x[i * dim + j];
    const double r = 1.0 / std::sqrt(ss / dim + eps);
    if (rstd) rstd->push_back(r);
    for (std::int64_t j = 0; j < dim; ++j) y[i * dim + j] = x[i * dim + j] * r * w[j];
  }
  return y;
}

TEST(CpuOpsTest, RmsnormForwardMatchesReference) {
  auto dev = make_device();
  for (DType dt : kDtypes) {
    for (const auto& s : kRmsShapes) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + " rows " + std::to_string(s.rows));
      Rng rng(5);
      HostTensor x(dt, s.rows * s.dim), w(dt, s.dim), out(dt, s.rows * s.dim);
      x.fill_uniform(rng, -2, 2);
      w.fill_uniform(rng, 0.5, 1.5);
      out.poison();
      std::vector<float> rstd(static_cast<std::size_t>(s.rows), NAN);
      const float eps = 1e-5f;
      dev->ops().rmsnorm_forward(x.data(), w.data(), out.data(), rstd.data(), s.rows, s.dim, eps,
                                 dt);
      std::vector<double> want_rstd;
      const auto want = rmsnorm_ref(x.values(), w.values(), s.rows, s.dim, eps, &want_rstd);
      // rstd = 1 / sqrt(sum x^2 / dim + eps): half the f32 sum's relative error, plus the
      // division, square root and reciprocal; out = x * rstd * w adds two products and, in
      // bf16, the output's rounding.
      const double rstd_rel = 0.5 * testing::f32_sum_error(s.dim) + 3 * 0x1p-24;
      const double u_out = dt == DType::kF32 ? 0x1p-24 : 0x1p-8;
      std::vector<double> out_bound(want.size()), rstd_bound(want_rstd.size());
      for (std::size_t e = 0; e < want.size(); ++e) {
        out_bound[e] = (rstd_rel + 2 * 0x1p-24) * std::abs(want[e]) + u_out * std::abs(want[e]);
      }
      for (std::size_t r = 0; r < want_rstd.size(); ++r) rstd_bound[r] = rstd_rel * want_rstd[r];
      testing::expect_within("out", out.values(), want, out_bound);
      testing::expect_within("rstd", std::vector<double>(rstd.begin(), rstd.end()), want_rstd,
                             rstd_bound);
    }
  }
}

TEST(CpuOpsTest, RmsnormBackwardMatchesFiniteDifferences) {
  auto dev = make_device();
  for (DType dt : kDtypes) {
    for (const auto& s : kRmsShapes) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + " rows " + std::to_string(s.rows));
      const bool small = s.rows * s.dim < 1000;
      Rng rng(6);
      const std::int64_t n = s.rows * s.dim;
      HostTensor x(dt, n), w(dt, s.dim), out(dt, n), dout(dt, n), dx(dt, n), dw(dt, s.dim);
      x.fill_uniform(rng, -2, 2);
      w.fill_uniform(rng, 0.5, 1.5);
      dout.fill_uniform(rng, -1, 1);
      dw.fill_uniform(rng, -1, 1);  // accumulated into
      dx.poison();
      const float eps = 1e-5f;
      std::vector<float> rstd(static_cast<std::size_t>(s.rows));
      dev->ops().rmsnorm_forward(x.data(), w.data(), out.data(), rstd.data(), s.rows, s.dim, eps,
                                 dt);
      const auto dw0 = dw.values();
      dev->ops().rmsnorm_backward(dout.data(), x.data(), w.data(), rstd.data(), dx.data(),
                                  dw.data(), s.rows, s.dim, dt);
      const auto xv = x.values(), wv = w.values(), gv = dout.values();
      // Analytic double reference; on the small shape it is itself checked by differences.
      // Bounds: dx = r g w - x r^3 d / dim with d = sum_j g w x (an f32 sum of dim terms) and r
      // the forward's f32 rstd (relative error rstd_rel, as in the forward test); dw_j sums
      // rows products g x r in f32 and is stored next to its initial value.
      constexpr double kU = 0x1p-24;
      const double u_out = dt == DType::kF32 ? kU : 0x1p-8;
      const double rstd_rel = 0.5 * testing::f32_sum_error(s.dim) + 3 * kU;
      std::vector<double> want_dx(xv.size()), want_dw(wv.size(), 0.0);
      std::vector<double> dx_bound(xv.size()), dw_abs(wv.size(), 0.0);
      for (std::int64_t i = 0; i < s.rows; ++i) {
        double ss = 0, d = 0, d_abs = 0;
        for (std::int64_t j = 0; j < s.dim; ++j) ss += xv[i * s.dim + j] * xv[i * s.dim + j];
        const double r = 1.0 / std::sqrt(ss / s.dim + eps);
        for (std::int64_t j = 0; j < s.dim; ++j) {
          d += gv[i * s.dim + j] * wv[j] * xv[i * s.dim + j];
          d_abs += std::abs(gv[i * s.dim + j] * wv[j] * xv[i * s.dim + j]);
        }
        for (std::int64_t j = 0; j < s.dim; ++j) {
          const std::int64_t e = i * s.dim + j;
          const double t1 = r * gv[e] * wv[j], t2 = xv[e] * r * r * r * d / s.dim;
          want_dx[e] = t1 - t2;
          want_dw[j] += gv[e] * xv[e] * r;
          dw_abs[j] += std::abs(gv[e] * xv[e] * r);
          dx_bound[e] =
              std::abs(t1) * (rstd_rel + 3 * kU) + std::abs(t2) * (3 * rstd_rel + 4 * kU) +
              std::abs(xv[e] * r * r * r / s.dim) * testing::f32_sum_error(s.dim) * d_abs +
              u_out * std::abs(want_dx[e]);
        }
      }
      std::vector<double> dw_bound(wv.size());
      for (std::size_t j = 0; j < wv.size(); ++j) {
        dw_bound[j] = (testing::f32_sum_error(s.rows) + rstd_rel + 2 * kU) * dw_abs[j] +
                      u_out * std::abs(dw0[j] + want_dw[j]);
      }
      if (small) {
        auto loss_x = [&](const std::vector<double>& xx) {
          return testing::dot(gv, rmsnorm_ref(xx, wv, s.rows, s.dim, eps));
        };
        auto loss_w = [&](const std::vector<double>& ww) {
          return testing::dot(gv, rmsnorm_ref(xv, ww, s.rows, s.dim, eps));
        };
        expect_close("reference dx", testing::numeric_grad(loss_x, xv), want_dx, 1e-6);
        expect_close("reference dw", testing::numeric_grad(loss_w, wv), want_dw, 1e-6);
      }
      std::vector<double> got_dw = dw.values();
      for (std::size_t j = 0; j < got_dw.size(); ++j) got_dw[j] -= dw0[j];
      testing::expect_within("dx", dx.values(), want_dx, dx_bound);
      // bf16 dw is stored rounded next to the O(1) initial value it was added to.
      testing::expect_within("dw", got_dw, want_dw, dw_bound);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// RoPE

// Rotation by (p + offset) * inv_freq(j): the frequencies as RopeParams defines them (checked
// against transformers' formulas by the model golden tests), the rotation independently here.
std::vector<double> rope_ref(const std::vector<double>& x, std::int64_t batch, std::int64_t seq,
                             std::int64_t heads, std::int64_t hd, const RopeParams& rope,
                             bool inverse) {
  std::vector<double> y(x.size());
  const std::int64_t half = hd / 2;
  for (std::int64_t b = 0; b < batch; ++b) {
    for (std::int64_t p = 0; p < seq; ++p) {
      for (std::int64_t h = 0; h < heads; ++h) {
        const std::int64_t base = ((b * seq + p) * heads + h) * hd;
        for (std::int64_t j = 0; j < half; ++j) {
          const double angle = static_cast<double>(p + rope.position_offset) * rope.inv_freq(j, hd);
          const double c = std::cos(angle), s = inverse ? -std::sin(angle) : std::sin(angle);
          const double x1 = x[base + j], x2 = x[base + j + half];
          y[base + j] = x1 * c - x2 * s;
          y[base + j + half] = x2 * c + x1 * s;
        }
      }
    }
  }
  return y;
}

TEST(CpuOpsTest, RopeForwardInverseAndTranspose) {
  auto dev = make_device();
  const std::int64_t batch = 2, seq = 37, heads = 3, hd = 16, n = batch * seq * heads * hd;
  for (DType dt : kDtypes) {
    RopeParams llama3{500000.0, {RopeScaling::kLlama3, 8.0, 1.0, 4.0, 64.0}, 0};
    RopeParams linear{10000.0, {RopeScaling::kLinear, 4.0}, 0};
    RopeParams offset{10000.0, {}, 1000};  // decoding past a prompt
    for (const RopeParams& rope :
         {RopeParams{10000.0}, RopeParams{500.0}, llama3, linear, offset}) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + " theta " + std::to_string(rope.theta) +
                   " scaling " + std::to_string(static_cast<int>(rope.scaling.type)) + " offset " +
                   std::to_string(rope.position_offset));
      Rng rng(7);
      HostTensor x(dt, n);
      x.fill_uniform(rng, -1, 1);
      const auto xv = x.values();
      for (bool inverse : {false, true}) {
        HostTensor y = x;
        dev->ops().rope(y.data(), batch, seq, heads, hd, rope, inverse, dt);
        expect_close(inverse ? "inverse" : "forward", y.values(),
                     rope_ref(xv, batch, seq, heads, hd, rope, inverse), tolerance(dt));
      }
      // inverse(forward(x)) = x, i.e. the inverse is the transpose of an orthogonal map.
      HostTensor y = x;
      dev->ops().rope(y.data(), batch, seq, heads, hd, rope, false, dt);
      dev->ops().rope(y.data(), batch, seq, heads, hd, rope, true, dt);
      expect_close("round trip", y.values(), xv, dt == DType::kF32 ? 1e-5 : 2e-2);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// SwiGLU and add

TEST(CpuOpsTest, Llama3RopeScalingKeepsHighFrequenciesAndDividesLowOnes) {
  // Llama 3.1's parameters: factor 8, low 1, high 4, original context 8192.
  const RopeParams r{500000.0, {RopeScaling::kLlama3, 8.0, 1.0, 4.0, 8192.0}, 0};
  const RopeParams plain{500000.0};
  const std::int64_t hd = 128;
  const double pi = 3.14159265358979323846;
  int kept = 0, divided = 0, blended = 0;
  for (std::int64_t j = 0; j < hd / 2; ++j) {
    const double f = plain.inv_freq(j, hd);
    const double wavelen = 2 * pi / f;
    if (wavelen < 8192.0 / 4) {
      EXPECT_EQ(r.inv_freq(j, hd), f) << j;
      ++kept;
    } else if (wavelen > 8192.0) {
      EXPECT_DOUBLE_EQ(r.inv_freq(j, hd), f / 8) << j;
      ++divided;
    } else {
      EXPECT_LT(r.inv_freq(j, hd), f) << j;
      EXPECT_GT(r.inv_freq(j, hd), f / 8) << j;
      ++blended;
    }
  }
  EXPECT_GT(kept, 0);
  EXPECT_GT(divided, 0);
  EXPECT_GT(blended, 0);
}

TEST(CpuOpsTest, BiasAddAndGradient) {
  auto dev = make_device();
  for (DType dt : kDtypes) {
    for (auto [rows, cols] : {std::pair<std::int64_t, std::int64_t>{1, 5}, {37, 24}, {300, 96}}) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + " " + std::to_string(rows) + "x" +
                   std::to_string(cols));
      Rng rng(11);
      HostTensor x(dt, rows * cols), b(dt, cols), db(dt, cols);
      x.fill_uniform(rng, -1, 1);
      b.fill_uniform(rng, -1, 1);
      db.fill_uniform(rng, -1, 1);
      const auto xv = x.values(), bv = b.values(), db0 = db.values();
      std::vector<double> want(xv.size()), want_db(db0), abs_sum(db0.size());
      for (std::int64_t c = 0; c < cols; ++c) abs_sum[c] = std::abs(db0[c]);
      for (std::int64_t r = 0; r < rows; ++r) {
        for (std::int64_t c = 0; c < cols; ++c) {
          want[r * cols + c] = xv[r * cols + c] + bv[c];
          want_db[c] += xv[r * cols + c];
          abs_sum[c] += std::abs(xv[r * cols + c]);
        }
      }
      dev->ops().bias_grad(x.data(), db.data(), rows, cols, dt);
      // An f32 sum of rows + 1 terms (gamma(rows + 1) of the sum of their magnitudes), then one
      // rounding to the dtype.
      const double u = std::ldexp(1.0, -24), n = static_cast<double>(rows + 1);
      const double out_u = dt == DType::kF32 ? u : std::ldexp(1.0, -8);
      std::vector<double> bound(want_db.size());
      for (std::size_t c = 0; c < bound.size(); ++c) {
        bound[c] = n * u / (1 - n * u) * abs_sum[c] + out_u * std::abs(want_db[c]);
      }
      testing::expect_within("bias_grad", db.values(), want_db, bound);
      dev->ops().add_bias(x.data(), b.data(), rows, cols, dt);
      expect_close("add_bias", x.values(), want, tolerance(dt));
    }
  }
}

TEST(CpuOpsTest, SwigluForwardAndBackward) {
  auto dev = make_device();
  const std::int64_t n = 100003;
  for (DType dt : kDtypes) {
    SCOPED_TRACE(dtype_name(dt));
    Rng rng(8);
    HostTensor gate(dt, n), up(dt, n), out(dt, n), dout(dt, n), dgate(dt, n), dup(dt, n);
    gate.fill_uniform(rng, -6, 6);
    up.fill_uniform(rng, -2, 2);
    dout.fill_uniform(rng, -1, 1);
    out.poison();
    dgate.poison();
    dup.poison();
    dev->ops().swiglu_forward(gate.data(), up.data(), out.data(), n, dt);
    dev->ops().swiglu_backward(dout.data(), gate.data(), up.data(), dgate.data(), dup.data(), n,
                               dt);
    const auto g = gate.values(), u = up.values(), d = dout.values();
    std::vector<double> want(n), want_dg(n), want_du(n);
    auto silu = [](double v) { return v / (1 + std::exp(-v)); };
    for (std::int64_t i = 0; i < n; ++i) {
      want[i] = silu(g[i]) * u[i];
      // Central difference in double: checks the derivative formula, not just its transcription.
      const double h = 1e-6;
      want_dg[i] = d[i] * u[i] * (silu(g[i] + h) - silu(g[i] - h)) / (2 * h);
      want_du[i] = d[i] * silu(g[i]);
    }
    expect_close("out", out.values(), want, tolerance(dt));
    expect_close("dgate", dgate.values(), want_dg, dt == DType::kF32 ? 1e-5 : 1e-2);
    expect_close("dup", dup.values(), want_du, tolerance(dt));
  }
}

TEST(CpuOpsTest, AddIncludingInPlace) {
  auto dev = make_device();
  const std::int64_t n = 70001;
  for (DType dt : kDtypes) {
    Rng rng(9);
    HostTensor a(dt, n), b(dt, n), out(dt, n);
    a.fill_uniform(rng, -1, 1);
    b.fill_uniform(rng, -1, 1);
    out.poison();
    std::vector<double> want(n);
    const auto av = a.values(), bv = b.values();
    for (std::int64_t i = 0; i < n; ++i) want[i] = av[i] + bv[i];
    dev->ops().add(a.data(), b.data(), out.data(), n, dt);
    expect_close("add", out.values(), want, tolerance(dt));
    dev->ops().add(a.data(), b.data(), a.data(), n, dt);
    EXPECT_TRUE(a.bitwise_equal(out));
  }
}

// Dropout: the mask is the documented function of (key, index), kept elements scaled by
// 1 / (1 - p) in f32, the dropped fraction near p, in place the same, and the null weight
// gradient of rmsnorm_backward touches nothing.
TEST(CpuOpsTest, DropoutKeepsTheDocumentedMask) {
  auto dev = make_device();
  const std::int64_t n = 100003;
  const float p = 0.25f;
  const std::uint64_t key = 0x1234567887654321ull;
  for (DType dt : kDtypes) {
    Rng rng(11);
    HostTensor x(dt, n), out(dt, n);
    x.fill_uniform(rng, 0.5, 1.5);  // never 0, so a zero output means dropped
    out.poison();
    dev->ops().dropout(x.data(), out.data(), DropoutBlock::flat(n), p, key, dt);
    const auto xv = x.values(), ov = out.values();
    const std::uint32_t threshold = dropout_threshold(p);
    EXPECT_EQ(threshold, 4194304u);  // 0.25 * 2^24
    std::int64_t dropped = 0;
    for (std::int64_t i = 0; i < n; ++i) {
      const bool keep = static_cast<std::uint32_t>(splitmix64_at(key, i) >> 40) >= threshold;
      ASSERT_EQ(keep, dropout_keeps(key, i, threshold));
      HostTensor one(dt, 1);
      one.set(0, keep ? static_cast<float>(xv[i]) * (1.0f / (1.0f - p)) : 0.0f);
      ASSERT_EQ(ov[i], one.values()[0]) << i;
      dropped += keep ? 0 : 1;
    }
    // Binomial(n, p): within 6 standard deviations.
    EXPECT_NEAR(static_cast<double>(dropped), p * n, 6 * std::sqrt(n * p * (1 - p)));
    dev->ops().dropout(x.data(), x.data(), DropoutBlock::flat(n), p, key, dt);  // in place
    EXPECT_TRUE(x.bitwise_equal(out));
  }
}

// A block of a matrix's columns (a row-parallel layer's slice of its input) takes the whole
// matrix's mask at its columns: every rank's slice together is the whole's dropout.
TEST(CpuOpsTest, DropoutOfAColumnBlockIsTheWholeMatricesAtItsColumns) {
  auto dev = make_device();
  const std::int64_t rows = 37, full = 96;
  const float p = 0.3f;
  const std::uint64_t key = 0xfeedfacecafebeefull;
  for (DType dt : kDtypes) {
    Rng rng(13);
    HostTensor x(dt, rows * full), whole(dt, rows * full);
    x.fill_uniform(rng, 0.5, 1.5);
    dev->ops().dropout(x.data(), whole.data(), DropoutBlock::flat(rows * full), p, key, dt);
    const auto xv = x.values(), wv = whole.values();
    for (const std::int64_t parts : {2, 3, 4}) {
      const std::int64_t cols = full / parts;
      for (std::int64_t part = 0; part < parts; ++part) {
        HostTensor slice(dt, rows * cols), out(dt, rows * cols);
        for (std::int64_t r = 0; r < rows; ++r) {
          for (std::int64_t c = 0; c < cols; ++c) {
            slice.set(r * cols + c, static_cast<float>(xv[r * full + part * cols + c]));
          }
        }
        out.poison();
        dev->ops().dropout(slice.data(), out.data(), DropoutBlock{rows, cols, full, part * cols}, p,
                           key, dt);
        const auto ov = out.values();
        for (std::int64_t r = 0; r < rows; ++r) {
          for (std::int64_t c = 0; c < cols; ++c) {
            ASSERT_EQ(ov[r * cols + c], wv[r * full + part * cols + c])
                << "row " << r << ", column " << part * cols + c << " of " << parts << " parts";
          }
        }
      }
    }
  }
}

TEST(CpuOpsTest, RmsnormBackwardWithoutWeightGradient) {
  auto dev = make_device();
  const std::int64_t rows = 33, dim = 40;
  Rng rng(3);
  HostTensor x(DType::kF32, rows * dim), dy(DType::kF32, rows * dim), w(DType::kF32, dim);
  x.fill_uniform(rng, -1, 1);
  dy.fill_uniform(rng, -1, 1);
  w.fill_uniform(rng, 0.5, 1.5);
  HostTensor y(DType::kF32, rows * dim), dx1(DType::kF32, rows * dim), dx2(DType::kF32, rows * dim),
      dw(DType::kF32, dim);
  std::vector<float> rstd(rows);
  dev->ops().rmsnorm_forward(x.data(), w.data(), y.data(), rstd.data(), rows, dim, 1e-5f,
                             DType::kF32);
  dw.fill_uniform(rng, -1, 1);
  dev->ops().rmsnorm_backward(dy.data(), x.data(), w.data(), rstd.data(), dx1.data(), dw.data(),
                              rows, dim, DType::kF32);
  dev->ops().rmsnorm_backward(dy.data(), x.data(), w.data(), rstd.data(), dx2.data(), nullptr, rows,
                              dim, DType::kF32);
  EXPECT_TRUE(dx1.bitwise_equal(dx2));
}

}  // namespace
}  // namespace strata::device
