// RMSNorm forward (one block per row) and backward (dx per row; dw through per-chunk fp32
// partials and an ordered second pass, so it is deterministic).
#include "column_partials.cuh"
#include "common.cuh"

namespace strata::kernels {
namespace {

constexpr int kThreads = 256;

// Visits the row's columns in 16-byte vectors (kVec) or one by one; fn(column, value array,
// count) sees kN consecutive columns at a time. The same thread always gets the same columns.
template <typename T, bool kVec>
struct RowIter {
  static constexpr int kN = kVec ? Vec16<T>::kN : 1;
  static __device__ __forceinline__ std::int64_t first() { return threadIdx.x * kN; }
  static __device__ __forceinline__ std::int64_t step() { return blockDim.x * kN; }
  static __device__ __forceinline__ void load(const T* p, float (&out)[kN]) {
    if constexpr (kVec) {
      const Vec16<T> v = load16(p);
#pragma unroll
      for (int e = 0; e < kN; ++e) out[e] = to_float(v.v[e]);
    } else {
      out[0] = to_float(*p);
    }
  }
  static __device__ __forceinline__ void store(T* p, const float (&in)[kN]) {
    if constexpr (kVec) {
      Vec16<T> v;
#pragma unroll
      for (int e = 0; e < kN; ++e) v.v[e] = from_float<T>(in[e]);
      store16(p, v);
    } else {
      *p = from_float<T>(in[0]);
    }
  }
};

// x, out: [rows, dim]; w: [dim]; rstd: [rows]. Same arithmetic as the CPU op:
// r = 1 / sqrt(sum(x^2) / dim + eps), out = (x * r) * w.
template <typename T, bool kVec>
__global__ void __launch_bounds__(kThreads)
    rmsnorm_forward_kernel(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ out,
                           float* __restrict__ rstd, std::int64_t dim, float eps) {
  using It = RowIter<T, kVec>;
  constexpr int kN = It::kN;
  __shared__ float red[32];
  const std::int64_t row = blockIdx.x;
  const T* xr = x + row * dim;
  T* orow = out + row * dim;
  float ss = 0.0f;
  for (std::int64_t c = It::first(); c < dim; c += It::step()) {
    float xv[kN];
    It::load(xr + c, xv);
#pragma unroll
    for (int e = 0; e < kN; ++e) ss += xv[e] * xv[e];
  }
  ss = block_sum(ss, red);
  const float r = 1.0f / sqrtf(ss / static_cast<float>(dim) + eps);
  if (threadIdx.x == 0) rstd[row] = r;
  for (std::int64_t c = It::first(); c < dim; c += It::step()) {
    float xv[kN], wv[kN], o[kN];
    It::load(xr + c, xv);
    It::load(w + c, wv);
#pragma unroll
    for (int e = 0; e < kN; ++e) o[e] = xv[e] * r * wv[e];
    It::store(orow + c, o);
  }
}

// One block per chunk of rows. For each row: k = sum(dout w x) r^3 / dim, dx = r (dout w) - k x;
// the chunk's dw partial (sum of dout x r over its rows) accumulates in shared memory, each
// thread owning its columns, and is written to partials[chunk, :].
template <typename T, bool kVec>
__global__ void __launch_bounds__(kThreads)
    rmsnorm_backward_kernel(const T* __restrict__ dout, const T* __restrict__ x,
                            const T* __restrict__ w, const float* __restrict__ rstd,
                            T* __restrict__ dx, float* __restrict__ partials, std::int64_t rows,
                            std::int64_t dim, std::int64_t rows_per_chunk) {
  using It = RowIter<T, kVec>;
  constexpr int kN = It::kN;
  extern __shared__ float part[];  // [dim]
  __shared__ float red[32];
  for (std::int64_t c = It::first(); c < dim; c += It::step()) {
#pragma unroll
    for (int e = 0; e < kN; ++e) part[c + e] = 0.0f;
  }
  const std::int64_t r0 = blockIdx.x * rows_per_chunk;
  const std::int64_t r1 = r0 + rows_per_chunk < rows ? r0 + rows_per_chunk : rows;
  for (std::int64_t row = r0; row < r1; ++row) {
    const T* gr = dout + row * dim;
    const T* xr = x + row * dim;
    const float r = rstd[row];
    float dot = 0.0f;
    for (std::int64_t c = It::first(); c < dim; c += It::step()) {
      float gv[kN], wv[kN], xv[kN];
      It::load(gr + c, gv);
      It::load(w + c, wv);
      It::load(xr + c, xv);
#pragma unroll
      for (int e = 0; e < kN; ++e) dot += gv[e] * wv[e] * xv[e];
    }
    dot = block_sum(dot, red);
    const float k = dot * r * r * r / static_cast<float>(dim);
    T* dxr = dx + row * dim;
    for (std::int64_t c = It::first(); c < dim; c += It::step()) {
      float gv[kN], wv[kN], xv[kN], o[kN];
      It::load(gr + c, gv);
      It::load(w + c, wv);
      It::load(xr + c, xv);
#pragma unroll
      for (int e = 0; e < kN; ++e) {
        part[c + e] += gv[e] * xv[e] * r;
        o[e] = r * (gv[e] * wv[e]) - k * xv[e];
      }
      It::store(dxr + c, o);
    }
  }
  float* out = partials + blockIdx.x * dim;
  for (std::int64_t c = It::first(); c < dim; c += It::step()) {
#pragma unroll
    for (int e = 0; e < kN; ++e) out[c + e] = part[c + e];
  }
}

template <typename T>
bool can_vectorize(std::int64_t dim, std::initializer_list<const void*> ptrs) {
  if (dim % Vec16<T>::kN != 0) return false;
  for (const void* p : ptrs) {
    if (!aligned16(p)) return false;
  }
  return true;
}

}  // namespace

int rmsnorm_forward(const LaunchContext& ctx, const void* x, const void* w, void* out, float* rstd,
                    std::int64_t rows, std::int64_t dim, float eps, Elem dtype) {
  if (rows <= 0 || dim <= 0) return 0;
  if (rows > 0x7fffffff) return static_cast<int>(cudaErrorInvalidValue);
  return dispatch_float(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* xs = static_cast<const T*>(x);
    const T* ws = static_cast<const T*>(w);
    T* os = static_cast<T*>(out);
    const auto blocks = static_cast<unsigned>(rows);
    if (can_vectorize<T>(dim, {x, w, out})) {
      rmsnorm_forward_kernel<T, true>
          <<<blocks, kThreads, 0, stream_of(ctx)>>>(xs, ws, os, rstd, dim, eps);
    } else {
      rmsnorm_forward_kernel<T, false>
          <<<blocks, kThreads, 0, stream_of(ctx)>>>(xs, ws, os, rstd, dim, eps);
    }
    return launch_check();
  });
}

std::size_t rmsnorm_backward_scratch_bytes(std::int64_t rows, std::int64_t dim) {
  if (rows <= 0 || dim <= 0) return 0;
  return static_cast<std::size_t>(partial_chunks(rows) * dim) * sizeof(float);
}

int rmsnorm_backward(const LaunchContext& ctx, const void* dout, const void* x, const void* w,
                     const float* rstd, void* dx, void* dw, std::int64_t rows, std::int64_t dim,
                     Elem dtype, void* scratch) {
  if (rows <= 0 || dim <= 0) return 0;
  const std::size_t smem = static_cast<std::size_t>(dim) * sizeof(float);
  if (smem > ctx.max_smem_optin_bytes) return static_cast<int>(cudaErrorInvalidValue);
  const std::int64_t per = partial_rows_per_chunk(rows);
  const std::int64_t chunks = partial_chunks(rows);
  float* partials = static_cast<float*>(scratch);
  return dispatch_float(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* gs = static_cast<const T*>(dout);
    const T* xs = static_cast<const T*>(x);
    const T* ws = static_cast<const T*>(w);
    T* dxs = static_cast<T*>(dx);
    auto launch = [&](auto kernel) {
      const cudaError_t e = cudaFuncSetAttribute(
          kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
      if (e != cudaSuccess) return static_cast<int>(e);
      kernel<<<static_cast<unsigned>(chunks), kThreads, smem, stream_of(ctx)>>>(
          gs, xs, ws, rstd, dxs, partials, rows, dim, per);
      return launch_check();
    };
    const int err = can_vectorize<T>(dim, {dout, x, w, dx})
                        ? launch(rmsnorm_backward_kernel<T, true>)
                        : launch(rmsnorm_backward_kernel<T, false>);
    if (err != 0) return err;
    if (dw == nullptr) return 0;  // a frozen weight: no gradient
    return add_column_partials(ctx, partials, chunks, dim, static_cast<T*>(dw));
  });
}

}  // namespace strata::kernels
