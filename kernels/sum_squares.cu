// Sum of squares in double (global gradient norms): a fixed partition of the input into block
// partials, then one block adds the partials in order, so the result is reproducible.
#include "common.cuh"

namespace strata::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxBlocks = 1024;

// Blocks for n elements; depends on n only, never on the device.
int num_blocks(std::int64_t n) {
  const std::int64_t b = (n + kThreads * 16 - 1) / (kThreads * 16);
  return static_cast<int>(b < 1 ? 1 : (b > kMaxBlocks ? kMaxBlocks : b));
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    sum_squares_partial_kernel(const T* __restrict__ x, std::int64_t n,
                               double* __restrict__ partials) {
  __shared__ double red[32];
  double s = 0.0;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const double v = to_float(x[i]);
    s += v * v;
  }
  s = block_sum(s, red);
  if (threadIdx.x == 0) partials[blockIdx.x] = s;
}

__global__ void __launch_bounds__(kThreads)
    sum_partials_kernel(const double* __restrict__ partials, int count, double* result) {
  __shared__ double red[32];
  double s = 0.0;
  for (int i = threadIdx.x; i < count; i += blockDim.x) s += partials[i];
  s = block_sum(s, red);
  if (threadIdx.x == 0) *result = s;
}

}  // namespace

std::size_t sum_squares_scratch_bytes(std::int64_t n) {
  return static_cast<std::size_t>(num_blocks(n)) * sizeof(double);
}

int sum_squares(const LaunchContext& ctx, const void* x, std::int64_t n, Elem dtype, double* result,
                void* scratch) {
  auto* partials = static_cast<double*>(scratch);
  const int blocks = num_blocks(n);
  if (n <= 0) {
    return static_cast<int>(cudaMemsetAsync(result, 0, sizeof(double), stream_of(ctx)));
  }
  const int err = dispatch_float(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    sum_squares_partial_kernel<T>
        <<<blocks, kThreads, 0, stream_of(ctx)>>>(static_cast<const T*>(x), n, partials);
    return launch_check();
  });
  if (err != 0) return err;
  sum_partials_kernel<<<1, kThreads, 0, stream_of(ctx)>>>(partials, blocks, result);
  return launch_check();
}

}  // namespace strata::kernels
