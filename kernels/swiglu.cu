// SwiGLU, elementwise: out = silu(gate) * up, and its backward.
#include "common.cuh"

namespace strata::kernels {
namespace {

// Threads take kN consecutive elements (one 16-byte vector when kN > 1); the last partial group
// is done element by element.
template <typename T, int kN>
__global__ void swiglu_forward_kernel(const T* __restrict__ gate, const T* __restrict__ up,
                                      T* __restrict__ out, std::int64_t n) {
  const std::int64_t groups = (n + kN - 1) / kN;
  for (std::int64_t gi = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
       gi < groups; gi += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t i0 = gi * kN;
    if constexpr (kN > 1) {
      if (i0 + kN <= n) {
        const Vec16<T> g = load16(gate + i0), u = load16(up + i0);
        Vec16<T> o;
#pragma unroll
        for (int e = 0; e < kN; ++e) {
          const float gv = to_float(g.v[e]);
          o.v[e] = from_float<T>(gv / (1.0f + expf(-gv)) * to_float(u.v[e]));
        }
        store16(out + i0, o);
        continue;
      }
    }
    for (std::int64_t i = i0; i < n && i < i0 + kN; ++i) {
      const float gv = to_float(gate[i]);
      out[i] = from_float<T>(gv / (1.0f + expf(-gv)) * to_float(up[i]));
    }
  }
}

__device__ __forceinline__ void swiglu_grad(float dv, float gv, float uv, float& dg, float& du) {
  const float sig = 1.0f / (1.0f + expf(-gv));
  const float silu = gv * sig;
  dg = dv * uv * sig * (1.0f + gv * (1.0f - sig));
  du = dv * silu;
}

template <typename T, int kN>
// dgate may be gate and dup up (the block's backward writes them in place): no __restrict__
// there; each element's inputs are loaded before its outputs are stored.
__global__ void swiglu_backward_kernel(const T* __restrict__ dout, const T* gate, const T* up,
                                       T* dgate, T* dup, std::int64_t n) {
  const std::int64_t groups = (n + kN - 1) / kN;
  for (std::int64_t gi = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
       gi < groups; gi += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t i0 = gi * kN;
    if constexpr (kN > 1) {
      if (i0 + kN <= n) {
        const Vec16<T> d = load16(dout + i0), g = load16(gate + i0), u = load16(up + i0);
        Vec16<T> dg, du;
#pragma unroll
        for (int e = 0; e < kN; ++e) {
          float a, b;
          swiglu_grad(to_float(d.v[e]), to_float(g.v[e]), to_float(u.v[e]), a, b);
          dg.v[e] = from_float<T>(a);
          du.v[e] = from_float<T>(b);
        }
        store16(dgate + i0, dg);
        store16(dup + i0, du);
        continue;
      }
    }
    for (std::int64_t i = i0; i < n && i < i0 + kN; ++i) {
      float a, b;
      swiglu_grad(to_float(dout[i]), to_float(gate[i]), to_float(up[i]), a, b);
      dgate[i] = from_float<T>(a);
      dup[i] = from_float<T>(b);
    }
  }
}

constexpr int kThreads = 256;

}  // namespace

int swiglu_forward(const LaunchContext& ctx, const void* gate, const void* up, void* out,
                   std::int64_t n, Elem dtype) {
  if (n <= 0) return 0;
  return dispatch_float(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int kVec = Vec16<T>::kN;
    const T* g = static_cast<const T*>(gate);
    const T* u = static_cast<const T*>(up);
    T* o = static_cast<T*>(out);
    if (aligned16(gate) && aligned16(up) && aligned16(out)) {
      swiglu_forward_kernel<T, kVec>
          <<<grid_for((n + kVec - 1) / kVec, kThreads), kThreads, 0, stream_of(ctx)>>>(g, u, o, n);
    } else {
      swiglu_forward_kernel<T, 1>
          <<<grid_for(n, kThreads), kThreads, 0, stream_of(ctx)>>>(g, u, o, n);
    }
    return launch_check();
  });
}

int swiglu_backward(const LaunchContext& ctx, const void* dout, const void* gate, const void* up,
                    void* dgate, void* dup, std::int64_t n, Elem dtype) {
  if (n <= 0) return 0;
  return dispatch_float(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int kVec = Vec16<T>::kN;
    const T* d = static_cast<const T*>(dout);
    const T* g = static_cast<const T*>(gate);
    const T* u = static_cast<const T*>(up);
    T* dg = static_cast<T*>(dgate);
    T* du = static_cast<T*>(dup);
    if (aligned16(dout) && aligned16(gate) && aligned16(up) && aligned16(dgate) && aligned16(dup)) {
      swiglu_backward_kernel<T, kVec>
          <<<grid_for((n + kVec - 1) / kVec, kThreads), kThreads, 0, stream_of(ctx)>>>(d, g, u, dg,
                                                                                       du, n);
    } else {
      swiglu_backward_kernel<T, 1>
          <<<grid_for(n, kThreads), kThreads, 0, stream_of(ctx)>>>(d, g, u, dg, du, n);
    }
    return launch_check();
  });
}

}  // namespace strata::kernels
