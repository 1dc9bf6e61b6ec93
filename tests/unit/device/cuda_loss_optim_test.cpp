// CUDA cross-entropy, sum of squares and AdamW against the CPU backend. AdamW must be
// bit-identical: optimizer placement (GPU, CPU device, host) must never change the numbers.
#include "strata/build_config.h"
#if STRATA_HAVE_CUDA

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "strata/device/adam8bit.h"
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

class CudaLossOptimTest : public testing::GpuTest {};

enum class GradMode { kNone, kSeparate, kInPlace };

TEST_F(CudaLossOptimTest, CrossEntropyMatchesCpu) {
  for (DType dt : {DType::kF32, DType::kBF16}) {
    for (std::int64_t vocab : {37, 1000, 32000}) {
      for (GradMode mode : {GradMode::kNone, GradMode::kSeparate, GradMode::kInPlace}) {
        SCOPED_TRACE(std::string(dtype_name(dt)) + " vocab " + std::to_string(vocab) + " mode " +
                     std::to_string(static_cast<int>(mode)));
        const std::int64_t rows = 37;
        Rng rng(17);
        HostTensor logits(dt, rows * vocab), dlogits(dt, rows * vocab);
        logits.fill_uniform(rng, -8, 8);
        std::vector<std::int32_t> targets(rows);
        for (auto& t : targets) t = static_cast<std::int32_t>(rng.uniform_int(vocab));
        targets[3] = -1;  // ignored
        targets[20] = -100;
        targets[5] = static_cast<std::int32_t>(vocab - 1);
        const float scale = 0.37f;
        std::vector<float> losses(rows);
        HostTensor cpu_logits = logits;
        void* cpu_d = mode == GradMode::kNone      ? nullptr
                      : mode == GradMode::kInPlace ? cpu_logits.data()
                                                   : dlogits.data();
        cpu_ops().cross_entropy(cpu_logits.data(), targets.data(), losses.data(), cpu_d, rows,
                                vocab, scale, dt);

        GpuTensor glogits(*gpu_, logits), gd(*gpu_, dt, rows * vocab);
        gd.poison();
        DeviceBuffer gt = upload_array(*gpu_, targets);
        DeviceBuffer gl = testing::poisoned_floats(*gpu_, rows);
        void* gpu_d = mode == GradMode::kNone      ? nullptr
                      : mode == GradMode::kInPlace ? glogits.data()
                                                   : gd.data();
        gpu_ops().cross_entropy(glogits.data(), gt.as<std::int32_t>(), gl.as<float>(), gpu_d, rows,
                                vocab, scale, dt);
        expect_close("loss", as_doubles(download_array<float>(*gpu_, gl, rows)), as_doubles(losses),
                     1e-5);
        if (mode == GradMode::kSeparate) {
          expect_close("dlogits", gd.download().values(), dlogits.values(), tolerance(dt));
        } else if (mode == GradMode::kInPlace) {
          expect_close("dlogits", glogits.download().values(), cpu_logits.values(), tolerance(dt));
        } else {
          EXPECT_TRUE(glogits.download().bitwise_equal(logits));  // untouched
        }
      }
    }
  }
}

// The vocabulary-parallel cross-entropy's two kernels against the CPU backend's, over the whole
// vocabulary (T = 1: the statistics' loss log(sum) + max - z_t is the fused kernel's loss) and
// over a slice [begin, begin + vocab) of a vocabulary twice as large (targets inside the slice,
// outside it, and ignored rows). The max and the target logit are copies of one input value, so
// they must be equal; the sum of exponentials adds positive terms in another order (f32, at most
// vocab roundings of 2^-24 each); the gradient is each backend's exp times one reciprocal.
TEST_F(CudaLossOptimTest, VocabParallelCrossEntropyMatchesCpu) {
  for (DType dt : {DType::kF32, DType::kBF16}) {
    for (std::int64_t vocab : {37, 1000, 32000}) {
      for (std::int64_t begin : {std::int64_t{0}, vocab}) {
        SCOPED_TRACE(std::string(dtype_name(dt)) + " vocab " + std::to_string(vocab) + " begin " +
                     std::to_string(begin));
        const std::int64_t rows = 37;
        Rng rng(23);
        HostTensor logits(dt, rows * vocab);
        logits.fill_uniform(rng, -8, 8);
        // Targets over the whole vocabulary of 2 * vocab: about half fall in the slice.
        std::vector<std::int32_t> targets(rows);
        for (auto& t : targets) t = static_cast<std::int32_t>(rng.uniform_int(2 * vocab));
        targets[3] = -1;
        targets[20] = -100;
        targets[5] = static_cast<std::int32_t>(begin + vocab - 1);
        targets[6] = static_cast<std::int32_t>(begin);
        std::vector<float> want(3 * rows);
        cpu_ops().cross_entropy_stats(logits.data(), targets.data(), rows, vocab, begin,
                                      want.data(), dt);
        GpuTensor glogits(*gpu_, logits);
        DeviceBuffer gt = upload_array(*gpu_, targets);
        DeviceBuffer gs = testing::poisoned_floats(*gpu_, 3 * rows);
        gpu_ops().cross_entropy_stats(glogits.data(), gt.as<std::int32_t>(), rows, vocab, begin,
                                      gs.as<float>(), dt);
        const std::vector<float> got = download_array<float>(*gpu_, gs, 3 * rows);
        std::vector<float> row_max(rows), row_sum(rows);
        for (std::int64_t i = 0; i < rows; ++i) {
          const float* g = got.data() + 3 * i;
          const float* w = want.data() + 3 * i;
          EXPECT_EQ(g[0], w[0]) << "max, row " << i;
          EXPECT_NEAR(g[1], w[1], 2.0 * static_cast<double>(vocab) * 0x1p-24 * w[1])
              << "sum, row " << i;
          EXPECT_EQ(g[2], w[2]) << "target logit, row " << i;
          row_max[static_cast<std::size_t>(i)] = w[0];
          row_sum[static_cast<std::size_t>(i)] = w[1];
        }
        if (begin == 0) {  // the whole vocabulary: the fused kernel's loss
          std::vector<std::int32_t> inside = targets;  // the fused kernel takes only these
          for (auto& t : inside) t = t < vocab ? t : -1;
          std::vector<float> fused(rows);
          cpu_ops().cross_entropy(logits.data(), inside.data(), fused.data(), nullptr, rows, vocab,
                                  1.0f, dt);
          for (std::int64_t i = 0; i < rows; ++i) {
            const float* g = got.data() + 3 * i;
            const auto t = targets[static_cast<std::size_t>(i)];
            if (t < 0 || t >= vocab) continue;  // ignored, or no loss without the other half
            const double loss = std::log(static_cast<double>(g[1])) + g[0] - g[2];
            EXPECT_NEAR(loss, fused[static_cast<std::size_t>(i)], 1e-5 * (1 + std::abs(loss)))
                << "row " << i;
          }
        }
        const float scale = 0.37f;
        HostTensor cpu_d(dt, rows * vocab);
        cpu_ops().cross_entropy_grad(logits.data(), targets.data(), rows, vocab, begin,
                                     row_max.data(), row_sum.data(), cpu_d.data(), scale, dt);
        DeviceBuffer gmax = upload_array(*gpu_, row_max), gsum = upload_array(*gpu_, row_sum);
        // In place, as the model calls it.
        gpu_ops().cross_entropy_grad(glogits.data(), gt.as<std::int32_t>(), rows, vocab, begin,
                                     gmax.as<float>(), gsum.as<float>(), glogits.data(), scale, dt);
        expect_close("dlogits", glogits.download().values(), cpu_d.values(), tolerance(dt));
        EXPECT_TRUE(gpu_->last_error().is_ok()) << gpu_->last_error().message();
      }
    }
  }
}

TEST_F(CudaLossOptimTest, SumSquaresMatchesCpu) {
  for (DType dt : {DType::kF32, DType::kBF16}) {
    for (std::int64_t n : {1, 1000, 1000003, 20000000}) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + " n " + std::to_string(n));
      Rng rng(19);
      HostTensor x(dt, n);
      x.fill_uniform(rng, -2, 2);
      GpuTensor gx(*gpu_, x);
      ExactSum want;
      cpu_ops().sum_squares(x.data(), n, dt, &want);
      // Two sums into two slots of one buffer, read back together (as the engine does); the
      // slots start poisoned: the op overwrites them.
      const std::size_t floats = 2 * sizeof(ExactSum) / sizeof(float);
      DeviceBuffer slots = testing::poisoned_floats(*gpu_, static_cast<std::int64_t>(floats));
      auto* slot = reinterpret_cast<ExactSum*>(slots.as<float>());
      gpu_ops().sum_squares(gx.data(), n, dt, slot);
      gpu_ops().sum_squares(gx.data(), n, dt, slot + 1);
      const std::vector<float> raw = download_array<float>(*gpu_, slots, floats);
      ASSERT_TRUE(gpu_->last_error().is_ok()) << gpu_->last_error().message();
      ExactSum got[2];
      std::memcpy(static_cast<void*>(got), raw.data(), sizeof(got));
      // Both sum exact squares (f32 and bf16 squares are exact in double) of positive terms:
      // each chunk in double (within 255 * 2^-53 of its sum), the chunks exactly.
      EXPECT_NEAR(got[0].value(), want.value(), 256.0 * 0x1p-53 * want.value());
      EXPECT_TRUE(got[1] == got[0]);  // reproducible
    }
  }
}

// The host checks targets before a launch (llama.cpp); a kernel given one past the vocabulary
// anyway reads nothing outside its row, reports a NaN loss and writes a zero gradient row.
TEST_F(CudaLossOptimTest, CrossEntropyTargetPastTheVocabularyIsNaNNotAnOutOfBoundsRead) {
  const std::int64_t rows = 3, vocab = 1000;
  Rng rng(5);
  HostTensor logits(DType::kF32, rows * vocab);
  logits.fill_uniform(rng, -4, 4);
  GpuTensor glogits(*gpu_, logits), gd(*gpu_, DType::kF32, rows * vocab);
  gd.poison();
  DeviceBuffer gt = upload_array(*gpu_, std::vector<std::int32_t>{5, static_cast<int>(vocab), 7});
  DeviceBuffer gl = testing::poisoned_floats(*gpu_, rows);
  gpu_ops().cross_entropy(glogits.data(), gt.as<std::int32_t>(), gl.as<float>(), gd.data(), rows,
                          vocab, 1.0f, DType::kF32);
  const std::vector<float> losses = download_array<float>(*gpu_, gl, rows);
  EXPECT_TRUE(std::isfinite(losses[0]) && std::isfinite(losses[2]));
  EXPECT_TRUE(std::isnan(losses[1]));
  const std::vector<double> d = gd.download().values();
  for (std::int64_t j = 0; j < vocab; ++j) ASSERT_EQ(d[static_cast<std::size_t>(vocab + j)], 0.0);
  EXPECT_TRUE(gpu_->last_error().is_ok()) << gpu_->last_error().message();
}

// The hyperparameters of the AdamW tests' steps.
AdamWArgs step_args(std::int64_t n, std::int64_t step) {
  AdamWArgs a;
  a.n = n;
  a.lr = 1e-3f;
  a.beta1 = 0.9f;
  a.beta2 = 0.95f;
  a.eps = 1e-8f;
  a.weight_decay = 0.1f;
  a.grad_scale = 0.5f;
  a.step = step;
  return a;
}

TEST_F(CudaLossOptimTest, AdamWIsBitIdenticalToTheReference) {
  struct Case {
    DType grad, out;
    bool adamw_mode;
    std::int64_t offset;        // elements: 1 forces the unaligned path
    DType state = DType::kF32;  // the moments' (optimizer.state_dtype)
  };
  const Case cases[] = {{DType::kF32, DType::kBF16, true, 0},
                        {DType::kBF16, DType::kBF16, true, 0},
                        {DType::kF32, DType::kF32, false, 0},
                        {DType::kF16, DType::kF16, true, 1},
                        {DType::kF32, DType::kBF16, true, 1},
                        {DType::kBF16, DType::kBF16, true, 0, DType::kBF16},
                        {DType::kF32, DType::kF32, false, 1, DType::kBF16}};
  for (const Case& c : cases) {
    SCOPED_TRACE(std::string(dtype_name(c.grad)) + " -> " + std::string(dtype_name(c.out)) +
                 " adamw " + std::to_string(c.adamw_mode) + " offset " + std::to_string(c.offset) +
                 " moments " + std::string(dtype_name(c.state)));
    const std::int64_t n = 10007, total = n + c.offset;
    Rng rng(23);
    HostTensor p(DType::kF32, total), m(c.state, total), v(c.state, total), g(c.grad, total),
        out(c.out, total);
    p.fill_uniform(rng, -1, 1);
    m.fill_uniform(rng, -0.1, 0.1);
    v.fill_uniform(rng, 0, 0.01);
    g.fill_uniform(rng, -1, 1);
    GpuTensor gp(*gpu_, p), gm(*gpu_, m), gv(*gpu_, v), gg(*gpu_, g), gout(*gpu_, c.out, total);
    gout.poison();
    for (std::int64_t step = 1; step <= 3; ++step) {
      AdamWArgs a = step_args(n, step);
      a.adamw_mode = c.adamw_mode;
      a.grad_dtype = c.grad;
      a.out_dtype = c.out;
      a.state_dtype = c.state;
      const std::size_t gs = dtype_size(c.grad), os = dtype_size(c.out), ss = dtype_size(c.state);
      AdamWArgs ca = a;
      ca.param = p.as<float>() + c.offset;
      ca.exp_avg = static_cast<std::byte*>(m.data()) + c.offset * ss;
      ca.exp_avg_sq = static_cast<std::byte*>(v.data()) + c.offset * ss;
      ca.grad = static_cast<std::byte*>(g.data()) + c.offset * gs;
      ca.param_out = static_cast<std::byte*>(out.data()) + c.offset * os;
      adamw_reference(ca);
      AdamWArgs ga = a;
      ga.param = gp.as<float>() + c.offset;
      ga.exp_avg = static_cast<std::byte*>(gm.data()) + c.offset * ss;
      ga.exp_avg_sq = static_cast<std::byte*>(gv.data()) + c.offset * ss;
      ga.grad = static_cast<std::byte*>(gg.data()) + c.offset * gs;
      ga.param_out = static_cast<std::byte*>(gout.data()) + c.offset * os;
      gpu_ops().adamw(ga);
    }
    HostTensor rp = gp.download(), rm = gm.download(), rv = gv.download(), ro = gout.download();
    for (std::int64_t i = c.offset; i < total; ++i) {
      ASSERT_EQ(rp.as<float>()[i], p.as<float>()[i]) << "param " << i;
      ASSERT_EQ(rm.get(i), m.get(i)) << "exp_avg " << i;
      ASSERT_EQ(rv.get(i), v.get(i)) << "exp_avg_sq " << i;
      ASSERT_EQ(ro.get(i), out.get(i)) << "param_out " << i;
    }
  }
}

// Compact optimizer state with the optimizer on the GPU (optimizer.state_dtype "int8" or "bf16",
// master_dtype "bf16" with Kahan or stochastic rounding): master weights and their compensation,
// 8-bit codes and block scales or bf16 moments, and the copy are the reference's bytes over three
// steps, with a partial last 8-bit block, a zero block and one below f32's normal range.
TEST_F(CudaLossOptimTest, AdamWWithCompactStateIsBitIdenticalToTheReference) {
  struct Case {
    DType state;
    DType master;
    MasterRounding rounding;
  };
  const DType kInt8 = kAdam8StateDType;
  const Case cases[] = {{kInt8, DType::kF32, MasterRounding::kStochastic},
                        {kInt8, DType::kBF16, MasterRounding::kKahan},
                        {kInt8, DType::kBF16, MasterRounding::kStochastic},
                        {DType::kBF16, DType::kBF16, MasterRounding::kKahan},
                        {DType::kBF16, DType::kBF16, MasterRounding::kStochastic},
                        {DType::kF32, DType::kBF16, MasterRounding::kKahan}};
  for (const Case& c : cases) {
    const bool q8 = c.state == kInt8, half_master = c.master == DType::kBF16;
    const bool kahan = half_master && c.rounding == MasterRounding::kKahan;
    SCOPED_TRACE(std::string("moments ") + std::string(dtype_name(c.state)) + ", master " +
                 std::string(dtype_name(c.master)) + (kahan ? " kahan" : ""));
    const std::int64_t n = 10007, blocks = adam8_blocks(n);
    const auto un = static_cast<std::size_t>(n), ub = static_cast<std::size_t>(blocks);
    Rng rng(29);
    std::vector<float> p(un), m(un), v(un);
    for (std::size_t i = 0; i < un; ++i) {
      p[i] = static_cast<float>(rng.uniform() * 2 - 1);
      m[i] = static_cast<float>((rng.uniform() - 0.5) * std::pow(10.0, -8 * rng.uniform()));
      v[i] = static_cast<float>(rng.uniform() * 1e-2 * std::pow(10.0, -8 * rng.uniform()));
      if (i / kAdam8BlockElems == 3) m[i] = v[i] = 0;  // a zero block
      if (i / kAdam8BlockElems == 5) m[i] = 1e-39f;    // below the normal range
    }
    // The state as stored: master (and compensation), moments (and scales).
    std::vector<std::uint16_t> master16(un), comp(un);
    std::vector<std::byte> mb(un * (q8 ? 1 : dtype_size(c.state))), vb(mb.size());
    std::vector<float> ms(ub), vs(ub);
    for (std::size_t i = 0; i < un; ++i) {
      const bf16 hi = f32_to_bf16(p[i]);
      master16[i] = hi.bits;
      comp[i] = f32_to_bf16_toward_zero(p[i] - bf16_to_f32(hi)).bits;
    }
    if (q8) {
      adam8_quantize_array(m.data(), n, false, reinterpret_cast<std::uint8_t*>(mb.data()),
                           ms.data());
      adam8_quantize_array(v.data(), n, true, reinterpret_cast<std::uint8_t*>(vb.data()),
                           vs.data());
    } else if (c.state == DType::kBF16) {
      for (std::size_t i = 0; i < un; ++i) {
        reinterpret_cast<bf16*>(mb.data())[i] = f32_to_bf16(m[i]);
        reinterpret_cast<bf16*>(vb.data())[i] = f32_to_bf16(v[i]);
      }
    } else {
      std::memcpy(mb.data(), m.data(), un * 4);
      std::memcpy(vb.data(), v.data(), un * 4);
    }
    HostTensor g(DType::kBF16, n), out(DType::kBF16, n);
    g.fill_uniform(rng, -1, 1);
    GpuTensor gg(*gpu_, g), gout(*gpu_, DType::kBF16, n);
    gout.poison();
    DeviceBuffer gp = half_master ? upload_array(*gpu_, master16) : upload_array(*gpu_, p);
    DeviceBuffer gcomp = upload_array(*gpu_, comp), gm = upload_array(*gpu_, mb),
                 gv = upload_array(*gpu_, vb), gms = upload_array(*gpu_, ms),
                 gvs = upload_array(*gpu_, vs);
    for (std::int64_t step = 1; step <= 3; ++step) {
      AdamWArgs a = step_args(n, step);
      a.grad_dtype = DType::kBF16;
      a.out_dtype = DType::kBF16;
      a.state_dtype = c.state;
      a.master_dtype = c.master;
      a.master_rounding = c.rounding;
      a.rounding_seed = 0x5eed + static_cast<std::uint64_t>(step);
      a.element_offset = 4096;
      AdamWArgs ca = a;
      ca.param = half_master ? static_cast<void*>(master16.data()) : p.data();
      ca.param_comp = kahan ? comp.data() : nullptr;
      ca.grad = g.data();
      ca.exp_avg = mb.data();
      ca.exp_avg_sq = vb.data();
      ca.exp_avg_scale = q8 ? ms.data() : nullptr;
      ca.exp_avg_sq_scale = q8 ? vs.data() : nullptr;
      ca.param_out = out.data();
      adamw_reference(ca);
      AdamWArgs ga = a;
      ga.param = gp.data();
      ga.param_comp = kahan ? gcomp.data() : nullptr;
      ga.grad = gg.data();
      ga.exp_avg = gm.data();
      ga.exp_avg_sq = gv.data();
      ga.exp_avg_scale = q8 ? static_cast<float*>(gms.data()) : nullptr;
      ga.exp_avg_sq_scale = q8 ? static_cast<float*>(gvs.data()) : nullptr;
      ga.param_out = gout.data();
      gpu_ops().adamw(ga);
    }
    if (half_master) {
      EXPECT_EQ(download_array<std::uint16_t>(*gpu_, gp, un), master16) << "master weights";
      if (kahan) {
        EXPECT_EQ(download_array<std::uint16_t>(*gpu_, gcomp, un), comp) << "compensation";
      }
    } else {
      EXPECT_EQ(download_array<float>(*gpu_, gp, un), p) << "master weights";
    }
    EXPECT_EQ(download_array<std::byte>(*gpu_, gm, mb.size()), mb) << "exp_avg";
    EXPECT_EQ(download_array<std::byte>(*gpu_, gv, vb.size()), vb) << "exp_avg_sq";
    if (q8) {
      EXPECT_EQ(download_array<float>(*gpu_, gms, ub), ms) << "exp_avg scales";
      EXPECT_EQ(download_array<float>(*gpu_, gvs, ub), vs) << "exp_avg_sq scales";
    }
    HostTensor ro = gout.download();
    for (std::int64_t i = 0; i < n; ++i) ASSERT_EQ(ro.get(i), out.get(i)) << "param_out " << i;
    EXPECT_TRUE(gpu_->last_error().is_ok()) << gpu_->last_error().message();
  }
}

}  // namespace
}  // namespace strata::device

#endif  // STRATA_HAVE_CUDA
