// Elementwise add, out = a + b, where out may alias a or b (no __restrict__ here).
#include "common.cuh"

namespace strata::kernels {
namespace {

template <typename T, int kN>
__global__ void add_kernel(const T* a, const T* b, T* out, std::int64_t n) {
  const std::int64_t groups = (n + kN - 1) / kN;
  for (std::int64_t gi = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
       gi < groups; gi += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t i0 = gi * kN;
    if constexpr (kN > 1) {
      if (i0 + kN <= n) {
        // Both inputs are loaded before the store, so aliasing is safe element for element.
        const Vec16<T> x = load16(a + i0), y = load16(b + i0);
        Vec16<T> o;
#pragma unroll
        for (int e = 0; e < kN; ++e) o.v[e] = from_float<T>(to_float(x.v[e]) + to_float(y.v[e]));
        store16(out + i0, o);
        continue;
      }
    }
    for (std::int64_t i = i0; i < n && i < i0 + kN; ++i) {
      out[i] = from_float<T>(to_float(a[i]) + to_float(b[i]));
    }
  }
}

}  // namespace

int add(const LaunchContext& ctx, const void* a, const void* b, void* out, std::int64_t n,
        Elem dtype) {
  if (n <= 0) return 0;
  constexpr int kThreads = 256;
  return dispatch_float(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int kVec = Vec16<T>::kN;
    const T* x = static_cast<const T*>(a);
    const T* y = static_cast<const T*>(b);
    T* o = static_cast<T*>(out);
    if (aligned16(a) && aligned16(b) && aligned16(out)) {
      add_kernel<T, kVec>
          <<<grid_for((n + kVec - 1) / kVec, kThreads), kThreads, 0, stream_of(ctx)>>>(x, y, o, n);
    } else {
      add_kernel<T, 1><<<grid_for(n, kThreads), kThreads, 0, stream_of(ctx)>>>(x, y, o, n);
    }
    return launch_check();
  });
}

}  // namespace strata::kernels
