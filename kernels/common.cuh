// Device-side helpers shared by the kernels: element conversion, 16-byte vectors, warp and
// block reductions, dtype dispatch and the launch check.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "launchers.h"

namespace strata::kernels {

using bf16_t = __nv_bfloat16;
using f16_t = __half;

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(bf16_t x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(f16_t x) { return __half2float(x); }

// Round to nearest even, like strata::f32_to_bf16 / f32_to_f16 on the host.
template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ bf16_t from_float<bf16_t>(float x) {
  return __float2bfloat16_rn(x);
}
template <>
__device__ __forceinline__ f16_t from_float<f16_t>(float x) {
  return __float2half_rn(x);
}

// kN elements of T in one 16-byte load or store.
template <typename T>
struct alignas(16) Vec16 {
  static constexpr int kN = 16 / sizeof(T);
  T v[kN];
};

template <typename T>
__device__ __forceinline__ Vec16<T> load16(const T* p) {
  Vec16<T> r;
  *reinterpret_cast<uint4*>(&r) = *reinterpret_cast<const uint4*>(p);
  return r;
}
template <typename T>
__device__ __forceinline__ void store16(T* p, const Vec16<T>& v) {
  *reinterpret_cast<uint4*>(p) = *reinterpret_cast<const uint4*>(&v);
}

inline bool aligned16(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }

template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the block, returned to every thread; `red` is shared scratch of 32 T. blockDim.x
// must be a multiple of 32. The leading barrier makes back-to-back calls safe.
template <typename T>
__device__ __forceinline__ T block_sum(T v, T* red) {
  v = warp_sum(v);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  T t = lane < static_cast<int>(blockDim.x >> 5) ? red[lane] : T(0);
  return warp_sum(t);
}
__device__ __forceinline__ float block_max(float v, float* red) {
  v = warp_max(v);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  float t = lane < static_cast<int>(blockDim.x >> 5) ? red[lane] : -INFINITY;
  return warp_max(t);
}
// Maximum over each run of kWarps consecutive warps (block_max's over a part of the block),
// returned to every thread of the run; the same scratch and barriers as block_max.
template <int kWarps>
__device__ __forceinline__ float segment_max(float v, float* red) {
  v = warp_max(v);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  const int first = warp / kWarps * kWarps;
  float m = red[first];
  for (int j = 1; j < kWarps; ++j) m = fmaxf(m, red[first + j]);
  return m;
}

template <typename T>
struct Tag {
  using type = T;
};

// Calls fn(Tag<T>{}) for the storage type of `dtype`.
template <typename Fn>
int dispatch_float(Elem dtype, Fn&& fn) {
  switch (dtype) {
    case Elem::kF32:
      return fn(Tag<float>{});
    case Elem::kBF16:
      return fn(Tag<bf16_t>{});
    case Elem::kF16:
      return fn(Tag<f16_t>{});
  }
  return static_cast<int>(cudaErrorInvalidValue);
}

inline std::size_t elem_size(Elem dtype) { return dtype == Elem::kF32 ? 4 : 2; }

// Blocks for a grid-stride loop over `work` items: enough to fill any current GPU several
// times over, few enough that each thread loops a while.
inline unsigned grid_for(std::int64_t work, int threads) {
  const std::int64_t blocks = (work + threads - 1) / threads;
  return static_cast<unsigned>(blocks < 1 ? 1 : (blocks > 65536 ? 65536 : blocks));
}

// Every launch is followed by this: it reports (and clears) launch-configuration errors and
// any sticky fault from earlier work.
inline int launch_check() { return static_cast<int>(cudaGetLastError()); }

inline cudaStream_t stream_of(const LaunchContext& ctx) {
  return static_cast<cudaStream_t>(ctx.stream);
}

}  // namespace strata::kernels
