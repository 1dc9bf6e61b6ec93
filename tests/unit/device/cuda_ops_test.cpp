// CUDA op table against the CPU backend on random data: GEMM (every transpose, padded leading
// dimensions, beta), embedding, RMSNorm, RoPE, SwiGLU, add and cast, forward and backward.
// GPU outputs are poisoned (NaN) before each op so that an unwritten element fails.
#include "strata/build_config.h"
#if STRATA_HAVE_CUDA

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "tests/unit/device/cuda_test_util.h"

namespace strata::device {
namespace {

using testing::as_doubles;
using testing::download_array;
using testing::expect_close;
using testing::GpuTensor;
using testing::HostTensor;
using testing::tolerance;
using testing::upload_array;

constexpr DType kDtypes[] = {DType::kF32, DType::kBF16};

std::string trace(DType dt, const std::string& what) {
  return std::string(dtype_name(dt)) + " " + what;
}

class CudaOpsTest : public testing::GpuTest {
 protected:
  void check_gemm(DType dt, bool ta, bool tb, std::int64_t m, std::int64_t n, std::int64_t k,
                  float alpha, float beta, std::uint64_t seed) {
    SCOPED_TRACE(trace(dt, "ta=" + std::to_string(ta) + " tb=" + std::to_string(tb) +
                               " beta=" + std::to_string(beta) + " m,n,k=" + std::to_string(m) +
                               "," + std::to_string(n) + "," + std::to_string(k)));
    Rng rng(seed);
    const std::int64_t a_rows = ta ? k : m, a_cols = ta ? m : k, lda = a_cols + 3;
    const std::int64_t b_rows = tb ? n : k, b_cols = tb ? k : n, ldb = b_cols + 5;
    const std::int64_t ldc = n + 2;
    HostTensor a(dt, a_rows * lda), b(dt, b_rows * ldb), c(dt, m * ldc);
    a.fill_uniform(rng, -1, 1);
    b.fill_uniform(rng, -1, 1);
    c.fill_uniform(rng, -1, 1);
    for (std::int64_t i = 0; i < m; ++i) {
      for (std::int64_t j = n; j < ldc; ++j) c.set(i * ldc + j, 7.0);  // padding: untouched
      if (beta == 0.0f) {
        for (std::int64_t j = 0; j < n; ++j) c.set(i * ldc + j, NAN);  // must not be read
      }
    }
    GpuTensor ga(*gpu_, a), gb(*gpu_, b), gc(*gpu_, c);
    GemmArgs g;
    g.trans_a = ta;
    g.trans_b = tb;
    g.m = m;
    g.n = n;
    g.k = k;
    g.alpha = alpha;
    g.lda = lda;
    g.ldb = ldb;
    g.beta = beta;
    g.ldc = ldc;
    g.dtype = dt;
    GemmArgs cg = g;
    cg.a = a.data();
    cg.b = b.data();
    cg.c = c.data();
    cpu_ops().gemm(cg);
    g.a = ga.data();
    g.b = gb.data();
    g.c = gc.data();
    gpu_ops().gemm(g);
    expect_close("gemm", gc.download().values(), c.values(), tolerance(dt));
  }

  void check_rmsnorm(DType dt, std::int64_t rows, std::int64_t dim) {
    SCOPED_TRACE(trace(dt, "rows " + std::to_string(rows) + " dim " + std::to_string(dim)));
    Rng rng(5 + rows);
    const std::int64_t n = rows * dim;
    HostTensor x(dt, n), w(dt, dim), out(dt, n), dout(dt, n), dx(dt, n), dw(dt, dim);
    x.fill_uniform(rng, -2, 2);
    w.fill_uniform(rng, 0.5, 1.5);
    dout.fill_uniform(rng, -1, 1);
    dw.fill_uniform(rng, -1, 1);  // accumulated into
    const float eps = 1e-5f;
    GpuTensor gx(*gpu_, x), gw(*gpu_, w), gout(*gpu_, dt, n), gdout(*gpu_, dout), gdx(*gpu_, dt, n),
        gdw(*gpu_, dw);
    gout.poison();
    gdx.poison();
    std::vector<float> rstd(static_cast<std::size_t>(rows));
    DeviceBuffer grstd = testing::poisoned_floats(*gpu_, rstd.size());
    cpu_ops().rmsnorm_forward(x.data(), w.data(), out.data(), rstd.data(), rows, dim, eps, dt);
    gpu_ops().rmsnorm_forward(gx.data(), gw.data(), gout.data(), grstd.as<float>(), rows, dim, eps,
                              dt);
    expect_close("out", gout.download().values(), out.values(), tolerance(dt));
    expect_close("rstd", as_doubles(download_array<float>(*gpu_, grstd, rstd.size())),
                 as_doubles(rstd), 1e-5);
    // Backward from the same rstd on both sides.
    cpu_ops().rmsnorm_backward(dout.data(), x.data(), w.data(), rstd.data(), dx.data(), dw.data(),
                               rows, dim, dt);
    gpu_ops().rmsnorm_backward(gdout.data(), gx.data(), gw.data(), grstd.as<float>(), gdx.data(),
                               gdw.data(), rows, dim, dt);
    expect_close("dx", gdx.download().values(), dx.values(), tolerance(dt));
    expect_close("dw", gdw.download().values(), dw.values(), tolerance(dt));
  }
};

TEST_F(CudaOpsTest, GemmAllTransposesBetasAndPaddedLayouts) {
  std::uint64_t seed = 1;
  for (DType dt : kDtypes) {
    for (bool ta : {false, true}) {
      for (bool tb : {false, true}) {
        for (float beta : {0.0f, 1.0f, 0.5f})
          check_gemm(dt, ta, tb, 37, 29, 53, 1.25f, beta, seed++);
      }
    }
  }
}

TEST_F(CudaOpsTest, GemmModelShapes) {
  // The model's three products: y = x W^T, dX = dY W, dW += dY^T X.
  for (DType dt : kDtypes) {
    check_gemm(dt, false, true, 512, 384, 256, 1.0f, 0.0f, 11);
    check_gemm(dt, false, false, 512, 256, 384, 1.0f, 1.0f, 12);
    check_gemm(dt, true, false, 384, 256, 512, 1.0f, 1.0f, 13);
  }
}

TEST_F(CudaOpsTest, GemmWithEmptyInnerDimensionScalesC) {
  for (DType dt : kDtypes) {
    check_gemm(dt, false, false, 5, 6, 0, 1.0f, 0.0f, 21);
    check_gemm(dt, false, false, 5, 6, 0, 1.0f, 0.5f, 22);
  }
}

TEST_F(CudaOpsTest, EmbeddingForwardAndBackwardWithRepeatedIds) {
  for (DType dt : kDtypes) {
    for (std::int64_t dim : {13, 200, 2048}) {
      SCOPED_TRACE(trace(dt, "dim " + std::to_string(dim)));
      Rng rng(3);
      const std::int64_t vocab = 1000, rows = 600;
      std::vector<std::int32_t> ids(rows);
      for (auto& id : ids) id = static_cast<std::int32_t>(rng.uniform_int(40));  // many repeats
      ids[7] = vocab - 1;
      HostTensor table(dt, vocab * dim), out(dt, rows * dim), dout(dt, rows * dim),
          dtable(dt, vocab * dim);
      table.fill_uniform(rng, -1, 1);
      dout.fill_uniform(rng, -1, 1);
      dtable.fill_uniform(rng, -1, 1);
      DeviceBuffer gids = upload_array(*gpu_, ids);
      GpuTensor gtable(*gpu_, table), gout(*gpu_, dt, rows * dim), gdout(*gpu_, dout),
          gdtable(*gpu_, dtable);
      gout.poison();
      cpu_ops().embedding_forward(ids.data(), rows, table.data(), dim, out.data(), dt);
      gpu_ops().embedding_forward(gids.as<std::int32_t>(), rows, gtable.data(), dim, gout.data(),
                                  dt);
      EXPECT_TRUE(gout.download().bitwise_equal(out));
      cpu_ops().embedding_backward(ids.data(), rows, dout.data(), dim, dtable.data(), dt);
      gpu_ops().embedding_backward(gids.as<std::int32_t>(), rows, gdout.data(), dim, gdtable.data(),
                                   dt);
      const HostTensor got = gdtable.download();
      if (dt == DType::kF32) {
        // Same additions in the same (row) order: bit-identical.
        EXPECT_TRUE(got.bitwise_equal(dtable));
      } else {
        // The CPU rounds to bf16 after every add, the GPU once per id.
        expect_close("dtable", got.values(), dtable.values(), tolerance(dt));
      }
    }
  }
}

TEST_F(CudaOpsTest, RmsnormForwardAndBackward) {
  for (DType dt : kDtypes) {
    check_rmsnorm(dt, 7, 48);
    check_rmsnorm(dt, 300, 1000);
    check_rmsnorm(dt, 37, 2047);    // no 16-byte vectors
    check_rmsnorm(dt, 2100, 2048);  // several rows per backward chunk
  }
}

TEST_F(CudaOpsTest, RopeForwardAndInverse) {
  struct Shape {
    std::int64_t batch, seq, heads, hd;
  };
  for (DType dt : kDtypes) {
    for (const Shape& s : {Shape{2, 37, 3, 16}, Shape{1, 300, 4, 128}, Shape{2, 9, 2, 8}}) {
      for (double theta : {10000.0, 500.0}) {
        for (bool inverse : {false, true}) {
          SCOPED_TRACE(trace(dt, "hd " + std::to_string(s.hd) + " theta " + std::to_string(theta) +
                                     " inverse " + std::to_string(inverse)));
          Rng rng(7);
          HostTensor x(dt, s.batch * s.seq * s.heads * s.hd);
          x.fill_uniform(rng, -1, 1);
          GpuTensor gx(*gpu_, x);
          cpu_ops().rope(x.data(), s.batch, s.seq, s.heads, s.hd, static_cast<float>(theta),
                         inverse, dt);
          gpu_ops().rope(gx.data(), s.batch, s.seq, s.heads, s.hd, static_cast<float>(theta),
                         inverse, dt);
          expect_close("rope", gx.download().values(), x.values(), tolerance(dt));
        }
      }
    }
  }
}

TEST_F(CudaOpsTest, SwigluForwardAndBackward) {
  for (DType dt : kDtypes) {
    for (std::int64_t n : {100003, 64}) {
      SCOPED_TRACE(trace(dt, "n " + std::to_string(n)));
      Rng rng(8);
      HostTensor gate(dt, n), up(dt, n), out(dt, n), dout(dt, n), dgate(dt, n), dup(dt, n);
      gate.fill_uniform(rng, -6, 6);
      up.fill_uniform(rng, -2, 2);
      dout.fill_uniform(rng, -1, 1);
      GpuTensor ggate(*gpu_, gate), gup(*gpu_, up), gout(*gpu_, dt, n), gdout(*gpu_, dout),
          gdgate(*gpu_, dt, n), gdup(*gpu_, dt, n);
      for (GpuTensor* t : {&gout, &gdgate, &gdup}) t->poison();
      cpu_ops().swiglu_forward(gate.data(), up.data(), out.data(), n, dt);
      cpu_ops().swiglu_backward(dout.data(), gate.data(), up.data(), dgate.data(), dup.data(), n,
                                dt);
      gpu_ops().swiglu_forward(ggate.data(), gup.data(), gout.data(), n, dt);
      gpu_ops().swiglu_backward(gdout.data(), ggate.data(), gup.data(), gdgate.data(), gdup.data(),
                                n, dt);
      expect_close("out", gout.download().values(), out.values(), tolerance(dt));
      expect_close("dgate", gdgate.download().values(), dgate.values(), tolerance(dt));
      expect_close("dup", gdup.download().values(), dup.values(), tolerance(dt));
    }
  }
}

TEST_F(CudaOpsTest, AddIsExactIncludingInPlaceAndUnaligned) {
  for (DType dt : kDtypes) {
    const std::int64_t n = 70001;
    Rng rng(9);
    HostTensor a(dt, n + 1), b(dt, n + 1), out(dt, n + 1);
    a.fill_uniform(rng, -1, 1);
    b.fill_uniform(rng, -1, 1);
    cpu_ops().add(a.data(), b.data(), out.data(), n + 1, dt);
    GpuTensor ga(*gpu_, a), gb(*gpu_, b), gout(*gpu_, dt, n + 1);
    gout.poison();
    gpu_ops().add(ga.data(), gb.data(), gout.data(), n + 1, dt);
    EXPECT_TRUE(gout.download().bitwise_equal(out));            // one rounding of the same sum
    gpu_ops().add(ga.data(), gb.data(), ga.data(), n + 1, dt);  // out aliases a
    EXPECT_TRUE(ga.download().bitwise_equal(out));
    // Offset by one element: the scalar path.
    GpuTensor gb2(*gpu_, b), gout2(*gpu_, dt, n + 1);
    gout2.poison();
    const std::size_t es = dtype_size(dt);
    gpu_ops().add(static_cast<std::byte*>(gb2.data()) + es,
                  static_cast<std::byte*>(gb2.data()) + es,
                  static_cast<std::byte*>(gout2.data()) + es, n, dt);
    HostTensor want(dt, n + 1);
    cpu_ops().add(static_cast<std::byte*>(b.data()) + es, static_cast<std::byte*>(b.data()) + es,
                  static_cast<std::byte*>(want.data()) + es, n, dt);
    const HostTensor got = gout2.download();
    for (std::int64_t i = 1; i <= n; i += 97) ASSERT_EQ(got.get(i), want.get(i)) << i;
  }
}

TEST_F(CudaOpsTest, CastsRoundLikeTheHost) {
  const DType types[] = {DType::kF32, DType::kBF16, DType::kF16};
  for (DType from : types) {
    for (DType to : types) {
      SCOPED_TRACE(std::string(dtype_name(from)) + " -> " + std::string(dtype_name(to)));
      const std::int64_t n = 100003;
      Rng rng(10);
      HostTensor src(from, n), dst(to, n);
      src.fill_uniform(rng, -3, 3);
      for (std::int64_t i = 0; i < 64; ++i) src.set(i, std::ldexp(src.get(i), -20));  // tiny
      cpu_ops().cast(src.data(), from, dst.data(), to, n);
      GpuTensor gsrc(*gpu_, src), gdst(*gpu_, to, n);
      gdst.poison();
      gpu_ops().cast(gsrc.data(), from, gdst.data(), to, n);
      EXPECT_TRUE(gdst.download().bitwise_equal(dst));
    }
  }
}

}  // namespace
}  // namespace strata::device

#endif  // STRATA_HAVE_CUDA
