// Elementwise conversion between f32, bf16 and f16 (round to nearest even, as on the host).
#include "common.cuh"

namespace strata::kernels {
namespace {

constexpr int kPack = 8;  // elements per thread: 16 bytes of bf16/f16, 32 of f32

template <typename T>
struct alignas(kPack * sizeof(T)) Pack {
  T v[kPack];
};

template <typename S, typename D, bool kVec>
__global__ void cast_kernel(const S* __restrict__ src, D* __restrict__ dst, std::int64_t n) {
  const std::int64_t groups = (n + kPack - 1) / kPack;
  for (std::int64_t gi = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
       gi < groups; gi += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t i0 = gi * kPack;
    if constexpr (kVec) {
      if (i0 + kPack <= n) {
        const Pack<S> in = *reinterpret_cast<const Pack<S>*>(src + i0);
        Pack<D> out;
#pragma unroll
        for (int e = 0; e < kPack; ++e) out.v[e] = from_float<D>(to_float(in.v[e]));
        *reinterpret_cast<Pack<D>*>(dst + i0) = out;
        continue;
      }
    }
    for (std::int64_t i = i0; i < n && i < i0 + kPack; ++i)
      dst[i] = from_float<D>(to_float(src[i]));
  }
}

bool aligned_to(const void* p, std::size_t a) {
  return reinterpret_cast<std::uintptr_t>(p) % a == 0;
}

}  // namespace

int cast(const LaunchContext& ctx, const void* src, Elem src_dtype, void* dst, Elem dst_dtype,
         std::int64_t n) {
  if (n <= 0) return 0;
  if (src_dtype == dst_dtype) return static_cast<int>(cudaErrorInvalidValue);
  constexpr int kThreads = 256;
  return dispatch_float(src_dtype, [&](auto stag) {
    using S = typename decltype(stag)::type;
    return dispatch_float(dst_dtype, [&](auto dtag) {
      using D = typename decltype(dtag)::type;
      const S* s = static_cast<const S*>(src);
      D* d = static_cast<D*>(dst);
      const unsigned blocks = grid_for((n + kPack - 1) / kPack, kThreads);
      if (aligned_to(src, sizeof(Pack<S>)) && aligned_to(dst, sizeof(Pack<D>))) {
        cast_kernel<S, D, true><<<blocks, kThreads, 0, stream_of(ctx)>>>(s, d, n);
      } else {
        cast_kernel<S, D, false><<<blocks, kThreads, 0, stream_of(ctx)>>>(s, d, n);
      }
      return launch_check();
    });
  });
}

}  // namespace strata::kernels
