// Exact sums of squares (global gradient norms): each chunk of kChunk elements from the array's
// start summed in double by one warp in a fixed order, the chunks' sums added into the fixed-point
// limbs of a strata::ExactSum with integer atomics, which commute, so the result is the same
// whatever order the chunks finish in and however the array is cut at chunk boundaries.
#include <math_constants.h>

#include "common.cuh"

namespace strata::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr std::int64_t kChunk = kSumSquaresChunk;
constexpr int kMaxBlocks = 4096;

__device__ void exact_add(ExactSumLayout* out, double x) {
  if (!(x < CUDART_INF)) {  // NaN or infinity
    atomicAdd(&out->special, x);
    return;
  }
  if (x == 0.0) return;
  const auto bits = static_cast<unsigned long long>(__double_as_longlong(x));
  int exponent = static_cast<int>((bits >> 52) & 0x7ff);
  unsigned long long mantissa = bits & ((1ull << 52) - 1);
  if (exponent == 0) {
    exponent = 1;
  } else {
    mantissa |= 1ull << 52;
  }
  int at = exponent - 1075 - kExactSumLowBit;
  if (at < 0) {
    if (at <= -53) return;
    mantissa >>= -at;
    at = 0;
  }
  if (at + 53 > kExactSumHighBit - kExactSumLowBit) {
    atomicAdd(&out->special, CUDART_INF);
    return;
  }
  const int limb = at / 32, shift = at % 32;
  // mantissa << shift spans three 32-bit limbs.
  const unsigned long long lo = (mantissa << shift) & 0xffffffffull;
  const unsigned long long mid =
      (shift == 0 ? mantissa >> 32 : (mantissa >> (32 - shift))) & 0xffffffffull;
  const unsigned long long hi = shift == 0 ? 0ull : mantissa >> (64 - shift);
  atomicAdd(&out->limbs[limb], lo);
  atomicAdd(&out->limbs[limb + 1], mid);
  if (hi != 0) atomicAdd(&out->limbs[limb + 2], hi);
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    sum_squares_kernel(const T* __restrict__ x, std::int64_t n, ExactSumLayout* out) {
  const int lane = threadIdx.x % 32;
  const std::int64_t warp = blockIdx.x * static_cast<std::int64_t>(kWarps) + threadIdx.x / 32;
  const std::int64_t warps = static_cast<std::int64_t>(gridDim.x) * kWarps;
  const std::int64_t chunks = (n + kChunk - 1) / kChunk;
  for (std::int64_t c = warp; c < chunks; c += warps) {
    const std::int64_t begin = c * kChunk;
    const std::int64_t end = begin + kChunk < n ? begin + kChunk : n;
    double s = 0.0;
    for (std::int64_t i = begin + lane; i < end; i += 32) {
      const double v = to_float(x[i]);
      s += v * v;
    }
    s = warp_sum(s);  // a fixed butterfly: the same bits every time
    if (lane == 0) exact_add(out, s);
  }
}

}  // namespace

int sum_squares(const LaunchContext& ctx, const void* x, std::int64_t n, Elem dtype,
                ExactSumLayout* result) {
  const int zeroed =
      static_cast<int>(cudaMemsetAsync(result, 0, sizeof(ExactSumLayout), stream_of(ctx)));
  if (zeroed != 0 || n <= 0) return zeroed;
  const std::int64_t chunks = (n + kChunk - 1) / kChunk;
  const std::int64_t wanted = (chunks + kWarps - 1) / kWarps;
  const int blocks = static_cast<int>(wanted < kMaxBlocks ? wanted : kMaxBlocks);
  return dispatch_float(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    sum_squares_kernel<T>
        <<<blocks, kThreads, 0, stream_of(ctx)>>>(static_cast<const T*>(x), n, result);
    return launch_check();
  });
}

}  // namespace strata::kernels
