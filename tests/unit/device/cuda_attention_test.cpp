// CUDA causal GQA attention against the double-precision reference, within per-element bounds
// derived from the arithmetic (attention_reference.h; the flash kernels' bf16 rounding of P and
// dS included), forward and backward, for each kernel variant: the simple one (every shape and
// dtype) and the flash kernels (bf16, head_dim 64/128: mma.sync with cp.async),
// including sequence lengths that leave partial tiles and sliding windows. Backward runs from
// the CPU backend's forward output and lse, the inputs the reference's bounds assume.
#include "strata/build_config.h"
#if STRATA_HAVE_CUDA

#include <gtest/gtest.h>

#include <vector>

#include "kernels/runtime.h"
#include "tests/unit/device/attention_reference.h"
#include "tests/unit/device/cuda_test_util.h"

namespace strata::device {
namespace {

using kernels::AttentionKernel;
using testing::as_doubles;
using testing::attention_backward_ref;
using testing::attention_ref;
using testing::download_array;
using testing::ErrorModel;
using testing::expect_within;
using testing::GpuTensor;
using testing::HostTensor;
using testing::upload_array;

struct Case {
  AttentionShape shape;
  DType dtype;
};

std::string describe(const Case& c) {
  const auto& s = c.shape;
  return std::string(dtype_name(c.dtype)) + " b,s,h,kvh,d=" + std::to_string(s.batch) + "," +
         std::to_string(s.seq) + "," + std::to_string(s.heads) + "," + std::to_string(s.kv_heads) +
         "," + std::to_string(s.head_dim) + " window " + std::to_string(s.window);
}

bool is_flash(AttentionKernel k) { return k == AttentionKernel::kFlash2; }

class CudaAttentionTest : public testing::GpuTest,
                          public ::testing::WithParamInterface<AttentionKernel> {
 protected:
  cuda::CudaTuning tuning() const override {
    cuda::CudaTuning t;
    t.attention = GetParam();
    return t;
  }
  static std::size_t gpu_max_smem() { return kernels::query_gpus().max_smem_optin_bytes; }

  void check(const Case& c) {
    SCOPED_TRACE(describe(c));
    const AttentionShape& sh = c.shape;
    const DType dt = c.dtype;
    Rng rng(31 + sh.seq);
    const std::int64_t nq = sh.batch * sh.seq * sh.heads * sh.head_dim;
    const std::int64_t nk = sh.batch * sh.seq * sh.kv_heads * sh.head_dim;
    const std::size_t nl = static_cast<std::size_t>(sh.batch * sh.heads * sh.seq);
    HostTensor q(dt, nq), k(dt, nk), v(dt, nk), out(dt, nq), dout(dt, nq);
    q.fill_uniform(rng, -1.5, 1.5);  // scores of a few units: far from uniform softmax
    k.fill_uniform(rng, -1.5, 1.5);
    v.fill_uniform(rng, -1, 1);
    dout.fill_uniform(rng, -1, 1);
    std::vector<float> lse(nl);
    cpu_ops().attention_forward(q.data(), k.data(), v.data(), out.data(), lse.data(), sh, dt);
    GpuTensor gq(*gpu_, q), gk(*gpu_, k), gv(*gpu_, v), gout(*gpu_, dt, nq), gdout(*gpu_, dout);
    gout.poison();
    DeviceBuffer glse = testing::poisoned_floats(*gpu_, nl);
    gpu_ops().attention_forward(gq.data(), gk.data(), gv.data(), gout.data(), glse.as<float>(), sh,
                                dt);
    // The flash kernels round P and dS to bf16 for their tensor-core products (kAuto may pick
    // them for bf16); the simple kernel keeps them in f32 and gets no such allowance.
    const bool flash_may_run = GetParam() != AttentionKernel::kSimple && dt == DType::kBF16;
    const ErrorModel em{.bf16 = dt == DType::kBF16, .rounds_p_and_ds = flash_may_run};
    const testing::Ref want = attention_ref(sh, q.values(), k.values(), v.values(), em);
    expect_within("out", gout.download().values(), want.out, want.out_bound);
    expect_within("lse", as_doubles(download_array<float>(*gpu_, glse, nl)), want.lse,
                  want.lse_bound);
    GpuTensor gcpu_out(*gpu_, out), gdq(*gpu_, dt, nq), gdk(*gpu_, dt, nk), gdv(*gpu_, dt, nk);
    for (GpuTensor* t : {&gdq, &gdk, &gdv}) t->poison();
    DeviceBuffer gcpu_lse = upload_array(*gpu_, lse);
    gpu_ops().attention_backward(gdout.data(), gq.data(), gk.data(), gv.data(), gcpu_out.data(),
                                 gcpu_lse.as<float>(), gdq.data(), gdk.data(), gdv.data(), sh, dt);
    const testing::Grads g =
        attention_backward_ref(sh, q.values(), k.values(), v.values(), dout.values(), em);
    expect_within("dq", gdq.download().values(), g.dq, g.dq_bound);
    expect_within("dk", gdk.download().values(), g.dk, g.dk_bound);
    expect_within("dv", gdv.download().values(), g.dv, g.dv_bound);
  }

  // Runs the case unless the variant asked for cannot serve it on this GPU.
  void check_if_served(const Case& c) {
    if (is_flash(GetParam())) {
      const AttentionShape& s = c.shape;
      const kernels::AttentionDims d{s.batch, s.seq, s.heads, s.kv_heads, s.head_dim, s.window};
      if (!kernels::flash_attention_applies(kernels::LaunchContext{nullptr, gpu_max_smem()}, d,
                                            kernels::Elem::kBF16, true)) {
        return;  // a GPU with less shared memory per block than the kernels need
      }
    }
    check(c);
  }
};

TEST_P(CudaAttentionTest, MatchesReferenceWithinDerivedBounds) {
  const bool flash_only = is_flash(GetParam());
  std::vector<Case> cases = {
      {{2, 77, 4, 2, 64}, DType::kBF16},    // partial tile, GQA group 2
      {{1, 130, 8, 2, 128}, DType::kBF16},  // head_dim 128, group 4
      {{1, 64, 2, 2, 64}, DType::kBF16},    // exactly one tile, no GQA
      {{2, 300, 4, 1, 64}, DType::kBF16},   // several tiles, multi-query
  };
  if (flash_only) {
    // Many tiles, so that the flash kernels' pipelines run long and most tiles need no mask.
    cases.push_back({{1, 520, 4, 2, 128}, DType::kBF16});
  } else {
    cases.push_back({{2, 37, 4, 4, 16}, DType::kF32});
    cases.push_back({{1, 300, 4, 1, 64}, DType::kF32});  // more keys than one score chunk
    cases.push_back({{2, 16, 4, 2, 8}, DType::kF32});    // the tiny test model's shape
    cases.push_back({{1, 40, 2, 1, 96}, DType::kBF16});  // bf16 the flash kernels do not serve
  }
  for (const Case& c : cases) check_if_served(c);
}

// Sliding windows: 1 (only the diagonal), 3 and 17 (inside one tile or across a tile edge), 100
// (wider than a tile, narrower than the sequence): whole key tiles are skipped, others masked.
TEST_P(CudaAttentionTest, MatchesReferenceWithSlidingWindows) {
  for (std::int64_t window : {1, 3, 17, 100}) {
    check_if_served({{2, 300, 4, 1, 64, window}, DType::kBF16});
    check_if_served({{1, 130, 8, 2, 128, window}, DType::kBF16});
  }
}

INSTANTIATE_TEST_SUITE_P(Kernels, CudaAttentionTest,
                         ::testing::Values(AttentionKernel::kAuto, AttentionKernel::kSimple,
                                           AttentionKernel::kFlash2),
                         [](const ::testing::TestParamInfo<AttentionKernel>& info) {
                           switch (info.param) {
                             case AttentionKernel::kAuto:
                               return std::string("Auto");
                             case AttentionKernel::kSimple:
                               return std::string("Simple");
                             case AttentionKernel::kFlash2:
                               return std::string("Flash2");
                           }
                           return std::string("Unknown");
                         });

}  // namespace
}  // namespace strata::device

#endif  // STRATA_HAVE_CUDA
