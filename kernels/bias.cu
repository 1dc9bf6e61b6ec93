// A linear layer's bias: add_bias (x[r, :] += bias, elementwise) and bias_grad (dbias += the
// column sums of dy, through per-chunk fp32 partials and an ordered second pass, so it is
// deterministic, like rmsnorm's dw).
#include "column_partials.cuh"
#include "common.cuh"

namespace strata::kernels {
namespace {

// x: [rows, cols]; one thread adds kN consecutive columns of one row (kN > 1: cols % kN == 0
// and both pointers 16-byte aligned, so every group is one 16-byte vector).
template <typename T, int kN>
__global__ void add_bias_kernel(T* __restrict__ x, const T* __restrict__ bias, std::int64_t rows,
                                std::int64_t cols) {
  const std::int64_t groups = cols / kN;
  const std::int64_t total = rows * groups;
  for (std::int64_t idx = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
       idx < total; idx += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t r = idx / groups;
    const std::int64_t c = (idx - r * groups) * kN;
    T* xr = x + r * cols + c;
    if constexpr (kN > 1) {
      const Vec16<T> xv = load16(xr), bv = load16(bias + c);
      Vec16<T> o;
#pragma unroll
      for (int e = 0; e < kN; ++e) o.v[e] = from_float<T>(to_float(xv.v[e]) + to_float(bv.v[e]));
      store16(xr, o);
    } else {
      *xr = from_float<T>(to_float(*xr) + to_float(bias[c]));
    }
  }
}

// grid (column blocks, chunks): thread t of column block bx owns columns (bx * blockDim.x + t)
// * kN .. + kN and sums them over the chunk's rows, in row order, into partials[chunk, :].
template <typename T, int kN>
__global__ void bias_partials_kernel(const T* __restrict__ dy, float* __restrict__ partials,
                                     std::int64_t rows, std::int64_t cols,
                                     std::int64_t rows_per_chunk) {
  const std::int64_t c = (blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x) * kN;
  if (c >= cols) return;
  const std::int64_t chunk = blockIdx.y;
  const std::int64_t r0 = chunk * rows_per_chunk;
  const std::int64_t r1 = r0 + rows_per_chunk < rows ? r0 + rows_per_chunk : rows;
  float s[kN] = {};
  for (std::int64_t r = r0; r < r1; ++r) {
    const T* p = dy + r * cols + c;
    if constexpr (kN > 1) {
      const Vec16<T> v = load16(p);
#pragma unroll
      for (int e = 0; e < kN; ++e) s[e] += to_float(v.v[e]);
    } else {
      s[0] += to_float(*p);
    }
  }
  float* out = partials + chunk * cols + c;
#pragma unroll
  for (int e = 0; e < kN; ++e) out[e] = s[e];
}

// Threads per block for `work` column groups: whole warps, at most 256.
int threads_for(std::int64_t work) {
  const std::int64_t t = (work + 31) / 32 * 32;
  return static_cast<int>(t < 32 ? 32 : (t > 256 ? 256 : t));
}

}  // namespace

int add_bias(const LaunchContext& ctx, void* x, const void* bias, std::int64_t rows,
             std::int64_t cols, Elem dtype) {
  if (rows <= 0 || cols <= 0) return 0;
  constexpr int kThreads = 256;
  return dispatch_float(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int kVec = Vec16<T>::kN;
    T* xs = static_cast<T*>(x);
    const T* bs = static_cast<const T*>(bias);
    if (cols % kVec == 0 && aligned16(x) && aligned16(bias)) {
      add_bias_kernel<T, kVec>
          <<<grid_for(rows * (cols / kVec), kThreads), kThreads, 0, stream_of(ctx)>>>(xs, bs, rows,
                                                                                      cols);
    } else {
      add_bias_kernel<T, 1>
          <<<grid_for(rows * cols, kThreads), kThreads, 0, stream_of(ctx)>>>(xs, bs, rows, cols);
    }
    return launch_check();
  });
}

std::size_t bias_grad_scratch_bytes(std::int64_t rows, std::int64_t cols) {
  if (rows <= 0 || cols <= 0) return 0;
  return static_cast<std::size_t>(partial_chunks(rows) * cols) * sizeof(float);
}

int bias_grad(const LaunchContext& ctx, const void* dy, void* dbias, std::int64_t rows,
              std::int64_t cols, Elem dtype, void* scratch) {
  if (rows <= 0 || cols <= 0) return 0;
  const std::int64_t per = partial_rows_per_chunk(rows);
  const std::int64_t chunks = partial_chunks(rows);  // at most 512: fits grid.y
  float* partials = static_cast<float*>(scratch);
  return dispatch_float(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int kVec = Vec16<T>::kN;
    const T* g = static_cast<const T*>(dy);
    // The vector width changes only which thread reads a column, not the order of its sums.
    if (cols % kVec == 0 && aligned16(dy)) {
      const std::int64_t groups = cols / kVec;
      const int threads = threads_for(groups);
      const dim3 grid(static_cast<unsigned>((groups + threads - 1) / threads),
                      static_cast<unsigned>(chunks));
      bias_partials_kernel<T, kVec>
          <<<grid, threads, 0, stream_of(ctx)>>>(g, partials, rows, cols, per);
    } else {
      const int threads = threads_for(cols);
      const dim3 grid(static_cast<unsigned>((cols + threads - 1) / threads),
                      static_cast<unsigned>(chunks));
      bias_partials_kernel<T, 1>
          <<<grid, threads, 0, stream_of(ctx)>>>(g, partials, rows, cols, per);
    }
    if (const int e = launch_check(); e != 0) return e;
    return add_column_partials(ctx, partials, chunks, cols, static_cast<T*>(dbias));
  });
}

}  // namespace strata::kernels
