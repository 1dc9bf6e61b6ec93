// CPU cross-entropy, cast, sum of squares and AdamW against double references; the device
// memory budget; reproducibility of reductions across thread counts.
#include <gtest/gtest.h>
#include <sys/resource.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "strata/device/adam8bit.h"
#include "tests/unit/device/ops_test_util.h"

namespace strata::device {
namespace {

using testing::expect_close;
using testing::HostTensor;
using testing::make_device;
using testing::tolerance;

// ---------------------------------------------------------------------------------------------
// Cross-entropy

enum class GradMode { kSeparate, kAliased, kNone };

void check_cross_entropy(DType dt, std::int64_t rows, std::int64_t vocab, double offset,
                         GradMode mode) {
  SCOPED_TRACE(std::string(dtype_name(dt)) + " rows " + std::to_string(rows) + " mode " +
               std::to_string(static_cast<int>(mode)));
  auto dev = make_device();
  Rng rng(41);
  HostTensor logits(dt, rows * vocab), dlogits(dt, rows * vocab);
  logits.fill_uniform(rng, -4, 4);
  for (std::int64_t j = 0; j < vocab; ++j) logits.set(j, logits.get(j) + offset);  // row 0
  dlogits.poison();
  std::vector<std::int32_t> targets(static_cast<std::size_t>(rows));
  for (std::int64_t i = 0; i < rows; ++i) {
    targets[i] = (i % 4 == 2) ? -1 : static_cast<std::int32_t>(rng.uniform_int(vocab));
  }
  std::vector<float> losses(static_cast<std::size_t>(rows), NAN);
  const auto z = logits.values();
  const float scale = 0.37f;
  void* dptr = mode == GradMode::kSeparate  ? dlogits.data()
               : mode == GradMode::kAliased ? logits.data()
                                            : nullptr;
  dev->ops().cross_entropy(logits.data(), targets.data(), losses.data(), dptr, rows, vocab, scale,
                           dt);
  std::vector<double> want_loss, got_loss, want_d, got_d;
  const HostTensor& d = mode == GradMode::kAliased ? logits : dlogits;
  for (std::int64_t i = 0; i < rows; ++i) {
    const std::int32_t t = targets[i];
    if (t < 0) {
      EXPECT_EQ(losses[i], 0.0f) << "ignored row " << i;
      if (mode != GradMode::kNone) {
        for (std::int64_t j = 0; j < vocab; ++j) ASSERT_EQ(d.get(i * vocab + j), 0.0) << i;
      }
      continue;
    }
    double mx = -INFINITY, sum = 0;
    for (std::int64_t j = 0; j < vocab; ++j) mx = std::max(mx, z[i * vocab + j]);
    for (std::int64_t j = 0; j < vocab; ++j) sum += std::exp(z[i * vocab + j] - mx);
    want_loss.push_back(std::log(sum) + mx - z[i * vocab + t]);
    got_loss.push_back(losses[i]);
    for (std::int64_t j = 0; j < vocab; ++j) {
      want_d.push_back((std::exp(z[i * vocab + j] - mx) / sum - (j == t)) * scale);
      if (mode != GradMode::kNone) got_d.push_back(d.get(i * vocab + j));
    }
  }
  expect_close("loss", got_loss, want_loss, 1e-5);
  if (mode != GradMode::kNone) expect_close("dlogits", got_d, want_d, tolerance(dt));
}

TEST(CpuOpsTest, CrossEntropyWithIgnoredTargets) {
  for (DType dt : {DType::kF32, DType::kBF16}) {
    for (GradMode mode : {GradMode::kSeparate, GradMode::kAliased, GradMode::kNone}) {
      // Row 0 shifted by a large offset: only a max-subtracted softmax survives it.
      check_cross_entropy(dt, 9, 37, dt == DType::kF32 ? 1000.0 : 100.0, mode);
      check_cross_entropy(dt, 70, 3000, 20.0, mode);
    }
  }
}

// The vocabulary-parallel pair over T slices of the vocabulary: each slice's statistics, combined
// as the model combines them (the largest max, the sums rescaled to it in double, the target's
// logit from the one slice that holds it), give the whole row's loss, and each slice's gradient
// from the whole row's max and sum is its part of the whole row's gradient, against the double
// reference; ignored rows are {-inf, 0, 0} with a zero gradient.
TEST(CpuOpsTest, VocabParallelCrossEntropyOverSlicesIsTheWholeRow) {
  auto dev = make_device();
  const std::int64_t rows = 11, whole = 48;
  for (DType dt : {DType::kF32, DType::kBF16}) {
    for (std::int64_t parts : {1, 2, 4}) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + " T " + std::to_string(parts));
      const std::int64_t vocab = whole / parts;
      Rng rng(43);
      HostTensor logits(dt, rows * whole);
      logits.fill_uniform(rng, -6, 6);
      const auto z = logits.values();
      std::vector<std::int32_t> targets(static_cast<std::size_t>(rows));
      for (std::int64_t i = 0; i < rows; ++i) {
        targets[i] = i % 5 == 3 ? -1 : static_cast<std::int32_t>(rng.uniform_int(whole));
      }
      // Slice p of row i is logits[i, p * vocab ..]: copy each slice out as its rank holds it.
      std::vector<HostTensor> slices;
      std::vector<std::vector<float>> stats;
      for (std::int64_t p = 0; p < parts; ++p) {
        HostTensor slice(dt, rows * vocab);
        for (std::int64_t i = 0; i < rows; ++i) {
          for (std::int64_t j = 0; j < vocab; ++j) {
            slice.set(i * vocab + j, z[i * whole + p * vocab + j]);
          }
        }
        stats.emplace_back(3 * rows, NAN);
        dev->ops().cross_entropy_stats(slice.data(), targets.data(), rows, vocab, p * vocab,
                                       stats.back().data(), dt);
        slices.push_back(std::move(slice));
      }
      std::vector<float> row_max(rows), row_sum(rows);
      std::vector<double> got_loss, want_loss;
      for (std::int64_t i = 0; i < rows; ++i) {
        float m = -INFINITY;
        for (const auto& st : stats) m = std::max(m, st[3 * i]);
        double sum = 0, target = 0;
        for (const auto& st : stats) {
          if (st[3 * i + 1] > 0) sum += st[3 * i + 1] * std::exp(double{st[3 * i]} - m);
          target += st[3 * i + 2];
        }
        row_max[i] = m;
        row_sum[i] = static_cast<float>(sum);
        if (targets[i] < 0) {
          for (const auto& st : stats) {
            EXPECT_EQ(st[3 * i], -INFINITY);
            EXPECT_EQ(st[3 * i + 1], 0.0f);
            EXPECT_EQ(st[3 * i + 2], 0.0f);
          }
          continue;
        }
        double mx = -INFINITY, s = 0;
        for (std::int64_t j = 0; j < whole; ++j) mx = std::max(mx, z[i * whole + j]);
        for (std::int64_t j = 0; j < whole; ++j) s += std::exp(z[i * whole + j] - mx);
        want_loss.push_back(std::log(s) + mx - z[i * whole + targets[i]]);
        got_loss.push_back(std::log(sum) + m - target);
      }
      expect_close("loss", got_loss, want_loss, 1e-5);
      const float scale = 0.37f;
      std::vector<double> got_d(static_cast<std::size_t>(rows * whole));
      for (std::int64_t p = 0; p < parts; ++p) {
        dev->ops().cross_entropy_grad(slices[p].data(), targets.data(), rows, vocab, p * vocab,
                                      row_max.data(), row_sum.data(), slices[p].data(), scale, dt);
        for (std::int64_t i = 0; i < rows; ++i) {
          for (std::int64_t j = 0; j < vocab; ++j) {
            got_d[i * whole + p * vocab + j] = slices[p].get(i * vocab + j);
          }
        }
      }
      std::vector<double> want_d(got_d.size(), 0.0);
      for (std::int64_t i = 0; i < rows; ++i) {
        if (targets[i] < 0) continue;
        double mx = -INFINITY, s = 0;
        for (std::int64_t j = 0; j < whole; ++j) mx = std::max(mx, z[i * whole + j]);
        for (std::int64_t j = 0; j < whole; ++j) s += std::exp(z[i * whole + j] - mx);
        for (std::int64_t j = 0; j < whole; ++j) {
          want_d[i * whole + j] = (std::exp(z[i * whole + j] - mx) / s - (j == targets[i])) * scale;
        }
      }
      expect_close("dlogits", got_d, want_d, tolerance(dt));
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Cast and sum of squares

TEST(CpuOpsTest, CastBetweenFloatTypes) {
  auto dev = make_device();
  const std::int64_t n = 100003;
  Rng rng(42);
  HostTensor src(DType::kF32, n);
  src.fill_uniform(rng, -100, 100);
  const float* s = src.as<float>();
  HostTensor b(DType::kBF16, n), h(DType::kF16, n), back(DType::kF32, n), copy(DType::kF32, n);
  for (HostTensor* t : {&b, &h, &back, &copy}) t->poison();
  dev->ops().cast(src.data(), DType::kF32, b.data(), DType::kBF16, n);
  dev->ops().cast(src.data(), DType::kF32, h.data(), DType::kF16, n);
  dev->ops().cast(b.data(), DType::kBF16, back.data(), DType::kF32, n);
  dev->ops().cast(src.data(), DType::kF32, copy.data(), DType::kF32, n);
  for (std::int64_t i = 0; i < n; ++i) {
    ASSERT_EQ(b.as<bf16>()[i].bits, f32_to_bf16(s[i]).bits) << i;
    ASSERT_EQ(h.as<f16>()[i].bits, f32_to_f16(s[i]).bits) << i;
    ASSERT_EQ(back.as<float>()[i], bf16_to_f32(f32_to_bf16(s[i]))) << i;
  }
  EXPECT_TRUE(copy.bitwise_equal(src));
}

TEST(CpuOpsTest, SumSquaresIsExactOverChunksAndCutsAtChunkBoundaries) {
  auto dev = make_device();
  for (DType dt : {DType::kF32, DType::kBF16}) {
    const std::int64_t n = 200001;
    Rng rng(43);
    HostTensor x(dt, n);
    x.fill_uniform(rng, -3, 3);
    double want = 0;
    for (double v : x.values()) want += v * v;
    // Squares of f32 or bf16 values are exact in double, and every term is positive, so any
    // order of summing n of them is within (n - 1) * 2^-53 * want, and so is this reference.
    ExactSum got;
    got.add(1.0);                                   // overwritten, not added to
    dev->ops().sum_squares(x.data(), n, dt, &got);  // the CPU backend's device memory is host's
    EXPECT_NEAR(got.value(), want, 2.0 * n * 0x1p-53 * want);
    // The array cut into pieces at chunk boundaries, as ZeRO's shards cut a gradient: the
    // pieces' exact sums add up to the whole one's bits, in any order.
    const auto chunk = static_cast<std::int64_t>(kSumSquaresChunkElems);
    for (const std::int64_t pieces : {2, 3, 7}) {
      const std::int64_t per = (n / pieces + chunk - 1) / chunk * chunk;
      ExactSum sum;
      for (std::int64_t p = pieces - 1; p >= 0; --p) {
        const std::int64_t begin = std::min(n, p * per), count = std::min(per, n - begin);
        ExactSum piece;
        dev->ops().sum_squares(static_cast<const std::byte*>(x.data()) + begin * dtype_size(dt),
                               count, dt, &piece);
        sum += piece;
      }
      EXPECT_TRUE(sum == got) << dtype_name(dt) << " in " << pieces << " pieces";
    }
  }
}

// ---------------------------------------------------------------------------------------------
// AdamW

struct AdamCase {
  bool adamw_mode;
  DType grad_dtype;
  bool with_out;
  DType out_dtype;
};

TEST(CpuOpsTest, AdamwMatchesTorchFormulaAndScalarReference) {
  auto dev = make_device();
  const std::int64_t n = 40001;
  const AdamCase cases[] = {{true, DType::kF32, false, DType::kF32},
                            {true, DType::kBF16, true, DType::kBF16},
                            {false, DType::kF32, true, DType::kF16},
                            {false, DType::kBF16, true, DType::kF32}};
  for (const AdamCase& c : cases) {
    SCOPED_TRACE("adamw_mode " + std::to_string(c.adamw_mode) + " grad " +
                 std::string(dtype_name(c.grad_dtype)));
    Rng rng(44);
    HostTensor p(DType::kF32, n), m(DType::kF32, n), v(DType::kF32, n);
    p.fill_uniform(rng, -1, 1);
    m.fill_uniform(rng, -0.1, 0.1);
    v.fill_uniform(rng, 0.001, 0.01);
    HostTensor rp = p, rm = m, rv = v;  // for adamw_reference
    std::vector<double> dp = p.values(), dm = m.values(), dv = v.values();
    HostTensor out(c.out_dtype, n), rout(c.out_dtype, n);
    AdamWArgs a;
    a.n = n;
    a.lr = 1e-2f;
    a.weight_decay = 0.1f;
    a.grad_scale = 0.5f;
    a.adamw_mode = c.adamw_mode;
    a.grad_dtype = c.grad_dtype;
    a.out_dtype = c.out_dtype;
    for (std::int64_t step = 1; step <= 3; ++step) {
      HostTensor g(c.grad_dtype, n);
      g.fill_uniform(rng, -2, 2);
      out.poison();
      a.step = step;
      a.grad = g.data();
      a.param = p.as<float>();
      a.exp_avg = m.as<float>();
      a.exp_avg_sq = v.as<float>();
      a.param_out = c.with_out ? out.data() : nullptr;
      dev->ops().adamw(a);
      AdamWArgs r = a;
      r.param = rp.as<float>();
      r.exp_avg = rm.as<float>();
      r.exp_avg_sq = rv.as<float>();
      r.param_out = c.with_out ? rout.data() : nullptr;
      adamw_reference(r);
      // torch.optim.AdamW / Adam in double.
      const auto gv = g.values();
      const double b1 = a.beta1, b2 = a.beta2, lr = a.lr, wd = a.weight_decay;
      const double bc1 = 1 - std::pow(b1, step), bc2 = 1 - std::pow(b2, step);
      for (std::int64_t i = 0; i < n; ++i) {
        double grad = gv[i] * a.grad_scale;
        if (c.adamw_mode) {
          dp[i] *= 1 - lr * wd;
        } else {
          grad += wd * dp[i];
        }
        dm[i] = b1 * dm[i] + (1 - b1) * grad;
        dv[i] = b2 * dv[i] + (1 - b2) * grad * grad;
        dp[i] -= lr / bc1 * dm[i] / (std::sqrt(dv[i]) / std::sqrt(bc2) + a.eps);
      }
    }
    EXPECT_TRUE(p.bitwise_equal(rp));
    EXPECT_TRUE(m.bitwise_equal(rm));
    EXPECT_TRUE(v.bitwise_equal(rv));
    if (c.with_out) {
      EXPECT_TRUE(out.bitwise_equal(rout));
      for (std::int64_t i = 0; i < n; ++i) {
        HostTensor one(c.out_dtype, 1);
        one.set(0, p.get(i));
        ASSERT_EQ(out.get(i), one.get(0)) << i;
      }
    }
    expect_close("param", p.values(), dp, 1e-5);
    expect_close("exp_avg", m.values(), dm, 1e-5);
    expect_close("exp_avg_sq", v.values(), dv, 1e-5);
  }
}

// ---------------------------------------------------------------------------------------------
// Device budget and reproducibility

TEST(CpuDeviceTest, AllocationPastBudgetIsOutOfMemoryAndPeakIsReported) {
  const std::uint64_t limit = 1 << 20;
  auto dev = make_device(0, limit);
  auto a = dev->allocate(600 << 10, "first");
  ASSERT_TRUE(a.is_ok()) << a.status().to_string();
  auto b = dev->allocate(600 << 10, "second buffer");
  ASSERT_FALSE(b.is_ok());
  EXPECT_EQ(b.status().code(), StatusCode::kOutOfMemory);
  EXPECT_NE(b.status().message().find("second buffer"), std::string::npos) << b.status().message();
  MemoryStats s = dev->memory_stats();
  EXPECT_EQ(s.limit_bytes, limit);
  EXPECT_EQ(s.in_use_bytes, 600u << 10);
  EXPECT_EQ(s.peak_bytes, 600u << 10);
  a->reset();
  auto c = dev->allocate(300 << 10, "third");
  ASSERT_TRUE(c.is_ok());
  s = dev->memory_stats();
  EXPECT_EQ(s.in_use_bytes, 300u << 10);
  EXPECT_EQ(s.peak_bytes, 600u << 10);
  dev->reset_peak();
  EXPECT_EQ(dev->memory_stats().peak_bytes, 300u << 10);
  auto too_big = dev->allocate(limit + 1, "too big");
  EXPECT_EQ(too_big.status().code(), StatusCode::kOutOfMemory);
}

// A freed block is kept for the next request of its size (no fresh pages to fault in); kept
// blocks are not in use and count against neither the budget nor the peak.
TEST(CpuDeviceTest, AFreedBlockServesTheNextRequestOfItsSize) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "AddressSanitizer builds free every block";
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
  GTEST_SKIP() << "AddressSanitizer builds free every block";
#endif
#endif
  const std::uint64_t limit = 16 << 20;
  auto dev = make_device(0, limit);
  const auto minor_faults = [] {
    rusage u{};
    getrusage(RUSAGE_SELF, &u);
    return u.ru_minflt;
  };
  auto a = dev->allocate(8 << 20, "first");
  ASSERT_TRUE(a.is_ok());
  std::memset(a->data(), 1, 8 << 20);
  void* const first = a->data();
  a->reset();
  EXPECT_EQ(dev->memory_stats().in_use_bytes, 0u);
  auto again = dev->allocate(8 << 20, "again");
  ASSERT_TRUE(again.is_ok());
  EXPECT_EQ(again->data(), first);
  // Its pages are there already: a fresh 8 MiB would fault in 2,048 pages of 4 KiB (fewer where
  // transparent huge pages back every mapping).
  const auto before = minor_faults();
  std::memset(again->data(), 2, 8 << 20);
  EXPECT_LT(minor_faults() - before, 256);
  again->reset();
  // 8 MiB kept; 12 MiB more fits the 16 MiB budget: the kept block gives way.
  auto other = dev->allocate(12 << 20, "other size");
  ASSERT_TRUE(other.is_ok()) << other.status().to_string();
  const MemoryStats s = dev->memory_stats();
  EXPECT_EQ(s.in_use_bytes, 12u << 20);
  EXPECT_EQ(s.peak_bytes, 12u << 20);
  EXPECT_EQ(s.num_allocations, 3u);
}

TEST(CpuOpsTest, ReductionsIndependentOfThreadCount) {
  auto one = make_device(1), two = make_device(2);
  for (DType dt : {DType::kF32, DType::kBF16}) {
    Rng rng(45);
    const std::int64_t rows = 777, dim = 96, vocab = 50;
    HostTensor x(dt, rows * dim), w(dt, dim), dout(dt, rows * dim);
    for (HostTensor* t : {&x, &w, &dout}) t->fill_uniform(rng, -1, 1);
    std::vector<std::int32_t> ids(static_cast<std::size_t>(rows));
    for (auto& id : ids) id = static_cast<std::int32_t>(rng.uniform_int(vocab));
    // (OpenBLAS's thread count is process-wide, so GEMMs are not compared here.)
    std::vector<HostTensor> dxs, dws, tables;
    for (Device* d : {one.get(), two.get()}) {
      HostTensor out(dt, rows * dim), dx(dt, rows * dim), dw(dt, dim), table(dt, vocab * dim);
      Rng init(1);
      dw.fill_uniform(init, -1, 1);
      table.fill_uniform(init, -1, 1);
      std::vector<float> rstd(static_cast<std::size_t>(rows));
      d->ops().rmsnorm_forward(x.data(), w.data(), out.data(), rstd.data(), rows, dim, 1e-6f, dt);
      d->ops().rmsnorm_backward(dout.data(), x.data(), w.data(), rstd.data(), dx.data(), dw.data(),
                                rows, dim, dt);
      d->ops().embedding_backward(ids.data(), rows, dout.data(), dim, table.data(), dt);
      dxs.push_back(dx);
      dws.push_back(dw);
      tables.push_back(table);
    }
    EXPECT_TRUE(dxs[0].bitwise_equal(dxs[1])) << dtype_name(dt);
    EXPECT_TRUE(dws[0].bitwise_equal(dws[1])) << dtype_name(dt);
    EXPECT_TRUE(tables[0].bitwise_equal(tables[1])) << dtype_name(dt);
    ExactSum sums[2];
    one->ops().sum_squares(dout.data(), rows * dim, dt, &sums[0]);
    two->ops().sum_squares(dout.data(), rows * dim, dt, &sums[1]);
    EXPECT_TRUE(sums[0] == sums[1]);
  }
}

}  // namespace
}  // namespace strata::device

namespace strata::device {
namespace {

// A compact state without its second plane (the 8-bit block scales, Kahan's compensation), or
// half an out-of-place step, is refused before anything is read, by the one check every AdamW
// (this op, CpuAdam, the CUDA op) runs, naming what is missing.
TEST(CpuOpsDeathTest, AdamwRefusesCompactStateWithoutItsSecondPlane) {
  auto dev = make_device();
  std::vector<float> p(64), g(64);
  std::vector<std::uint8_t> mc(64), vc(64);
  float ms = 1, vs = 1;
  AdamWArgs a;
  a.n = 64;
  a.step = 1;
  a.param = p.data();
  a.grad = g.data();
  a.state_dtype = kAdam8StateDType;
  a.exp_avg = mc.data();
  a.exp_avg_sq = vc.data();
  a.exp_avg_scale = &ms;
  EXPECT_DEATH(dev->ops().adamw(a), "adamw: 8-bit moments without their block scales");
  a.exp_avg_sq_scale = &vs;
  a.param_in = p.data();
  EXPECT_DEATH(dev->ops().adamw(a), "adamw: out of place needs all three inputs, got 1");
  a.param_in = nullptr;
  a.master_dtype = DType::kBF16;
  a.master_rounding = MasterRounding::kKahan;
  EXPECT_DEATH(dev->ops().adamw(a), "adamw: Kahan master weights without their compensation");
  a.master_dtype = DType::kF16;
  EXPECT_DEATH(check_adamw_args(a, "CpuAdam:"), "CpuAdam: master weights must be f32 or bf16");
}

// 8-bit moments and Kahan master weights through the CPU backend's op, which splits the span over
// threads on 64-element block boundaries: the scalar reference's bytes over the whole span.
TEST(CpuOpsTest, AdamwCompactStatesSplitOnBlocksGiveTheReferencesBytes) {
  auto dev = make_device();
  const std::int64_t n = 70001;
  const auto blocks = static_cast<std::size_t>(adam8_blocks(n));
  Rng rng(45);
  std::vector<float> p(static_cast<std::size_t>(n)), m(p.size()), v(p.size()), g(p.size());
  for (std::size_t i = 0; i < p.size(); ++i) {
    p[i] = static_cast<float>(rng.normal());
    m[i] = static_cast<float>(rng.normal() * 1e-3);
    v[i] = static_cast<float>(rng.uniform() * 1e-5);
    g[i] = static_cast<float>(rng.normal() * 1e-2);
  }
  // The state: bf16 weights with their compensation, codes with their block scales.
  std::vector<bf16> hi(p.size()), lo(p.size());
  for (std::size_t i = 0; i < p.size(); ++i) {
    hi[i] = f32_to_bf16(p[i]);
    lo[i] = f32_to_bf16_toward_zero(p[i] - bf16_to_f32(hi[i]));
  }
  std::vector<std::uint8_t> mc(p.size()), vc(p.size());
  std::vector<float> ms(blocks), vs(blocks);
  adam8_quantize_array(m.data(), n, false, mc.data(), ms.data());
  adam8_quantize_array(v.data(), n, true, vc.data(), vs.data());
  auto rhi = hi, rlo = lo;
  auto rmc = mc, rvc = vc;
  auto rms = ms, rvs = vs;
  std::vector<bf16> out(p.size()), rout(p.size());
  AdamWArgs a;
  a.n = n;
  a.lr = 1e-3;
  a.weight_decay = 0.1;
  a.step = 5;
  a.grad = g.data();
  a.master_dtype = DType::kBF16;
  a.master_rounding = MasterRounding::kKahan;
  a.state_dtype = kAdam8StateDType;
  a.out_dtype = DType::kBF16;
  AdamWArgs r = a;
  a.param = hi.data();
  a.param_comp = lo.data();
  a.exp_avg = mc.data();
  a.exp_avg_sq = vc.data();
  a.exp_avg_scale = ms.data();
  a.exp_avg_sq_scale = vs.data();
  a.param_out = out.data();
  r.param = rhi.data();
  r.param_comp = rlo.data();
  r.exp_avg = rmc.data();
  r.exp_avg_sq = rvc.data();
  r.exp_avg_scale = rms.data();
  r.exp_avg_sq_scale = rvs.data();
  r.param_out = rout.data();
  dev->ops().adamw(a);
  adamw_reference(r);
  const auto same = [](const auto& x, const auto& y) {
    return std::memcmp(x.data(), y.data(), x.size() * sizeof(x[0])) == 0;
  };
  EXPECT_TRUE(same(hi, rhi)) << "master weights";
  EXPECT_TRUE(same(lo, rlo)) << "compensation";
  EXPECT_EQ(mc, rmc);
  EXPECT_EQ(vc, rvc);
  EXPECT_EQ(ms, rms);
  EXPECT_EQ(vs, rvs);
  EXPECT_TRUE(same(out, rout)) << "copy";
}

}  // namespace
}  // namespace strata::device
