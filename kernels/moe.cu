// Mixture-of-experts routing and the row ops around the experts' GEMMs: moe_route (softmax,
// top-k, renormalization) and its backward, one thread per token running the CPU backend's own
// per-token functions (strata/device/moe_route.h); scale_rows (an expert's outputs times their
// routing weights) and row_dots (each routing weight's gradient), one warp per row.
#include "common.cuh"
#include "strata/device/moe_route.h"

namespace strata::kernels {
namespace {

__global__ void moe_route_kernel(const float* __restrict__ logits, std::int64_t tokens,
                                 std::int64_t experts, std::int64_t k, bool normalize,
                                 float* __restrict__ probs, std::int32_t* __restrict__ chosen,
                                 float* __restrict__ weights) {
  for (std::int64_t t = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
       t < tokens; t += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    device::moe_route_token(logits + t * experts, experts, k, normalize, probs + t * experts,
                            chosen + t * k, weights + t * k);
  }
}

__global__ void moe_route_backward_kernel(const float* __restrict__ probs,
                                          const std::int32_t* __restrict__ chosen,
                                          const float* __restrict__ dweights,
                                          const float* __restrict__ aux_grad, std::int64_t tokens,
                                          std::int64_t experts, std::int64_t k, bool normalize,
                                          float* __restrict__ dlogits) {
  for (std::int64_t t = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
       t < tokens; t += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    device::moe_route_token_backward(probs + t * experts, chosen + t * k, dweights + t * k,
                                     aux_grad, experts, k, normalize, dlogits + t * experts);
  }
}

template <typename T>
__global__ void scale_rows_kernel(T* __restrict__ x, const float* __restrict__ scale,
                                  std::int64_t rows, std::int64_t cols) {
  const std::int64_t total = rows * cols;
  for (std::int64_t idx = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
       idx < total; idx += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const float s = to_float(from_float<T>(scale[idx / cols]));
    x[idx] = from_float<T>(to_float(x[idx]) * s);
  }
}

// One warp per row: lane l sums columns l, l + 32, ... in order, then a shuffle tree.
template <typename T>
__global__ void row_dots_kernel(const T* __restrict__ a, const T* __restrict__ b, std::int64_t rows,
                                std::int64_t cols, const std::int32_t* __restrict__ index,
                                float* __restrict__ out) {
  const int lane = threadIdx.x & 31;
  const std::int64_t warps = static_cast<std::int64_t>(gridDim.x) * (blockDim.x / 32);
  for (std::int64_t r = blockIdx.x * static_cast<std::int64_t>(blockDim.x / 32) + threadIdx.x / 32;
       r < rows; r += warps) {
    float s = 0.0f;
    for (std::int64_t c = lane; c < cols; c += 32) {
      s += to_float(a[r * cols + c]) * to_float(b[r * cols + c]);
    }
    for (int off = 16; off > 0; off /= 2) s += __shfl_down_sync(0xffffffffu, s, off);
    if (lane == 0) out[index[r]] = s;
  }
}

}  // namespace

int moe_route(const LaunchContext& ctx, const float* logits, std::int64_t tokens,
              std::int64_t experts, std::int64_t k, bool normalize, float* probs,
              std::int32_t* chosen, float* weights) {
  if (tokens <= 0) return 0;
  constexpr int kThreads = 128;
  moe_route_kernel<<<grid_for(tokens, kThreads), kThreads, 0, stream_of(ctx)>>>(
      logits, tokens, experts, k, normalize, probs, chosen, weights);
  return launch_check();
}

int moe_route_backward(const LaunchContext& ctx, const float* probs, const std::int32_t* chosen,
                       const float* dweights, const float* aux_grad, std::int64_t tokens,
                       std::int64_t experts, std::int64_t k, bool normalize, float* dlogits) {
  if (tokens <= 0) return 0;
  constexpr int kThreads = 128;
  moe_route_backward_kernel<<<grid_for(tokens, kThreads), kThreads, 0, stream_of(ctx)>>>(
      probs, chosen, dweights, aux_grad, tokens, experts, k, normalize, dlogits);
  return launch_check();
}

int scale_rows(const LaunchContext& ctx, void* x, const float* scale, std::int64_t rows,
               std::int64_t cols, Elem dtype) {
  if (rows <= 0 || cols <= 0) return 0;
  constexpr int kThreads = 256;
  return dispatch_float(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    scale_rows_kernel<T><<<grid_for(rows * cols, kThreads), kThreads, 0, stream_of(ctx)>>>(
        static_cast<T*>(x), scale, rows, cols);
    return launch_check();
  });
}

int row_dots(const LaunchContext& ctx, const void* a, const void* b, std::int64_t rows,
             std::int64_t cols, const std::int32_t* index, float* out, Elem dtype) {
  if (rows <= 0) return 0;
  constexpr int kThreads = 256;
  return dispatch_float(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    row_dots_kernel<T><<<grid_for(rows * 32, kThreads), kThreads, 0, stream_of(ctx)>>>(
        static_cast<const T*>(a), static_cast<const T*>(b), rows, cols, index, out);
    return launch_check();
  });
}

}  // namespace strata::kernels
