// CPU causal GQA attention against a double-precision reference, within error bounds derived
// from the f32 arithmetic (ErrorModel), the reference's backward in turn checked against finite
// differences; plus thread-count independence of the results and scores within a budget on long
// sequences.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <vector>

#include "src/device/cpu/cpu_device.h"
#include "strata/build_config.h"
#include "strata/sys/process.h"
#include "tests/unit/device/attention_reference.h"
#include "tests/unit/device/ops_test_util.h"

namespace strata::device {
namespace {

using testing::attention_backward_ref;
using testing::attention_ref;
using testing::ErrorModel;
using testing::expect_close;
using testing::expect_within;
using testing::Grads;
using testing::HostTensor;
using testing::make_device;
using testing::Ref;

// Attention's products run on OpenBLAS from the calling thread, or as single-threaded oneDNN
// products inside per-head tasks where fp32 GEMMs run on oneDNN: both ways, in builds with it.
std::vector<cpu::CpuGemmChoice> gemm_choices() {
  std::vector<cpu::CpuGemmChoice> out{cpu::CpuGemmChoice{}};
  if (STRATA_HAVE_ONEDNN) out.push_back({.f32 = cpu::GemmLibrary::kOneDnn});
  return out;
}

std::string gemm_label(const cpu::CpuGemmChoice& c) {
  return c.f32 == cpu::GemmLibrary::kOneDnn ? "oneDNN products" : "OpenBLAS products";
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
    // Sliding windows (Mistral, Qwen): a window of 3 checked numerically, 1 (only itself), one
    // shorter than a row block, and one the sequence never reaches (the same as none).
    {{2, 9, 4, 2, 8, 3}, true},
    {{1, 70, 2, 1, 16, 1}, false},
    {{1, 130, 2, 2, 64, 17}, false},
    {{1, 20, 2, 2, 8, 64}, false},
    // Longer than one block of query rows (the score budget over the sequence: 1984 rows here),
    // without and with a window whose keys for the second block start off the 64-key grid.
    {{1, 2100, 2, 1, 8}, false},
    {{1, 2100, 2, 2, 8, 300}, false},
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
  for (const cpu::CpuGemmChoice& gemm : gemm_choices()) {
    SCOPED_TRACE(gemm_label(gemm));
    const auto ops = make_cpu_ops(2, sys::widest_simd_path(), gemm);
    for (DType dt : {DType::kF32, DType::kBF16}) {
      for (const Case& c : kCases) {
        const auto& sh = c.shape;
        SCOPED_TRACE(std::string(dtype_name(dt)) + " b,s,h,kvh,d=" + std::to_string(sh.batch) +
                     "," + std::to_string(sh.seq) + "," + std::to_string(sh.heads) + "," +
                     std::to_string(sh.kv_heads) + "," + std::to_string(sh.head_dim) + " window " +
                     std::to_string(sh.window));
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
        ops->attention_forward(q.data(), k.data(), v.data(), out.data(), lse.data(), sh, dt);
        const ErrorModel em{.bf16 = dt == DType::kBF16};
        const Ref want = attention_ref(sh, q.values(), k.values(), v.values(), em);
        expect_within("out", out.values(), want.out, want.out_bound);
        expect_within("lse", std::vector<double>(lse.begin(), lse.end()), want.lse, want.lse_bound);
        ops->attention_backward(dout.data(), q.data(), k.data(), v.data(), out.data(), lse.data(),
                                dq.data(), dk.data(), dv.data(), sh, dt);
        const Grads g =
            attention_backward_ref(sh, q.values(), k.values(), v.values(), dout.values(), em);
        expect_within("dq", dq.values(), g.dq, g.dq_bound);
        expect_within("dk", dk.values(), g.dk, g.dk_bound);
        expect_within("dv", dv.values(), g.dv, g.dv_bound);
      }
    }
  }
}

// Results must not depend on the number of threads (checkpointed recomputation and
// multi-rank runs rely on bitwise reproducibility).
TEST(CpuAttentionTest, ResultsIndependentOfThreadCount) {
  for (const cpu::CpuGemmChoice& gemm : gemm_choices()) {
    SCOPED_TRACE(gemm_label(gemm));
    const auto one = make_cpu_ops(1, sys::widest_simd_path(), gemm);
    const auto three = make_cpu_ops(3, sys::widest_simd_path(), gemm);
    const AttentionShape sh{3, 33, 4, 2, 16};
    const DType dt = DType::kF32;
    Rng rng(33);
    const std::int64_t nq = sh.batch * sh.seq * sh.heads * sh.head_dim;
    const std::int64_t nk = sh.batch * sh.seq * sh.kv_heads * sh.head_dim;
    HostTensor q(dt, nq), k(dt, nk), v(dt, nk), dout(dt, nq);
    for (HostTensor* t : {&q, &k, &v, &dout}) t->fill_uniform(rng, -1, 1);
    std::vector<HostTensor> outs, dqs, dks, dvs;
    for (const Ops* o : {one.get(), three.get()}) {
      HostTensor out(dt, nq), dq(dt, nq), dk(dt, nk), dv(dt, nk);
      std::vector<float> lse(static_cast<std::size_t>(sh.batch * sh.heads * sh.seq));
      o->attention_forward(q.data(), k.data(), v.data(), out.data(), lse.data(), sh, dt);
      o->attention_backward(dout.data(), q.data(), k.data(), v.data(), out.data(), lse.data(),
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
}

// A long sequence must not hold a [seq, seq] score matrix: at 16384 tokens one head's would be
// 1 GiB (2 GiB in backward, which keeps two), where the blocked kernels hold at most twice
// 4M floats (32 MiB). Measured as the growth of the process's peak resident memory, reset
// first through /proc/self/clear_refs.
TEST(CpuAttentionTest, LongSequencesKeepTheirScoresWithinABudget) {
  const AttentionShape sh{1, 16384, 1, 1, 8};
  const DType dt = DType::kF32;
  auto dev = make_device(2);
  const std::int64_t n = sh.seq * sh.head_dim;
  HostTensor q(dt, n), k(dt, n), v(dt, n), dout(dt, n), out(dt, n), dq(dt, n), dk(dt, n), dv(dt, n);
  Rng rng(7);
  for (HostTensor* t : {&q, &k, &v, &dout}) t->fill_uniform(rng, -1, 1);
  std::vector<float> lse(static_cast<std::size_t>(sh.seq));
  {
    std::FILE* f = std::fopen("/proc/self/clear_refs", "w");
    if (f == nullptr || std::fputs("5", f) < 0 || std::fclose(f) != 0) {
      GTEST_SKIP() << "cannot reset the peak resident memory (/proc/self/clear_refs)";
    }
  }
  const auto before = sys::read_process_memory();
  ASSERT_TRUE(before.is_ok()) << before.status().message();
  dev->ops().attention_forward(q.data(), k.data(), v.data(), out.data(), lse.data(), sh, dt);
  dev->ops().attention_backward(dout.data(), q.data(), k.data(), v.data(), out.data(), lse.data(),
                                dq.data(), dk.data(), dv.data(), sh, dt);
  const auto after = sys::read_process_memory();
  ASSERT_TRUE(after.is_ok()) << after.status().message();
  const double grown_mib =
      (static_cast<double>(after->peak_rss_bytes) - static_cast<double>(before->rss_bytes)) /
      (1 << 20);
  EXPECT_LT(grown_mib, 128.0) << "peak resident memory grew by " << grown_mib << " MiB";
  // The last row attends to every key: its output is a convex mix of v's rows, so within their
  // range, and its lse is finite.
  EXPECT_TRUE(std::isfinite(lse.back()));
  for (std::int64_t x = 0; x < sh.head_dim; ++x) {
    EXPECT_LE(std::fabs(out.get((sh.seq - 1) * sh.head_dim + x)), 1.0 + 1e-6);
  }
}

}  // namespace
}  // namespace strata::device

namespace strata::device {
namespace {

// Decoding with a cache gives the rows full attention gives the same positions: the prompt at
// once, then a token at a time, with and without a window.
TEST(CpuAttentionTest, DecodeWithACacheMatchesFullAttentionRows) {
  auto dev = testing::make_device();
  for (std::int64_t window : {0, 3}) {
    const AttentionShape sh{1, 11, 4, 2, 8, window};
    Rng rng(5);
    const std::int64_t nq = sh.seq * sh.heads * sh.head_dim;
    const std::int64_t nk = sh.seq * sh.kv_heads * sh.head_dim;
    testing::HostTensor q(DType::kF32, nq), k(DType::kF32, nk), v(DType::kF32, nk),
        out(DType::kF32, nq), dec(DType::kF32, nq);
    q.fill_uniform(rng, -1.5, 1.5);
    k.fill_uniform(rng, -1.5, 1.5);
    v.fill_uniform(rng, -1, 1);
    std::vector<float> lse(static_cast<std::size_t>(sh.heads * sh.seq));
    dev->ops().attention_forward(q.data(), k.data(), v.data(), out.data(), lse.data(), sh,
                                 DType::kF32);
    const std::int64_t row = sh.heads * sh.head_dim;
    auto* qd = static_cast<float*>(q.data());
    auto* od = static_cast<float*>(dec.data());
    const std::int64_t prompt = 6;
    dev->ops().attention_decode(qd, k.data(), v.data(), od,
                                {prompt, 0, sh.heads, sh.kv_heads, sh.head_dim, window},
                                DType::kF32);
    for (std::int64_t t = prompt; t < sh.seq; ++t) {
      dev->ops().attention_decode(qd + t * row, k.data(), v.data(), od + t * row,
                                  {1, t, sh.heads, sh.kv_heads, sh.head_dim, window}, DType::kF32);
    }
    testing::expect_close("window " + std::to_string(window), dec.values(), out.values(), 1e-5);
  }
}

}  // namespace
}  // namespace strata::device
