// Softmax cross-entropy fused over the vocabulary: one block per row, the row read once for an
// online max/sum and once more to write the gradient (which may overwrite the logits).
#include "common.cuh"

namespace strata::kernels {
namespace {

constexpr int kThreads = 512;

// Merges a running (max, sum of exp(z - max)) with one more value.
__device__ __forceinline__ void online_add(float z, float& m, float& s) {
  if (z > m) {
    s = s * expf(m - z) + 1.0f;  // m = -inf gives 0 * 0 + 1: exp(-inf) is 0
    m = z;
  } else if (z != -INFINITY) {  // -inf adds nothing (and -inf - -inf would be NaN)
    s += expf(z - m);
  }
}

// logits, dlogits: [rows, vocab]; no __restrict__ on them: dlogits may alias logits. Every
// element a thread writes in the second pass is one it alone read, and the first pass ends
// at a barrier, so in-place is safe.
template <typename T, bool kVec>
__global__ void __launch_bounds__(kThreads)
    cross_entropy_kernel(const T* logits, const std::int32_t* __restrict__ targets,
                         float* __restrict__ losses, T* dlogits, std::int64_t vocab,
                         float dloss_scale) {
  constexpr int kN = kVec ? Vec16<T>::kN : 1;
  __shared__ float red[32];
  __shared__ float target_logit;
  const std::int64_t row = blockIdx.x;
  const std::int32_t t = targets[row];
  const T* z = logits + row * vocab;
  T* d = dlogits == nullptr ? nullptr : dlogits + row * vocab;
  // Targets are checked on the host before any launch (llama.cpp); one out of range here still
  // reads nothing outside its row: its loss is NaN, which the trainer reports, and no gradient.
  if (t < 0 || t >= vocab) {  // t < 0: an ignored position, no loss and no gradient
    if (threadIdx.x == 0) losses[row] = t < 0 ? 0.0f : NAN;
    if (d != nullptr) {
      for (std::int64_t j = threadIdx.x; j < vocab; j += blockDim.x) d[j] = from_float<T>(0.0f);
    }
    return;
  }
  if (threadIdx.x == 0) target_logit = to_float(z[t]);
  float m = -INFINITY, s = 0.0f;
  for (std::int64_t j = static_cast<std::int64_t>(threadIdx.x) * kN; j < vocab;
       j += static_cast<std::int64_t>(blockDim.x) * kN) {
    if constexpr (kVec) {
      const Vec16<T> v = load16(z + j);
#pragma unroll
      for (int e = 0; e < kN; ++e) online_add(to_float(v.v[e]), m, s);
    } else {
      online_add(to_float(z[j]), m, s);
    }
  }
  const float row_max = block_max(m, red);
  const float row_sum = block_sum(m == -INFINITY ? 0.0f : s * expf(m - row_max), red);
  // block_sum's barriers also publish target_logit.
  if (threadIdx.x == 0) {
    losses[row] = static_cast<float>(log(static_cast<double>(row_sum)) +
                                     static_cast<double>(row_max - target_logit));
  }
  if (d == nullptr) return;
  const float inv = static_cast<float>(1.0 / static_cast<double>(row_sum));
  for (std::int64_t j = static_cast<std::int64_t>(threadIdx.x) * kN; j < vocab;
       j += static_cast<std::int64_t>(blockDim.x) * kN) {
    if constexpr (kVec) {
      const Vec16<T> v = load16(z + j);
      Vec16<T> o;
#pragma unroll
      for (int e = 0; e < kN; ++e) {
        const float p = expf(to_float(v.v[e]) - row_max) * inv - (j + e == t ? 1.0f : 0.0f);
        o.v[e] = from_float<T>(p * dloss_scale);
      }
      store16(d + j, o);
    } else {
      const float p = expf(to_float(z[j]) - row_max) * inv - (j == t ? 1.0f : 0.0f);
      d[j] = from_float<T>(p * dloss_scale);
    }
  }
}

// One block per row: the slice's (max, sum of exp(z - max)) and the target's logit if the
// slice holds it (Ops::cross_entropy_stats).
template <typename T>
__global__ void __launch_bounds__(kThreads)
    cross_entropy_stats_kernel(const T* __restrict__ logits,
                               const std::int32_t* __restrict__ targets, std::int64_t vocab,
                               std::int64_t vocab_begin, float* __restrict__ stats) {
  __shared__ float red[32];
  const std::int64_t row = blockIdx.x;
  const std::int64_t t = targets[row];
  float* st = stats + 3 * row;
  if (t < 0) {
    if (threadIdx.x == 0) {
      st[0] = -INFINITY;
      st[1] = st[2] = 0.0f;
    }
    return;
  }
  const T* z = logits + row * vocab;
  float m = -INFINITY, s = 0.0f;
  for (std::int64_t j = threadIdx.x; j < vocab; j += blockDim.x) online_add(to_float(z[j]), m, s);
  const float row_max = block_max(m, red);
  const float row_sum = block_sum(m == -INFINITY ? 0.0f : s * expf(m - row_max), red);
  if (threadIdx.x == 0) {
    const std::int64_t local = t - vocab_begin;
    st[0] = row_max;
    st[1] = row_sum;
    st[2] = local >= 0 && local < vocab ? to_float(z[local]) : 0.0f;
  }
}

// dlogits = (exp(z - row_max) / row_sum - onehot) * dloss_scale; each element read then written
// by one thread, so dlogits may alias logits.
template <typename T>
__global__ void cross_entropy_grad_kernel(const T* logits, const std::int32_t* __restrict__ targets,
                                          std::int64_t rows, std::int64_t vocab,
                                          std::int64_t vocab_begin,
                                          const float* __restrict__ row_max,
                                          const float* __restrict__ row_sum, T* dlogits,
                                          float dloss_scale) {
  const std::int64_t total = rows * vocab;
  for (std::int64_t idx = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
       idx < total; idx += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t r = idx / vocab, j = idx - r * vocab;
    const std::int64_t t = targets[r];
    if (t < 0) {
      dlogits[idx] = from_float<T>(0.0f);
      continue;
    }
    const float inv = static_cast<float>(1.0 / static_cast<double>(row_sum[r]));
    const float p =
        expf(to_float(logits[idx]) - row_max[r]) * inv - (j + vocab_begin == t ? 1.0f : 0.0f);
    dlogits[idx] = from_float<T>(p * dloss_scale);
  }
}

}  // namespace

int cross_entropy_stats(const LaunchContext& ctx, const void* logits, const std::int32_t* targets,
                        std::int64_t rows, std::int64_t vocab, std::int64_t vocab_begin,
                        float* stats, Elem dtype) {
  if (rows <= 0) return 0;
  if (vocab <= 0 || rows > 0x7fffffff) return static_cast<int>(cudaErrorInvalidValue);
  return dispatch_float(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    cross_entropy_stats_kernel<T><<<static_cast<unsigned>(rows), kThreads, 0, stream_of(ctx)>>>(
        static_cast<const T*>(logits), targets, vocab, vocab_begin, stats);
    return launch_check();
  });
}

int cross_entropy_grad(const LaunchContext& ctx, const void* logits, const std::int32_t* targets,
                       std::int64_t rows, std::int64_t vocab, std::int64_t vocab_begin,
                       const float* row_max, const float* row_sum, void* dlogits, float dloss_scale,
                       Elem dtype) {
  if (rows <= 0) return 0;
  if (vocab <= 0) return static_cast<int>(cudaErrorInvalidValue);
  return dispatch_float(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    cross_entropy_grad_kernel<T><<<grid_for(rows * vocab, 256), 256, 0, stream_of(ctx)>>>(
        static_cast<const T*>(logits), targets, rows, vocab, vocab_begin, row_max, row_sum,
        static_cast<T*>(dlogits), dloss_scale);
    return launch_check();
  });
}

int cross_entropy(const LaunchContext& ctx, const void* logits, const std::int32_t* targets,
                  float* losses, void* dlogits, std::int64_t rows, std::int64_t vocab,
                  float dloss_scale, Elem dtype) {
  if (rows <= 0) return 0;
  if (vocab <= 0 || rows > 0x7fffffff) return static_cast<int>(cudaErrorInvalidValue);
  return dispatch_float(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* z = static_cast<const T*>(logits);
    T* d = static_cast<T*>(dlogits);
    const bool vec = vocab % Vec16<T>::kN == 0 && aligned16(logits) &&
                     (dlogits == nullptr || aligned16(dlogits));
    const auto blocks = static_cast<unsigned>(rows);
    if (vec) {
      cross_entropy_kernel<T, true>
          <<<blocks, kThreads, 0, stream_of(ctx)>>>(z, targets, losses, d, vocab, dloss_scale);
    } else {
      cross_entropy_kernel<T, false>
          <<<blocks, kThreads, 0, stream_of(ctx)>>>(z, targets, losses, d, vocab, dloss_scale);
    }
    return launch_check();
  });
}

}  // namespace strata::kernels
