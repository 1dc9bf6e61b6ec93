// Embedding lookup (a row gather) and its backward (a deterministic, sort-free scatter-add).
#include "common.cuh"

namespace strata::kernels {
namespace {

// out[i, :] = table[ids[i], :], moved in units of U (16, 4 or 2 bytes) per thread.
template <typename U>
__global__ void gather_rows_kernel(const std::int32_t* __restrict__ ids, std::int64_t rows,
                                   const U* __restrict__ table, std::int64_t row_units,
                                   U* __restrict__ out) {
  const std::int64_t total = rows * row_units;
  for (std::int64_t idx = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
       idx < total; idx += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t r = idx / row_units, c = idx - r * row_units;
    out[idx] = table[static_cast<std::int64_t>(ids[r]) * row_units + c];
  }
}

constexpr int kBwdThreads = 256;
constexpr int kBwdColsPerThread = 4;

// One block per row i. Only the block of an id's first row continues: it owns that table row,
// so no two blocks ever write the same row and no atomics are needed. It walks the later rows
// in order (a warp ballot per 32 ids finds the matches), summing their gradients in fp32 on top
// of the table's current value, and stores once.
template <typename T>
__global__ void __launch_bounds__(kBwdThreads)
    embedding_backward_kernel(const std::int32_t* __restrict__ ids, std::int64_t rows,
                              const T* __restrict__ dout, std::int64_t dim,
                              T* __restrict__ dtable) {
  const std::int64_t i = blockIdx.x;
  const std::int32_t id = ids[i];
  for (std::int64_t j0 = 0; j0 < i; j0 += kBwdThreads) {
    const std::int64_t j = j0 + threadIdx.x;
    if (__syncthreads_or(j < i && ids[j] == id)) return;  // an earlier row owns this id
  }
  __shared__ unsigned hit_masks[kBwdThreads / 32];
  T* trow = dtable + static_cast<std::int64_t>(id) * dim;
  for (std::int64_t c0 = 0; c0 < dim; c0 += kBwdThreads * kBwdColsPerThread) {
    float acc[kBwdColsPerThread];
#pragma unroll
    for (int k = 0; k < kBwdColsPerThread; ++k) {
      const std::int64_t c = c0 + k * kBwdThreads + threadIdx.x;
      acc[k] = c < dim ? to_float(trow[c]) : 0.0f;
    }
    for (std::int64_t j0 = i; j0 < rows; j0 += kBwdThreads) {
      const std::int64_t j = j0 + threadIdx.x;
      const unsigned mask = __ballot_sync(0xffffffffu, j < rows && ids[j] == id);
      if ((threadIdx.x & 31) == 0) hit_masks[threadIdx.x >> 5] = mask;
      __syncthreads();
      for (int w = 0; w < kBwdThreads / 32; ++w) {
        for (unsigned bits = hit_masks[w]; bits != 0; bits &= bits - 1) {
          const std::int64_t row = j0 + w * 32 + (__ffs(bits) - 1);
          const T* drow = dout + row * dim;
#pragma unroll
          for (int k = 0; k < kBwdColsPerThread; ++k) {
            const std::int64_t c = c0 + k * kBwdThreads + threadIdx.x;
            if (c < dim) acc[k] += to_float(drow[c]);
          }
        }
      }
      __syncthreads();  // hit_masks is rewritten by the next chunk
    }
#pragma unroll
    for (int k = 0; k < kBwdColsPerThread; ++k) {
      const std::int64_t c = c0 + k * kBwdThreads + threadIdx.x;
      if (c < dim) trow[c] = from_float<T>(acc[k]);
    }
  }
}

template <typename U>
int launch_gather(const LaunchContext& ctx, const std::int32_t* ids, std::int64_t rows,
                  const void* table, std::int64_t row_bytes, void* out) {
  constexpr int kThreads = 256;
  const std::int64_t units = row_bytes / static_cast<std::int64_t>(sizeof(U));
  gather_rows_kernel<U><<<grid_for(rows * units, kThreads), kThreads, 0, stream_of(ctx)>>>(
      ids, rows, static_cast<const U*>(table), units, static_cast<U*>(out));
  return launch_check();
}

}  // namespace

int embedding_forward(const LaunchContext& ctx, const std::int32_t* ids, std::int64_t rows,
                      const void* table, std::int64_t dim, void* out, Elem dtype) {
  if (rows <= 0 || dim <= 0) return 0;
  const std::int64_t row_bytes = dim * static_cast<std::int64_t>(elem_size(dtype));
  if (row_bytes % 16 == 0 && aligned16(table) && aligned16(out)) {
    return launch_gather<uint4>(ctx, ids, rows, table, row_bytes, out);
  }
  if (row_bytes % 4 == 0 && reinterpret_cast<std::uintptr_t>(table) % 4 == 0 &&
      reinterpret_cast<std::uintptr_t>(out) % 4 == 0) {
    return launch_gather<std::uint32_t>(ctx, ids, rows, table, row_bytes, out);
  }
  return launch_gather<std::uint16_t>(ctx, ids, rows, table, row_bytes, out);
}

int embedding_backward(const LaunchContext& ctx, const std::int32_t* ids, std::int64_t rows,
                       const void* dout, std::int64_t dim, void* dtable, Elem dtype) {
  if (rows <= 0 || dim <= 0) return 0;
  if (rows > 0x7fffffff) return static_cast<int>(cudaErrorInvalidValue);
  return dispatch_float(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    embedding_backward_kernel<T><<<static_cast<unsigned>(rows), kBwdThreads, 0, stream_of(ctx)>>>(
        ids, rows, static_cast<const T*>(dout), dim, static_cast<T*>(dtable));
    return launch_check();
  });
}

}  // namespace strata::kernels
