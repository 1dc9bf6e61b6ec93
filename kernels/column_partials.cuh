// Deterministic column sums (bias_grad's dbias, rmsnorm_backward's dw): fp32 partials [chunks,
// cols] over a partition of the rows that is a function of rows only, then one ordered pass that
// adds the chunks' partials, in chunk order, to the output. So the bits never depend on the
// device. The first passes differ (bias sums dy alone, rmsnorm fuses its partial into dx's pass)
// and stay in their files.
#pragma once

#include <cstdint>

#include "common.cuh"

namespace strata::kernels {
namespace {

// Rows per partial: about 512 chunks for large inputs (enough blocks to fill any GPU), at least
// 4 rows each.
inline std::int64_t partial_rows_per_chunk(std::int64_t rows) {
  const std::int64_t per = (rows + 511) / 512;
  return per < 4 ? 4 : per;
}

inline std::int64_t partial_chunks(std::int64_t rows) {
  const std::int64_t per = partial_rows_per_chunk(rows);
  return (rows + per - 1) / per;
}

// out[c] += the sum over chunks of partials[chunk, c], in chunk order.
template <typename T>
__global__ void add_column_partials_kernel(const float* __restrict__ partials,
                                           std::int64_t num_chunks, std::int64_t cols,
                                           T* __restrict__ out) {
  const std::int64_t c = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
  if (c >= cols) return;
  float s = 0.0f;
  for (std::int64_t k = 0; k < num_chunks; ++k) s += partials[k * cols + c];
  out[c] = from_float<T>(to_float(out[c]) + s);
}

template <typename T>
int add_column_partials(const LaunchContext& ctx, const float* partials, std::int64_t num_chunks,
                        std::int64_t cols, T* out) {
  constexpr int kThreads = 256;
  add_column_partials_kernel<T>
      <<<static_cast<unsigned>((cols + kThreads - 1) / kThreads), kThreads, 0, stream_of(ctx)>>>(
          partials, num_chunks, cols, out);
  return launch_check();
}

}  // namespace
}  // namespace strata::kernels
