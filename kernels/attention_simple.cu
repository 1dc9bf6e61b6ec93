// Causal GQA attention, optionally within a sliding window, the simple kernels: one block per
// query row (forward, dq) or key row (dk, dv), scores for a chunk of keys in shared memory with
// an online softmax across chunks; a row visits only the keys (queries) its window covers.
// Any head_dim up to 512 and any dtype; never holds more than a chunk of a score row. They are
// the reference the flash kernels are tested against, and the fallback where flash does not
// apply (f32, other head sizes).
#include "common.cuh"

namespace strata::kernels {
namespace {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kChunk = 128;        // keys (or queries) whose scores are held at once
constexpr int kDimsPerThread = 4;  // head_dim <= kThreads * kDimsPerThread
constexpr int kMaxHeadDim = kThreads * kDimsPerThread;

struct Shape {
  std::int64_t seq, heads, kv_heads, hd, group;
  std::int64_t window;  // 0: full causal (also for any window not below seq)
  float scale;
};

Shape shape_of(const AttentionDims& d) {
  return Shape{d.seq,
               d.heads,
               d.kv_heads,
               d.head_dim,
               d.group(),
               d.bounded_window(),
               1.0f / sqrtf(static_cast<float>(d.head_dim))};
}

// The first key query i attends to, and one past the last query key j is attended by.
__device__ __forceinline__ std::int64_t first_key(const Shape& d, std::int64_t i) {
  return d.window > 0 && i - d.window + 1 > 0 ? i - d.window + 1 : 0;
}
__device__ __forceinline__ std::int64_t query_end(const Shape& d, std::int64_t j) {
  return d.window > 0 && j + d.window < d.seq ? j + d.window : d.seq;
}

// Element offset of row (b, s) of head h in a [batch, seq, num_heads, hd] tensor.
__device__ __forceinline__ std::int64_t row_offset(const Shape& d, std::int64_t b, std::int64_t s,
                                                   std::int64_t num_heads, std::int64_t h) {
  return ((b * d.seq + s) * num_heads + h) * d.hd;
}

// grid (queries, heads, batch). Query row i of q/out ([batch, q_rows, heads, hd]) sits at
// position past + i of the keys ([batch, seq, kv_heads, hd]): past 0 and q_rows = seq for
// training, past = the tokens already cached when decoding. lse may be null (decoding).
// Shared: q row [hd], scores [kChunk].
template <typename T>
__global__ void __launch_bounds__(kThreads)
    forward_simple_kernel(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                          T* __restrict__ out, float* __restrict__ lse, Shape d, std::int64_t past,
                          std::int64_t q_rows) {
  extern __shared__ float smem[];
  __shared__ float red[32];
  float* qs = smem;
  float* sc = smem + d.hd;
  const std::int64_t qi = blockIdx.x, h = blockIdx.y, b = blockIdx.z, g = h / d.group;
  const std::int64_t i = past + qi;  // the query's position among the keys
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const std::int64_t qoff = ((b * q_rows + qi) * d.heads + h) * d.hd;
  const T* qrow = q + qoff;
  for (std::int64_t x = threadIdx.x; x < d.hd; x += kThreads) qs[x] = to_float(qrow[x]);
  __syncthreads();
  float acc[kDimsPerThread] = {};
  float m = -INFINITY, l = 0.0f;
  for (std::int64_t j0 = first_key(d, i); j0 <= i; j0 += kChunk) {
    const int jn = static_cast<int>(i + 1 - j0 < kChunk ? i + 1 - j0 : kChunk);
    for (int jj = warp; jj < jn; jj += kWarps) {
      const T* krow = k + row_offset(d, b, j0 + jj, d.kv_heads, g);
      float s = 0.0f;
      for (std::int64_t x = lane; x < d.hd; x += 32) s += qs[x] * to_float(krow[x]);
      s = warp_sum(s);
      if (lane == 0) sc[jj] = d.scale * s;
    }
    __syncthreads();
    float cm = -INFINITY;
    for (int jj = threadIdx.x; jj < jn; jj += kThreads) cm = fmaxf(cm, sc[jj]);
    const float m_new = fmaxf(m, block_max(cm, red));
    const float alpha = expf(m - m_new);  // 0 on the first chunk (m = -inf)
    float ps = 0.0f;
    for (int jj = threadIdx.x; jj < jn; jj += kThreads) {
      const float p = expf(sc[jj] - m_new);
      sc[jj] = p;
      ps += p;
    }
    l = l * alpha + block_sum(ps, red);  // its barriers also publish sc
#pragma unroll
    for (int e = 0; e < kDimsPerThread; ++e) {
      const std::int64_t x = threadIdx.x + e * kThreads;
      if (x >= d.hd) break;
      float a = acc[e] * alpha;
      for (int jj = 0; jj < jn; ++jj) {
        a += sc[jj] * to_float(v[row_offset(d, b, j0 + jj, d.kv_heads, g) + x]);
      }
      acc[e] = a;
    }
    m = m_new;
    __syncthreads();  // sc is rewritten by the next chunk
  }
  T* orow = out + qoff;
#pragma unroll
  for (int e = 0; e < kDimsPerThread; ++e) {
    const std::int64_t x = threadIdx.x + e * kThreads;
    if (x < d.hd) orow[x] = from_float<T>(acc[e] / l);
  }
  if (threadIdx.x == 0 && lse != nullptr) lse[(b * d.heads + h) * q_rows + qi] = m + logf(l);
}

// One warp per (b, s, h) row: drow[b, h, s] = dout . out.
template <typename T>
__global__ void row_dot_kernel(const T* __restrict__ dout, const T* __restrict__ out,
                               float* __restrict__ drow, Shape d, std::int64_t batch) {
  const std::int64_t rows = batch * d.seq * d.heads;
  const std::int64_t r =
      blockIdx.x * static_cast<std::int64_t>(blockDim.x / 32) + (threadIdx.x >> 5);
  if (r >= rows) return;
  const int lane = threadIdx.x & 31;
  const T* a = dout + r * d.hd;
  const T* o = out + r * d.hd;
  float s = 0.0f;
  for (std::int64_t x = lane; x < d.hd; x += 32) s += to_float(a[x]) * to_float(o[x]);
  s = warp_sum(s);
  if (lane == 0) {
    const std::int64_t h = r % d.heads, bs = r / d.heads, b = bs / d.seq, i = bs % d.seq;
    drow[(b * d.heads + h) * d.seq + i] = s;
  }
}

// dq_i = sum_{first_key(i) <= j <= i} dS_ij k_j with P_ij = exp(scale q_i.k_j - lse_i) and
// dS_ij = scale P_ij (dout_i.v_j - D_i). grid (seq, heads, batch).
template <typename T>
__global__ void __launch_bounds__(kThreads)
    dq_simple_kernel(const T* __restrict__ dout, const T* __restrict__ q, const T* __restrict__ k,
                     const T* __restrict__ v, const float* __restrict__ lse,
                     const float* __restrict__ drow, T* __restrict__ dq, Shape d) {
  extern __shared__ float smem[];
  float* qs = smem;
  float* dos = smem + d.hd;
  float* sc = smem + 2 * d.hd;
  const std::int64_t i = blockIdx.x, h = blockIdx.y, b = blockIdx.z, g = h / d.group;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const std::int64_t qoff = row_offset(d, b, i, d.heads, h);
  for (std::int64_t x = threadIdx.x; x < d.hd; x += kThreads) {
    qs[x] = to_float(q[qoff + x]);
    dos[x] = to_float(dout[qoff + x]);
  }
  const float li = lse[(b * d.heads + h) * d.seq + i];
  const float di = drow[(b * d.heads + h) * d.seq + i];
  __syncthreads();
  float acc[kDimsPerThread] = {};
  for (std::int64_t j0 = first_key(d, i); j0 <= i; j0 += kChunk) {
    const int jn = static_cast<int>(i + 1 - j0 < kChunk ? i + 1 - j0 : kChunk);
    for (int jj = warp; jj < jn; jj += kWarps) {
      const std::int64_t koff = row_offset(d, b, j0 + jj, d.kv_heads, g);
      float s = 0.0f, dp = 0.0f;
      for (std::int64_t x = lane; x < d.hd; x += 32) {
        s += qs[x] * to_float(k[koff + x]);
        dp += dos[x] * to_float(v[koff + x]);
      }
      s = warp_sum(s);
      dp = warp_sum(dp);
      if (lane == 0) {
        const float p = expf(d.scale * s - li);
        sc[jj] = p * (dp - di) * d.scale;
      }
    }
    __syncthreads();
#pragma unroll
    for (int e = 0; e < kDimsPerThread; ++e) {
      const std::int64_t x = threadIdx.x + e * kThreads;
      if (x >= d.hd) break;
      float a = acc[e];
      for (int jj = 0; jj < jn; ++jj) {
        a += sc[jj] * to_float(k[row_offset(d, b, j0 + jj, d.kv_heads, g) + x]);
      }
      acc[e] = a;
    }
    __syncthreads();
  }
#pragma unroll
  for (int e = 0; e < kDimsPerThread; ++e) {
    const std::int64_t x = threadIdx.x + e * kThreads;
    if (x < d.hd) dq[qoff + x] = from_float<T>(acc[e]);
  }
}

// dv_j = sum_h sum_{j <= i < query_end(j)} P_ij dout_i and dk_j = sum_h sum_i dS_ij q_i (same
// i) over the query heads h sharing kv head g, in head order. grid (seq, kv_heads, batch).
template <typename T>
__global__ void __launch_bounds__(kThreads)
    dkdv_simple_kernel(const T* __restrict__ dout, const T* __restrict__ q, const T* __restrict__ k,
                       const T* __restrict__ v, const float* __restrict__ lse,
                       const float* __restrict__ drow, T* __restrict__ dk, T* __restrict__ dv,
                       Shape d) {
  extern __shared__ float smem[];
  float* ks = smem;
  float* vs = smem + d.hd;
  float* sp = smem + 2 * d.hd;
  float* sds = sp + kChunk;
  const std::int64_t j = blockIdx.x, g = blockIdx.y, b = blockIdx.z;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const std::int64_t koff = row_offset(d, b, j, d.kv_heads, g);
  for (std::int64_t x = threadIdx.x; x < d.hd; x += kThreads) {
    ks[x] = to_float(k[koff + x]);
    vs[x] = to_float(v[koff + x]);
  }
  __syncthreads();
  float acc_k[kDimsPerThread] = {}, acc_v[kDimsPerThread] = {};
  const std::int64_t i_end = query_end(d, j);
  for (std::int64_t h = g * d.group; h < (g + 1) * d.group; ++h) {
    const float* lse_h = lse + (b * d.heads + h) * d.seq;
    const float* drow_h = drow + (b * d.heads + h) * d.seq;
    for (std::int64_t i0 = j; i0 < i_end; i0 += kChunk) {
      const int in = static_cast<int>(i_end - i0 < kChunk ? i_end - i0 : kChunk);
      for (int ii = warp; ii < in; ii += kWarps) {
        const std::int64_t qoff = row_offset(d, b, i0 + ii, d.heads, h);
        float s = 0.0f, dp = 0.0f;
        for (std::int64_t x = lane; x < d.hd; x += 32) {
          s += to_float(q[qoff + x]) * ks[x];
          dp += to_float(dout[qoff + x]) * vs[x];
        }
        s = warp_sum(s);
        dp = warp_sum(dp);
        if (lane == 0) {
          const float p = expf(d.scale * s - lse_h[i0 + ii]);
          sp[ii] = p;
          sds[ii] = p * (dp - drow_h[i0 + ii]) * d.scale;
        }
      }
      __syncthreads();
#pragma unroll
      for (int e = 0; e < kDimsPerThread; ++e) {
        const std::int64_t x = threadIdx.x + e * kThreads;
        if (x < d.hd) {  // not a break: every acc_k/acc_v index stays a constant (registers)
          float ak = acc_k[e], av = acc_v[e];
          for (int ii = 0; ii < in; ++ii) {
            const std::int64_t qoff = row_offset(d, b, i0 + ii, d.heads, h);
            av += sp[ii] * to_float(dout[qoff + x]);
            ak += sds[ii] * to_float(q[qoff + x]);
          }
          acc_k[e] = ak;
          acc_v[e] = av;
        }
      }
      __syncthreads();
    }
  }
#pragma unroll
  for (int e = 0; e < kDimsPerThread; ++e) {
    const std::int64_t x = threadIdx.x + e * kThreads;
    if (x < d.hd) {
      dk[koff + x] = from_float<T>(acc_k[e]);
      dv[koff + x] = from_float<T>(acc_v[e]);
    }
  }
}

bool valid(const AttentionDims& d) {
  return d.batch > 0 && d.seq > 0 && d.heads > 0 && d.kv_heads > 0 && d.heads % d.kv_heads == 0 &&
         d.head_dim > 0 && d.head_dim <= kMaxHeadDim && d.seq <= 0x7fffffff && d.heads <= 65535 &&
         d.batch <= 65535;
}

}  // namespace

int attention_forward_simple(const LaunchContext& ctx, const void* q, const void* k, const void* v,
                             void* out, float* lse, const AttentionDims& d, Elem dtype) {
  if (d.seq == 0 || d.batch == 0) return 0;
  if (!valid(d)) return static_cast<int>(cudaErrorInvalidValue);
  const Shape s = shape_of(d);
  const dim3 grid(static_cast<unsigned>(d.seq), static_cast<unsigned>(d.heads),
                  static_cast<unsigned>(d.batch));
  const std::size_t smem = static_cast<std::size_t>(d.head_dim + kChunk) * sizeof(float);
  return dispatch_float(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    forward_simple_kernel<T><<<grid, kThreads, smem, stream_of(ctx)>>>(
        static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v),
        static_cast<T*>(out), lse, s, 0, d.seq);
    return launch_check();
  });
}

int attention_decode(const LaunchContext& ctx, const void* q, const void* k_cache,
                     const void* v_cache, void* out, std::int64_t queries, std::int64_t past,
                     const AttentionDims& per_head, Elem dtype) {
  if (queries == 0) return 0;
  AttentionDims d = per_head;
  d.batch = 1;
  d.seq = past + queries;
  if (!valid(d) || queries > 0x7fffffff) return static_cast<int>(cudaErrorInvalidValue);
  const Shape s = shape_of(d);
  const dim3 grid(static_cast<unsigned>(queries), static_cast<unsigned>(d.heads), 1);
  const std::size_t smem = static_cast<std::size_t>(d.head_dim + kChunk) * sizeof(float);
  return dispatch_float(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    forward_simple_kernel<T><<<grid, kThreads, smem, stream_of(ctx)>>>(
        static_cast<const T*>(q), static_cast<const T*>(k_cache), static_cast<const T*>(v_cache),
        static_cast<T*>(out), nullptr, s, past, queries);
    return launch_check();
  });
}

int attention_row_dot(const LaunchContext& ctx, const void* dout, const void* out, float* drow,
                      const AttentionDims& d, Elem dtype) {
  if (d.seq == 0 || d.batch == 0) return 0;
  if (!valid(d)) return static_cast<int>(cudaErrorInvalidValue);
  const Shape s = shape_of(d);
  const std::int64_t rows = d.batch * d.seq * d.heads;
  constexpr int kRowsPerBlock = 8;
  const auto blocks = static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock);
  return dispatch_float(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    row_dot_kernel<T><<<blocks, kRowsPerBlock * 32, 0, stream_of(ctx)>>>(
        static_cast<const T*>(dout), static_cast<const T*>(out), drow, s, d.batch);
    return launch_check();
  });
}

int attention_backward_simple(const LaunchContext& ctx, const void* dout, const void* q,
                              const void* k, const void* v, const float* lse, const float* drow,
                              void* dq, void* dk, void* dv, const AttentionDims& d, Elem dtype) {
  if (d.seq == 0 || d.batch == 0) return 0;
  if (!valid(d)) return static_cast<int>(cudaErrorInvalidValue);
  const Shape s = shape_of(d);
  return dispatch_float(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const dim3 qgrid(static_cast<unsigned>(d.seq), static_cast<unsigned>(d.heads),
                     static_cast<unsigned>(d.batch));
    const std::size_t qsmem = static_cast<std::size_t>(2 * d.head_dim + kChunk) * sizeof(float);
    dq_simple_kernel<T><<<qgrid, kThreads, qsmem, stream_of(ctx)>>>(
        static_cast<const T*>(dout), static_cast<const T*>(q), static_cast<const T*>(k),
        static_cast<const T*>(v), lse, drow, static_cast<T*>(dq), s);
    if (const int e = launch_check(); e != 0) return e;
    const dim3 kgrid(static_cast<unsigned>(d.seq), static_cast<unsigned>(d.kv_heads),
                     static_cast<unsigned>(d.batch));
    const std::size_t ksmem = static_cast<std::size_t>(2 * d.head_dim + 2 * kChunk) * sizeof(float);
    dkdv_simple_kernel<T><<<kgrid, kThreads, ksmem, stream_of(ctx)>>>(
        static_cast<const T*>(dout), static_cast<const T*>(q), static_cast<const T*>(k),
        static_cast<const T*>(v), lse, drow, static_cast<T*>(dk), static_cast<T*>(dv), s);
    return launch_check();
  });
}

}  // namespace strata::kernels
