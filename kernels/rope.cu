// Rotary position embedding in place (Hugging Face rotate_half pairs (j, j + head_dim / 2)),
// with the angle table computed in double exactly as the CPU backend computes it.
#include "common.cuh"

namespace strata::kernels {
namespace {

// table[p * half + j] = (cos, sin) of (p + position_offset) * inv_freq(j), in double, rounded
// to float (positions up to 10^5 need more than float's 24 bits for the angle); sin negated for
// the inverse rotation. inv_freq is the one the CPU backend uses (strata/device/rope.h).
__global__ void rope_table_kernel(float2* __restrict__ table, std::int64_t seq, std::int64_t half,
                                  std::int64_t head_dim, const device::RopeParams params,
                                  bool inverse) {
  const std::int64_t total = seq * half;
  for (std::int64_t idx = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
       idx < total; idx += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t p = idx / half, j = idx - p * half;
    const double inv_freq = params.inv_freq(j, head_dim);
    const double angle = static_cast<double>(p + params.position_offset) * inv_freq;
    double s, c;
    sincos(angle, &s, &c);
    table[idx] = make_float2(static_cast<float>(c), static_cast<float>(inverse ? -s : s));
  }
}

// x: [batch * seq, heads, head_dim]; one thread rotates kN consecutive pairs of one head.
template <typename T, int kN>
__global__ void rope_apply_kernel(T* __restrict__ x, const float2* __restrict__ table,
                                  std::int64_t rows, std::int64_t seq, std::int64_t heads,
                                  std::int64_t half) {
  const std::int64_t groups = half / kN;
  const std::int64_t total = rows * heads * groups;
  for (std::int64_t idx = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
       idx < total; idx += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t g = idx % groups;
    const std::int64_t rh = idx / groups;  // row * heads + head
    const std::int64_t pos = (rh / heads) % seq;
    T* v = x + rh * 2 * half + g * kN;
    const float2* cs = table + pos * half + g * kN;
    float a[kN], b[kN];
    if constexpr (kN == Vec16<T>::kN) {
      const Vec16<T> va = load16(v), vb = load16(v + half);
#pragma unroll
      for (int e = 0; e < kN; ++e) {
        a[e] = to_float(va.v[e]);
        b[e] = to_float(vb.v[e]);
      }
    } else {
#pragma unroll
      for (int e = 0; e < kN; ++e) {
        a[e] = to_float(v[e]);
        b[e] = to_float(v[e + half]);
      }
    }
    T ra[kN], rb[kN];
#pragma unroll
    for (int e = 0; e < kN; ++e) {
      const float2 t = cs[e];
      ra[e] = from_float<T>(a[e] * t.x - b[e] * t.y);
      rb[e] = from_float<T>(b[e] * t.x + a[e] * t.y);
    }
    if constexpr (kN == Vec16<T>::kN) {
      Vec16<T> va, vb;
#pragma unroll
      for (int e = 0; e < kN; ++e) {
        va.v[e] = ra[e];
        vb.v[e] = rb[e];
      }
      store16(v, va);
      store16(v + half, vb);
    } else {
#pragma unroll
      for (int e = 0; e < kN; ++e) {
        v[e] = ra[e];
        v[e + half] = rb[e];
      }
    }
  }
}

}  // namespace

std::size_t rope_scratch_bytes(std::int64_t seq, std::int64_t head_dim) {
  return static_cast<std::size_t>(seq * (head_dim / 2)) * sizeof(float2);
}

int rope(const LaunchContext& ctx, void* x, std::int64_t batch, std::int64_t seq,
         std::int64_t heads, std::int64_t head_dim, const device::RopeParams& params, bool inverse,
         Elem dtype, void* scratch) {
  if (head_dim % 2 != 0) return static_cast<int>(cudaErrorInvalidValue);
  if (batch <= 0 || seq <= 0 || heads <= 0 || head_dim <= 0) return 0;
  const std::int64_t half = head_dim / 2;
  auto* table = static_cast<float2*>(scratch);
  constexpr int kThreads = 256;
  rope_table_kernel<<<grid_for(seq * half, kThreads), kThreads, 0, stream_of(ctx)>>>(
      table, seq, half, head_dim, params, inverse);
  if (const int e = launch_check(); e != 0) return e;
  return dispatch_float(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int kVec = Vec16<T>::kN;
    T* xs = static_cast<T*>(x);
    const std::int64_t rows = batch * seq;
    if (half % kVec == 0 && aligned16(x)) {
      rope_apply_kernel<T, kVec>
          <<<grid_for(rows * heads * (half / kVec), kThreads), kThreads, 0, stream_of(ctx)>>>(
              xs, table, rows, seq, heads, half);
    } else {
      rope_apply_kernel<T, 1>
          <<<grid_for(rows * heads * half, kThreads), kThreads, 0, stream_of(ctx)>>>(
              xs, table, rows, seq, heads, half);
    }
    return launch_check();
  });
}

}  // namespace strata::kernels
