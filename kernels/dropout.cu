// Inverted dropout with a counter-based mask (device::dropout_keeps): the same mask as the CPU
// backend's, element for element, over a matrix or a block of its columns.
#include "common.cuh"
#include "strata/core/rng.h"

namespace strata::kernels {
namespace {

template <typename T>
__global__ void dropout_kernel(const T* x, T* out, std::int64_t n, std::int64_t cols,
                               std::int64_t full_cols, std::int64_t col_begin,
                               std::uint32_t threshold, float scale, std::uint64_t key) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    // The whole matrix (every caller but a row-parallel slice): no division.
    const auto at = static_cast<std::uint64_t>(
        cols == full_cols ? i : (i / cols) * full_cols + col_begin + i % cols);
    const auto bits = static_cast<std::uint32_t>(splitmix64_at(key, at) >> 40);
    out[i] = from_float<T>(bits >= threshold ? to_float(x[i]) * scale : 0.0f);
  }
}

}  // namespace

int dropout(const LaunchContext& ctx, const void* x, void* out, std::int64_t rows,
            std::int64_t cols, std::int64_t full_cols, std::int64_t col_begin,
            std::uint32_t threshold, float scale, std::uint64_t key, Elem dtype) {
  const std::int64_t n = rows * cols;
  if (n <= 0) return 0;
  constexpr int kThreads = 256;
  return dispatch_float(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    dropout_kernel<T><<<grid_for(n, kThreads), kThreads, 0, stream_of(ctx)>>>(
        static_cast<const T*>(x), static_cast<T*>(out), n, cols, full_cols, col_begin, threshold,
        scale, key);
    return launch_check();
  });
}

}  // namespace strata::kernels
