// CUDA op table against the CPU backend on random data: GEMM (every transpose, padded leading
// dimensions, beta), embedding, RMSNorm, RoPE (with frequency scaling and position offsets),
// SwiGLU, add, bias add and gradient, and cast, forward and backward; and sliding-window
// attention, both kernels, against the double-precision reference within the attention test's
// derived bounds (attention_reference.h; the CPU backend's too, so both backends agree); and the
// mixture-of-experts routing and row ops.
// GPU outputs are poisoned (NaN) before each op so that an unwritten element fails.
#include "strata/build_config.h"
#if STRATA_HAVE_CUDA

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "kernels/runtime.h"
#include "strata/device/nf4.h"
#include "tests/unit/device/attention_reference.h"
#include "tests/unit/device/cuda_test_util.h"

namespace strata::device {
namespace {

using testing::as_doubles;
using testing::download_array;
using testing::expect_close;
using testing::expect_within;
using testing::f32_sum_error;
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
      // The GPU's contract: per id, the table's value plus its rows' gradients in row order,
      // added in fp32, rounded to the storage type once.
      HostTensor want = dtable;
      for (std::int64_t c = 0; c < dim; ++c) {
        std::vector<float> acc(static_cast<std::size_t>(vocab));
        std::vector<bool> seen(static_cast<std::size_t>(vocab), false);
        for (std::int64_t i = 0; i < rows; ++i) {
          const auto id = static_cast<std::size_t>(ids[static_cast<std::size_t>(i)]);
          if (!seen[id])
            acc[id] = static_cast<float>(dtable.get(static_cast<std::int64_t>(id) * dim + c));
          seen[id] = true;
          acc[id] += static_cast<float>(dout.get(i * dim + c));
        }
        for (std::size_t id = 0; id < acc.size(); ++id) {
          if (seen[id]) want.set(static_cast<std::int64_t>(id) * dim + c, acc[id]);
        }
      }
      // For f32 that is also the CPU backend's result (the same additions in the same order).
      if (dt == DType::kF32) {
        cpu_ops().embedding_backward(ids.data(), rows, dout.data(), dim, dtable.data(), dt);
        EXPECT_TRUE(want.bitwise_equal(dtable));
      }
      gpu_ops().embedding_backward(gids.as<std::int32_t>(), rows, gdout.data(), dim, gdtable.data(),
                                   dt);
      // The same fp32 operations in the same order, then one round-to-nearest: bit-identical.
      EXPECT_TRUE(gdtable.download().bitwise_equal(want));
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
          RopeParams rope;
          rope.theta = theta;
          cpu_ops().rope(x.data(), s.batch, s.seq, s.heads, s.hd, rope, inverse, dt);
          gpu_ops().rope(gx.data(), s.batch, s.seq, s.heads, s.hd, rope, inverse, dt);
          expect_close("rope", gx.download().values(), x.values(), tolerance(dt));
        }
      }
    }
  }
}

TEST_F(CudaOpsTest, RopeScalingAndPositionOffset) {
  struct Case {
    std::string name;
    RopeParams rope;
    std::int64_t batch, seq, heads, hd;
  };
  std::vector<Case> cases;
  {
    RopeParams r;  // linear: every frequency divided by the factor
    r.theta = 10000.0;
    r.scaling.type = RopeScaling::kLinear;
    r.scaling.factor = 4.0;
    r.position_offset = 1000;
    cases.push_back({"linear", r, 2, 37, 3, 16});
  }
  {
    RopeParams r;  // Llama 3.1's: all three frequency bands at head_dim 128
    r.theta = 500000.0;
    r.scaling.type = RopeScaling::kLlama3;
    r.scaling.factor = 8.0;
    r.scaling.low_freq_factor = 1.0;
    r.scaling.high_freq_factor = 4.0;
    r.scaling.original_max_position_embeddings = 8192.0;
    cases.push_back({"llama3", r, 2, 300, 2, 128});
    r.position_offset = 70000;  // decoding far into a long context: angles need double
    cases.push_back({"llama3 offset 70000", r, 1, 50, 2, 128});
  }
  {
    RopeParams r;  // small original context, so that head_dim 16 also spans the three bands
    r.theta = 10000.0;
    r.scaling.type = RopeScaling::kLlama3;
    r.scaling.factor = 4.0;
    r.scaling.low_freq_factor = 1.0;
    r.scaling.high_freq_factor = 4.0;
    r.scaling.original_max_position_embeddings = 64.0;
    r.position_offset = 37;
    cases.push_back({"llama3 small", r, 2, 37, 3, 16});
  }
  for (DType dt : kDtypes) {
    for (const Case& c : cases) {
      for (bool inverse : {false, true}) {
        SCOPED_TRACE(trace(dt, c.name + " inverse " + std::to_string(inverse)));
        Rng rng(17);
        HostTensor x(dt, c.batch * c.seq * c.heads * c.hd);
        x.fill_uniform(rng, -1, 1);
        GpuTensor gx(*gpu_, x);
        cpu_ops().rope(x.data(), c.batch, c.seq, c.heads, c.hd, c.rope, inverse, dt);
        gpu_ops().rope(gx.data(), c.batch, c.seq, c.heads, c.hd, c.rope, inverse, dt);
        expect_close("rope", gx.download().values(), x.values(), tolerance(dt));
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

// Decoding with a KV cache: the GPU's rows match the CPU backend's for a prompt and then single
// tokens, with and without a sliding window, in f32 and bf16.
TEST_F(CudaOpsTest, AttentionDecodeMatchesTheCpuBackend) {
  for (DType dt : kDtypes) {
    for (std::int64_t window : {0, 5}) {
      for (std::int64_t hd : {64, 72}) {
        SCOPED_TRACE(trace(dt, "window " + std::to_string(window) + " hd " + std::to_string(hd)));
        const std::int64_t heads = 8, kv = 2, keys = 300;
        Rng rng(17);
        HostTensor q(dt, keys * heads * hd), k(dt, keys * kv * hd), v(dt, keys * kv * hd);
        q.fill_uniform(rng, -1.5, 1.5);
        k.fill_uniform(rng, -1.5, 1.5);
        v.fill_uniform(rng, -1, 1);
        GpuTensor gq(*gpu_, q), gk(*gpu_, k), gv(*gpu_, v);
        for (auto [queries, past] :
             {std::pair<std::int64_t, std::int64_t>{260, 0}, {1, 260}, {1, 299}}) {
          const DecodeAttentionShape shape{queries, past, heads, kv, hd, window};
          HostTensor out(dt, queries * heads * hd);
          GpuTensor gout(*gpu_, dt, queries * heads * hd);
          gout.poison();
          cpu_ops().attention_decode(q.data(), k.data(), v.data(), out.data(), shape, dt);
          gpu_ops().attention_decode(gq.data(), gk.data(), gv.data(), gout.data(), shape, dt);
          expect_close("decode past " + std::to_string(past), gout.download().values(),
                       out.values(), tolerance(dt));
        }
      }
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

TEST_F(CudaOpsTest, DropoutMatchesTheCpuMaskIncludingInPlace) {
  for (DType dt : kDtypes) {
    const std::int64_t n = 70001;
    Rng rng(12);
    HostTensor x(dt, n), want(dt, n);
    x.fill_uniform(rng, -1, 1);
    cpu_ops().dropout(x.data(), want.data(), DropoutBlock::flat(n), 0.1f, 987654321ull, dt);
    GpuTensor gx(*gpu_, x), gout(*gpu_, dt, n);
    gout.poison();
    gpu_ops().dropout(gx.data(), gout.data(), DropoutBlock::flat(n), 0.1f, 987654321ull, dt);
    EXPECT_TRUE(gout.download().bitwise_equal(want));
    // A block of columns of a [rows, 3 cols] matrix: the CPU's mask at those columns.
    const DropoutBlock block{233, 100, 300, 100};
    HostTensor want_block(dt, block.size());
    cpu_ops().dropout(x.data(), want_block.data(), block, 0.1f, 987654321ull, dt);
    gout.poison();
    gpu_ops().dropout(gx.data(), gout.data(), block, 0.1f, 987654321ull, dt);
    const auto got_block = gout.download().values(), want_values = want_block.values();
    for (std::int64_t i = 0; i < block.size(); ++i) ASSERT_EQ(got_block[i], want_values[i]) << i;
    gpu_ops().dropout(gx.data(), gx.data(), DropoutBlock::flat(n), 0.1f, 987654321ull, dt);
    EXPECT_TRUE(gx.download().bitwise_equal(want));
  }
}

TEST_F(CudaOpsTest, DequantizeNf4GivesTheCpuBits) {
  const std::int64_t n = 5 * 16384 + 64 * 3 + 7;  // several groups, a partial block, odd
  Rng rng(21);
  std::vector<float> w(static_cast<std::size_t>(n));
  for (float& v : w) v = static_cast<float>(rng.uniform() - 0.5) * 0.1f;
  w[77] = 0.9f;
  std::vector<std::uint8_t> packed(nf4_bytes(n));
  ASSERT_TRUE(nf4_quantize(w.data(), n, packed.data(), "w").is_ok());
  HostTensor host_packed(DType::kU8, static_cast<std::int64_t>(packed.size()));
  std::memcpy(host_packed.data(), packed.data(), packed.size());
  GpuTensor gpacked(*gpu_, host_packed);
  for (DType dt : kDtypes) {
    HostTensor want(dt, n);
    cpu_ops().dequantize_nf4(packed.data(), n, want.data(), dt);
    GpuTensor gout(*gpu_, dt, n);
    gout.poison();
    gpu_ops().dequantize_nf4(gpacked.data(), n, gout.data(), dt);
    EXPECT_TRUE(gout.download().bitwise_equal(want)) << dtype_name(dt);
  }
}

struct BiasShape {
  std::int64_t rows, cols;
};
// Vectorizable and not (2047, 13), several rows per gradient chunk with a partial last chunk
// (2103 rows: chunks of 5), fewer rows than one chunk (1, 3).
constexpr BiasShape kBiasShapes[] = {{7, 48}, {300, 1000}, {37, 2047}, {2103, 2048},
                                     {1, 13}, {3, 8},      {5000, 64}};

TEST_F(CudaOpsTest, AddBiasIsExactIncludingUnaligned) {
  for (DType dt : kDtypes) {
    for (const BiasShape& s : kBiasShapes) {
      for (std::int64_t off : {0, 1}) {  // offset by one element: the scalar path
        SCOPED_TRACE(trace(dt, "rows " + std::to_string(s.rows) + " cols " +
                                   std::to_string(s.cols) + " offset " + std::to_string(off)));
        Rng rng(40 + s.rows);
        HostTensor x(dt, s.rows * s.cols + 1), bias(dt, s.cols + 1);
        x.fill_uniform(rng, -2, 2);
        bias.fill_uniform(rng, -1, 1);
        GpuTensor gx(*gpu_, x), gbias(*gpu_, bias);
        const std::size_t es = static_cast<std::size_t>(off) * dtype_size(dt);
        cpu_ops().add_bias(static_cast<std::byte*>(x.data()) + es,
                           static_cast<const std::byte*>(bias.data()) + es, s.rows, s.cols, dt);
        gpu_ops().add_bias(static_cast<std::byte*>(gx.data()) + es,
                           static_cast<const std::byte*>(gbias.data()) + es, s.rows, s.cols, dt);
        EXPECT_TRUE(gx.download().bitwise_equal(x));  // one rounding of the same f32 sum
      }
    }
  }
}

TEST_F(CudaOpsTest, BiasGradSumsRowsReproducibly) {
  for (DType dt : kDtypes) {
    for (const BiasShape& s : kBiasShapes) {
      SCOPED_TRACE(trace(dt, "rows " + std::to_string(s.rows) + " cols " + std::to_string(s.cols)));
      Rng rng(50 + s.rows);
      const std::int64_t n = s.rows * s.cols;
      HostTensor dy(dt, n), dbias(dt, s.cols), dy_shifted(dt, n + 1);
      dy.fill_uniform(rng, -1, 1);
      dbias.fill_uniform(rng, -1, 1);  // accumulated into
      for (std::int64_t i = 0; i < n; ++i) dy_shifted.set(i + 1, dy.get(i));
      GpuTensor gdy(*gpu_, dy), gdy_shifted(*gpu_, dy_shifted), gdb(*gpu_, dbias),
          gdb_again(*gpu_, dbias), gdb_shifted(*gpu_, dbias);
      cpu_ops().bias_grad(dy.data(), dbias.data(), s.rows, s.cols, dt);
      gpu_ops().bias_grad(gdy.data(), gdb.data(), s.rows, s.cols, dt);
      const HostTensor got = gdb.download();
      expect_close("dbias", got.values(), dbias.values(), tolerance(dt));
      // Fixed chunks summed in order: the same bits on every run, and with or without the
      // 16-byte vector loads (a misaligned dy takes the scalar path).
      gpu_ops().bias_grad(gdy.data(), gdb_again.data(), s.rows, s.cols, dt);
      EXPECT_TRUE(gdb_again.download().bitwise_equal(got));
      gpu_ops().bias_grad(static_cast<const std::byte*>(gdy_shifted.data()) + dtype_size(dt),
                          gdb_shifted.data(), s.rows, s.cols, dt);
      EXPECT_TRUE(gdb_shifted.download().bitwise_equal(got));
    }
  }
}

// moe.cu runs the CPU backend's per-token routing (strata/device/moe_route.h) with FMA
// contraction off on both sides, so from the same inputs every +, *, / and fmax gives the same
// bits: the backward (fed the CPU's probabilities) and scale_rows (one rounding of the same
// product) match to the bit. The forward differs by exp: CUDA's expf is within 2 ulp, the host's
// within 1, so two exps differ by 3u; the sum of E of them, in the same order, by that and each
// side's rounding (f32_sum_error(E) each); the division by 2u. A normalized weight adds its k
// probabilities' sum the same way. The choice is the CPU's where logits lie 0.1 apart. row_dots
// sums in another order: each side within f32_sum_error(cols) of sum |a b|.
TEST_F(CudaOpsTest, MoeRoutingAndRowOpsMatchTheCpuBackend) {
  constexpr double kU = 0x1p-24;
  constexpr std::int64_t T = 37;
  const std::pair<std::int64_t, std::int64_t> shapes[] = {{8, 2}, {16, 4}, {128, 8}};
  for (const auto& [E, K] : shapes) {
    for (const bool normalize : {false, true}) {
      SCOPED_TRACE("experts " + std::to_string(E) + " top " + std::to_string(K) +
                   (normalize ? " normalized" : ""));
      Rng rng(static_cast<std::uint64_t>(E * 10 + K));
      std::vector<float> logits(T * E), dweights(T * K), aux(E);
      for (std::int64_t t = 0; t < T; ++t) {
        // A permutation of 0.1 e, shifted: no two within 0.1 of each other.
        std::vector<std::int64_t> order(E);
        std::iota(order.begin(), order.end(), 0);
        for (std::int64_t i = E - 1; i > 0; --i) {
          std::swap(order[i], order[static_cast<std::int64_t>(rng.uniform() * (i + 1)) % (i + 1)]);
        }
        for (std::int64_t e = 0; e < E; ++e) {
          logits[t * E + e] = 0.1f * static_cast<float>(order[e]) - 2.0f;
        }
      }
      for (float& v : dweights) v = static_cast<float>(rng.normal());
      for (float& v : aux) v = static_cast<float>(rng.normal());

      std::vector<float> probs(T * E), weights(T * K);
      std::vector<std::int32_t> chosen(T * K);
      cpu_ops().moe_route(logits.data(), T, E, K, normalize, probs.data(), chosen.data(),
                          weights.data());
      const DeviceBuffer glogits = upload_array(*gpu_, logits);
      DeviceBuffer gprobs = testing::poisoned_floats(*gpu_, probs.size());
      DeviceBuffer gweights = testing::poisoned_floats(*gpu_, weights.size());
      DeviceBuffer gchosen = upload_array(*gpu_, std::vector<std::int32_t>(chosen.size(), -1));
      gpu_ops().moe_route(glogits.as<float>(), T, E, K, normalize, gprobs.as<float>(),
                          gchosen.as<std::int32_t>(), gweights.as<float>());
      EXPECT_EQ(download_array<std::int32_t>(*gpu_, gchosen, chosen.size()), chosen);
      const double prob_error = 5 * kU + 2 * f32_sum_error(E);
      const double weight_error =
          normalize ? 2 * prob_error + 2 * f32_sum_error(K) + 2 * kU : prob_error;
      const auto relative = [](const std::vector<float>& want, double error) {
        std::vector<double> bound;
        for (float w : want) bound.push_back(error * std::abs(w));
        return bound;
      };
      expect_within("probs", as_doubles(download_array<float>(*gpu_, gprobs, probs.size())),
                    as_doubles(probs), relative(probs, prob_error));
      expect_within("weights", as_doubles(download_array<float>(*gpu_, gweights, weights.size())),
                    as_doubles(weights), relative(weights, weight_error));

      // The backward from the CPU's probabilities and choice: the same bits.
      const DeviceBuffer cprobs = upload_array(*gpu_, probs);
      const DeviceBuffer cchosen = upload_array(*gpu_, chosen);
      const DeviceBuffer gdweights = upload_array(*gpu_, dweights);
      const DeviceBuffer gaux = upload_array(*gpu_, aux);
      for (const bool with_aux : {false, true}) {
        std::vector<float> dlogits(T * E);
        cpu_ops().moe_route_backward(probs.data(), chosen.data(), dweights.data(),
                                     with_aux ? aux.data() : nullptr, T, E, K, normalize,
                                     dlogits.data());
        DeviceBuffer gdlogits = testing::poisoned_floats(*gpu_, dlogits.size());
        gpu_ops().moe_route_backward(cprobs.as<float>(), cchosen.as<std::int32_t>(),
                                     gdweights.as<float>(), with_aux ? gaux.as<float>() : nullptr,
                                     T, E, K, normalize, gdlogits.as<float>());
        EXPECT_EQ(download_array<float>(*gpu_, gdlogits, dlogits.size()), dlogits)
            << (with_aux ? "with" : "without") << " the aux gradient";
      }
    }
  }

  for (DType dt : kDtypes) {
    for (const std::int64_t cols : {24, 2048}) {
      SCOPED_TRACE(trace(dt, "cols " + std::to_string(cols)));
      constexpr std::int64_t rows = 45;
      Rng rng(static_cast<std::uint64_t>(cols));
      HostTensor x(dt, rows * cols), b(dt, rows * cols);
      x.fill_uniform(rng, -2, 2);
      b.fill_uniform(rng, -1, 1);
      std::vector<float> scale(rows);
      for (float& v : scale) v = static_cast<float>(rng.normal());
      // Each row's result at a slot of its own, in another order; the others stay unwritten.
      std::vector<std::int32_t> index(rows);
      for (std::int64_t r = 0; r < rows; ++r) index[r] = static_cast<std::int32_t>((r * 7) % rows);
      GpuTensor gx(*gpu_, x), gb(*gpu_, b);
      const DeviceBuffer gscale = upload_array(*gpu_, scale);
      const DeviceBuffer gindex = upload_array(*gpu_, index);
      std::vector<float> dots(rows + 3, -1.0f);
      DeviceBuffer gdots = upload_array(*gpu_, dots);
      cpu_ops().row_dots(x.data(), b.data(), rows, cols, index.data(), dots.data(), dt);
      gpu_ops().row_dots(gx.data(), gb.data(), rows, cols, gindex.as<std::int32_t>(),
                         gdots.as<float>(), dt);
      std::vector<double> bound(dots.size(), 0.0);
      for (std::int64_t r = 0; r < rows; ++r) {
        double magnitude = 0;
        for (std::int64_t c = 0; c < cols; ++c) {
          magnitude += std::abs(x.get(r * cols + c) * b.get(r * cols + c));
        }
        bound[static_cast<std::size_t>(index[r])] = 2 * f32_sum_error(cols) * magnitude;
      }
      expect_within("row_dots", as_doubles(download_array<float>(*gpu_, gdots, dots.size())),
                    as_doubles(dots), bound);

      cpu_ops().scale_rows(x.data(), scale.data(), rows, cols, dt);
      gpu_ops().scale_rows(gx.data(), gscale.as<float>(), rows, cols, dt);
      EXPECT_TRUE(gx.download().bitwise_equal(x)) << "scale_rows";
    }
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

// ---- Sliding-window attention.

AttentionShape attention_shape(std::int64_t batch, std::int64_t seq, std::int64_t heads,
                               std::int64_t kv_heads, std::int64_t head_dim, std::int64_t window) {
  AttentionShape s;
  s.batch = batch;
  s.seq = seq;
  s.heads = heads;
  s.kv_heads = kv_heads;
  s.head_dim = head_dim;
  s.window = window;
  return s;
}

// The simple and the flash kernels (as the attention test picks them, through the tuning).
class CudaWindowAttentionTest : public testing::GpuTest,
                                public ::testing::WithParamInterface<kernels::AttentionKernel> {
 protected:
  cuda::CudaTuning tuning() const override {
    cuda::CudaTuning t;
    t.attention = GetParam();
    return t;
  }

  void check(const AttentionShape& sh, DType dt) {
    SCOPED_TRACE(std::string(dtype_name(dt)) + " b,s,h,kvh,d=" + std::to_string(sh.batch) + "," +
                 std::to_string(sh.seq) + "," + std::to_string(sh.heads) + "," +
                 std::to_string(sh.kv_heads) + "," + std::to_string(sh.head_dim) + " window " +
                 std::to_string(sh.window));
    Rng rng(31 + sh.seq + sh.window);
    const std::int64_t nq = sh.batch * sh.seq * sh.heads * sh.head_dim;
    const std::int64_t nk = sh.batch * sh.seq * sh.kv_heads * sh.head_dim;
    const std::size_t nl = static_cast<std::size_t>(sh.batch * sh.heads * sh.seq);
    HostTensor q(dt, nq), k(dt, nk), v(dt, nk), out(dt, nq), dout(dt, nq);
    q.fill_uniform(rng, -1.5, 1.5);
    k.fill_uniform(rng, -1.5, 1.5);
    v.fill_uniform(rng, -1, 1);
    dout.fill_uniform(rng, -1, 1);
    // The attention test's error model: the flash kernels round P and dS to bf16. The CPU
    // backend's arithmetic is within the same (looser) bounds.
    const bool flash_may_run =
        GetParam() != kernels::AttentionKernel::kSimple && dt == DType::kBF16;
    const testing::ErrorModel em{.bf16 = dt == DType::kBF16, .rounds_p_and_ds = flash_may_run};
    const testing::Ref want = testing::attention_ref(sh, q.values(), k.values(), v.values(), em);
    const testing::Grads want_g =
        testing::attention_backward_ref(sh, q.values(), k.values(), v.values(), dout.values(), em);

    std::vector<float> lse(nl);
    cpu_ops().attention_forward(q.data(), k.data(), v.data(), out.data(), lse.data(), sh, dt);
    expect_within("cpu out", out.values(), want.out, want.out_bound);
    expect_within("cpu lse", as_doubles(lse), want.lse, want.lse_bound);

    GpuTensor gq(*gpu_, q), gk(*gpu_, k), gv(*gpu_, v), gout(*gpu_, dt, nq), gdout(*gpu_, dout);
    gout.poison();
    DeviceBuffer glse = testing::poisoned_floats(*gpu_, nl);
    gpu_ops().attention_forward(gq.data(), gk.data(), gv.data(), gout.data(), glse.as<float>(), sh,
                                dt);
    expect_within("out", gout.download().values(), want.out, want.out_bound);
    expect_within("lse", as_doubles(download_array<float>(*gpu_, glse, nl)), want.lse,
                  want.lse_bound);

    // Backward on both backends from the CPU's forward output and lse.
    HostTensor dq(dt, nq), dk(dt, nk), dv(dt, nk);
    cpu_ops().attention_backward(dout.data(), q.data(), k.data(), v.data(), out.data(), lse.data(),
                                 dq.data(), dk.data(), dv.data(), sh, dt);
    expect_within("cpu dq", dq.values(), want_g.dq, want_g.dq_bound);
    expect_within("cpu dk", dk.values(), want_g.dk, want_g.dk_bound);
    expect_within("cpu dv", dv.values(), want_g.dv, want_g.dv_bound);
    GpuTensor gcpu_out(*gpu_, out), gdq(*gpu_, dt, nq), gdk(*gpu_, dt, nk), gdv(*gpu_, dt, nk);
    for (GpuTensor* t : {&gdq, &gdk, &gdv}) t->poison();
    DeviceBuffer gcpu_lse = upload_array(*gpu_, lse);
    gpu_ops().attention_backward(gdout.data(), gq.data(), gk.data(), gv.data(), gcpu_out.data(),
                                 gcpu_lse.as<float>(), gdq.data(), gdk.data(), gdv.data(), sh, dt);
    expect_within("dq", gdq.download().values(), want_g.dq, want_g.dq_bound);
    expect_within("dk", gdk.download().values(), want_g.dk, want_g.dk_bound);
    expect_within("dv", gdv.download().values(), want_g.dv, want_g.dv_bound);
  }
};

TEST_P(CudaWindowAttentionTest, MatchesWindowedReferenceOnBothBackends) {
  const bool flash_only = GetParam() == kernels::AttentionKernel::kFlash2;
  struct Case {
    std::int64_t batch, seq, heads, kv_heads, head_dim;
    DType dtype;
  };
  std::vector<Case> cases = {
      {2, 77, 4, 2, 64, DType::kBF16},    // partial tile, GQA group 2
      {1, 130, 8, 2, 128, DType::kBF16},  // head_dim 128, group 4
      {2, 300, 4, 1, 64, DType::kBF16},   // several tiles: windows skip whole tiles
  };
  if (!flash_only) {
    cases.push_back({2, 37, 4, 4, 16, DType::kF32});
    cases.push_back({1, 300, 4, 1, 64, DType::kF32});  // more keys than one score chunk
  }
  const std::size_t smem = kernels::query_gpus().max_smem_optin_bytes;
  for (const Case& c : cases) {
    // 1: only the diagonal; 3 and 17: inside one tile or across a tile edge; 100: wider than a
    // tile, narrower than the sequence; seq: full causal.
    for (std::int64_t window :
         {std::int64_t{1}, std::int64_t{3}, std::int64_t{17}, std::int64_t{100}, c.seq}) {
      if (window > c.seq) continue;
      const AttentionShape sh =
          attention_shape(c.batch, c.seq, c.heads, c.kv_heads, c.head_dim, window);
      kernels::AttentionDims d;
      d.batch = sh.batch;
      d.seq = sh.seq;
      d.heads = sh.heads;
      d.kv_heads = sh.kv_heads;
      d.head_dim = sh.head_dim;
      d.window = sh.window;
      if (flash_only && !kernels::flash_attention_applies(kernels::LaunchContext{nullptr, smem}, d,
                                                          kernels::Elem::kBF16, true)) {
        continue;  // a GPU with less shared memory per block than the kernels need
      }
      check(sh, c.dtype);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Kernels, CudaWindowAttentionTest,
    ::testing::Values(kernels::AttentionKernel::kSimple, kernels::AttentionKernel::kFlash2),
    [](const ::testing::TestParamInfo<kernels::AttentionKernel>& info) {
      return std::string(info.param == kernels::AttentionKernel::kFlash2 ? "Flash2" : "Simple");
    });

}  // namespace
}  // namespace strata::device

#endif  // STRATA_HAVE_CUDA
