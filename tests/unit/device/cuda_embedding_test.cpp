// The CUDA embedding backward (sort by id, then a segmented sum) at scale: 65536 rows over a
// 1000-row table with ids repeated thousands of times, runs spanning many blocks of sorted
// positions and ids that never occur. f32 must equal the CPU backend bit for bit (same additions
// in the same order); bf16 must equal the contract's arithmetic emulated on the host (fp32 sum
// from the table's value in row order, one rounding) bit for bit, and the exact sum within the
// error bound of that arithmetic.
#include "strata/build_config.h"
#if STRATA_HAVE_CUDA

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "tests/unit/device/cuda_test_util.h"

namespace strata::device {
namespace {

using testing::download_array;
using testing::expect_within;
using testing::GpuTensor;
using testing::HostTensor;
using testing::upload_array;

struct Shape {
  std::int64_t rows, vocab, dim;
};

// Ids with heavy repetition: id 0 on ~30% of rows (a run spanning hundreds of sorted blocks),
// id vocab - 1 (odd) on ~5%, the rest spread over the even ids below it, so the other odd ids
// never occur and their table rows must come back untouched.
std::vector<std::int32_t> skewed_ids(Rng& rng, std::int64_t rows, std::int64_t vocab) {
  std::vector<std::int32_t> ids(static_cast<std::size_t>(rows));
  for (auto& id : ids) {
    const double u = rng.uniform();
    if (u < 0.3) {
      id = 0;
    } else if (u < 0.35) {
      id = static_cast<std::int32_t>(vocab - 1);
    } else {
      id = static_cast<std::int32_t>(2 * rng.uniform_int(static_cast<std::uint64_t>(vocab / 2)));
    }
  }
  return ids;
}

class CudaEmbeddingTest : public testing::GpuTest {
 protected:
  void check(DType dt, const Shape& s, std::uint64_t seed) {
    SCOPED_TRACE(std::string(dtype_name(dt)) + " rows " + std::to_string(s.rows) + " vocab " +
                 std::to_string(s.vocab) + " dim " + std::to_string(s.dim));
    Rng rng(seed);
    const std::vector<std::int32_t> ids = skewed_ids(rng, s.rows, s.vocab);
    HostTensor dout(dt, s.rows * s.dim), dtable(dt, s.vocab * s.dim);
    dout.fill_uniform(rng, -1, 1);
    dtable.fill_uniform(rng, -1, 1);  // accumulated into
    const HostTensor before = dtable;

    DeviceBuffer gids = upload_array(*gpu_, ids);
    GpuTensor gdout(*gpu_, dout), gdtable(*gpu_, dtable);
    gpu_ops().embedding_backward(gids.as<std::int32_t>(), s.rows, gdout.data(), s.dim,
                                 gdtable.data(), dt);
    const HostTensor got = gdtable.download();
    // The ids must not have been reordered in place (the sort reads them, never writes them).
    EXPECT_EQ(download_array<std::int32_t>(*gpu_, gids, ids.size()), ids);

    // The contract emulated: per id and column, fp32 from the table's value, rows in order.
    std::vector<float> acc(static_cast<std::size_t>(s.vocab * s.dim));
    std::vector<double> exact(acc.size()), abs_sum(acc.size());
    std::vector<std::int64_t> terms(acc.size(), 1);
    for (std::size_t e = 0; e < acc.size(); ++e) {
      const double t = before.get(static_cast<std::int64_t>(e));
      acc[e] = static_cast<float>(t);
      exact[e] = t;
      abs_sum[e] = std::abs(t);
    }
    for (std::int64_t i = 0; i < s.rows; ++i) {
      const std::int64_t row = ids[static_cast<std::size_t>(i)];
      for (std::int64_t c = 0; c < s.dim; ++c) {
        const auto e = static_cast<std::size_t>(row * s.dim + c);
        const double g = dout.get(i * s.dim + c);
        acc[e] += static_cast<float>(g);
        exact[e] += g;
        abs_sum[e] += std::abs(g);
        ++terms[e];
      }
    }
    HostTensor want(dt, s.vocab * s.dim);
    for (std::size_t e = 0; e < acc.size(); ++e) want.set(static_cast<std::int64_t>(e), acc[e]);
    EXPECT_TRUE(got.bitwise_equal(want)) << "differs from the fp32 row-order sum rounded once";

    // Against the exact sum: recursive fp32 summation of n terms errs by at most
    // gamma_{n-1} sum|terms| (Higham, Accuracy and Stability, 4.2), gamma_k = k u / (1 - k u),
    // u = 2^-24; bf16 then adds one rounding of at most 2^-8 of the rounded value's magnitude.
    constexpr double kU32 = 0x1p-24;
    const double u_out = dt == DType::kF32 ? 0.0 : 0x1p-8;
    std::vector<double> bound(acc.size());
    for (std::size_t e = 0; e < acc.size(); ++e) {
      const double k = static_cast<double>(terms[e] - 1) * kU32;
      const double sum_err = k / (1 - k) * abs_sum[e];
      bound[e] = sum_err + u_out * (std::abs(exact[e]) + sum_err);
    }
    expect_within("dtable vs exact", got.values(), exact, bound);

    if (dt == DType::kF32) {
      // The CPU backend makes the same additions in the same order.
      cpu_ops().embedding_backward(ids.data(), s.rows, dout.data(), s.dim, dtable.data(), dt);
      EXPECT_TRUE(got.bitwise_equal(dtable)) << "differs from the CPU backend";
    }
    // bf16: the CPU backend rounds to bf16 after every add, so on an id with thousands of rows
    // its own error (up to 2^-8 of the running sum per add) dwarfs the GPU's; the exact sum
    // above is the reference.
  }
};

TEST_F(CudaEmbeddingTest, BackwardManyRepeatsMatchesRowOrderSum) {
  for (DType dt : {DType::kF32, DType::kBF16}) {
    check(dt, {65536, 1000, 200}, 41);  // 512 position blocks, two column blocks (one partial)
    check(dt, {4099, 1000, 13}, 42);    // rows not a multiple of the 128-position block
    check(dt, {1, 5, 130}, 43);         // a single row
  }
}

TEST_F(CudaEmbeddingTest, BackwardIsDeterministic) {
  const Shape s{65536, 1000, 64};
  Rng rng(44);
  const std::vector<std::int32_t> ids = skewed_ids(rng, s.rows, s.vocab);
  HostTensor dout(DType::kBF16, s.rows * s.dim), dtable(DType::kBF16, s.vocab * s.dim);
  dout.fill_uniform(rng, -1, 1);
  dtable.fill_uniform(rng, -1, 1);
  DeviceBuffer gids = upload_array(*gpu_, ids);
  GpuTensor gdout(*gpu_, dout);
  HostTensor first(DType::kBF16, 0);
  for (int run = 0; run < 3; ++run) {
    GpuTensor gdtable(*gpu_, dtable);
    gpu_ops().embedding_backward(gids.as<std::int32_t>(), s.rows, gdout.data(), s.dim,
                                 gdtable.data(), DType::kBF16);
    const HostTensor got = gdtable.download();
    if (run == 0) {
      first = got;
    } else {
      EXPECT_TRUE(got.bitwise_equal(first)) << "run " << run;
    }
  }
}

}  // namespace
}  // namespace strata::device

#endif  // STRATA_HAVE_CUDA
