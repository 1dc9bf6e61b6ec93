// C = beta * C for a GEMM with an empty inner dimension (cuBLASLt rejects k == 0).
#include "common.cuh"

namespace strata::kernels {
namespace {

template <typename T>
__global__ void scale_matrix_kernel(T* c, std::int64_t m, std::int64_t n, std::int64_t ldc,
                                    float beta) {
  const std::int64_t total = m * n;
  for (std::int64_t idx = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
       idx < total; idx += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t i = idx / n, j = idx - i * n;
    T& x = c[i * ldc + j];
    // beta == 0 must not read C: BLAS semantics, and C may hold NaN.
    x = from_float<T>(beta == 0.0f ? 0.0f : beta * to_float(x));
  }
}

}  // namespace

int scale_matrix(const LaunchContext& ctx, void* c, std::int64_t m, std::int64_t n,
                 std::int64_t ldc, float beta, Elem dtype) {
  if (m <= 0 || n <= 0) return 0;
  return dispatch_float(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int kThreads = 256;
    scale_matrix_kernel<T><<<grid_for(m * n, kThreads), kThreads, 0, stream_of(ctx)>>>(
        static_cast<T*>(c), m, n, ldc, beta);
    return launch_check();
  });
}

}  // namespace strata::kernels
