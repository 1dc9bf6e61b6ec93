// Embedding lookup (a row gather) and its backward (a deterministic scatter-add: sort by id,
// then a segmented sum).
#include <cub/device/device_radix_sort.cuh>

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
    const std::int32_t id = ids[r];  // < 0: a row another tensor-parallel rank holds
    out[idx] = id < 0 ? U{} : table[static_cast<std::int64_t>(id) * row_units + c];
  }
}

// The backward is a stable sort of (id, row) pairs by id, then a segmented sum over the sorted
// positions. Each block owns the runs (maximal spans of equal ids) that start among its
// kSegThreads positions, whole, however far the last one extends, so every table row has exactly
// one writer per column chunk and no atomics are needed. Per column, a run's sum starts from the
// table's value and adds the run's gradient rows in ascending row order in fp32 (for f32 the CPU
// backend's exact additions), then rounds once.
constexpr int kSegThreads = 128;  // positions per block, and columns per block (one per thread)
constexpr int kSegWarps = kSegThreads / 32;
constexpr int kSegUnroll = 16;  // gradient loads in flight per thread

__global__ void iota_kernel(std::int32_t* __restrict__ out, std::int64_t n) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    out[i] = static_cast<std::int32_t>(i);
  }
}

// keys: the ids sorted; src_rows: the row of each sorted position (ascending within a run);
// dout: [rows, dim]; dtable: [vocab, dim]. blockIdx.x: positions, blockIdx.y: columns.
template <typename T>
__global__ void __launch_bounds__(kSegThreads)
    embedding_segment_sum_kernel(const std::int32_t* __restrict__ keys,
                                 const std::int32_t* __restrict__ src_rows, std::int64_t rows,
                                 const T* __restrict__ dout, std::int64_t dim,
                                 T* __restrict__ dtable) {
  __shared__ unsigned start_masks[kSegWarps];
  __shared__ std::int32_t s_row[kSegThreads], s_key[kSegThreads];
  __shared__ std::uint8_t s_first[kSegThreads], s_last[kSegThreads];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const std::int64_t p0 = static_cast<std::int64_t>(blockIdx.x) * kSegThreads;
  const std::int64_t p1 = p0 + kSegThreads < rows ? p0 + kSegThreads : rows;

  // q0: the first run start in [p0, p1); none means every position continues an earlier run.
  const std::int64_t p = p0 + tid;
  const bool starts = p < rows && (p == 0 || keys[p] != keys[p - 1]);
  const unsigned m = __ballot_sync(0xffffffffu, starts);
  if (lane == 0) start_masks[warp] = m;
  __syncthreads();
  int first = -1;
  for (int w = 0; w < kSegWarps && first < 0; ++w) {
    if (start_masks[w] != 0) first = w * 32 + __ffs(static_cast<int>(start_masks[w])) - 1;
  }
  if (first < 0) return;  // uniform: every thread read the same masks
  const std::int64_t q0 = p0 + first;
  // q1: the end of the run holding p1 - 1. Sorted keys make the positions equal to its id a
  // prefix of any later span, so counting the equal ones in each chunk finds the end.
  std::int64_t q1 = p1;
  if (p1 < rows) {
    const std::int32_t last_id = keys[p1 - 1];
    for (;;) {
      const std::int64_t j = q1 + tid;
      const int equal = __syncthreads_count(j < rows && keys[j] == last_id);
      q1 += equal;
      if (equal < kSegThreads) break;
    }
  }

  const std::int64_t c = static_cast<std::int64_t>(blockIdx.y) * kSegThreads + tid;
  float acc = 0.0f;
  for (std::int64_t base = q0; base < q1; base += kSegThreads) {
    const int count = q1 - base < kSegThreads ? static_cast<int>(q1 - base) : kSegThreads;
    __syncthreads();  // the previous chunk's staging has been read by every thread
    if (tid < count) {
      const std::int64_t q = base + tid;
      const std::int32_t key = keys[q];
      s_key[tid] = key;
      s_row[tid] = src_rows[q];
      s_first[tid] = q == 0 || keys[q - 1] != key;
      s_last[tid] = q + 1 == rows || keys[q + 1] != key;
    }
    __syncthreads();
    if (c >= dim) continue;
    for (int i0 = 0; i0 < count; i0 += kSegUnroll) {
      float g[kSegUnroll], t[kSegUnroll];
#pragma unroll
      for (int u = 0; u < kSegUnroll; ++u) {
        const int i = i0 + u;
        g[u] = 0.0f;
        t[u] = 0.0f;
        if (i < count && s_key[i] >= 0) {  // ids < 0 (rows other ranks hold) sort first
          g[u] = to_float(dout[static_cast<std::int64_t>(s_row[i]) * dim + c]);
          if (s_first[i]) t[u] = to_float(dtable[static_cast<std::int64_t>(s_key[i]) * dim + c]);
        }
      }
#pragma unroll
      for (int u = 0; u < kSegUnroll; ++u) {
        const int i = i0 + u;
        if (i < count && s_key[i] >= 0) {
          if (s_first[i]) acc = t[u];
          acc += g[u];
          if (s_last[i]) dtable[static_cast<std::int64_t>(s_key[i]) * dim + c] = from_float<T>(acc);
        }
      }
    }
  }
}

// Scratch: the row indices (sort input), the sorted ids and rows, then CUB's temporary storage.
struct BackwardScratch {
  std::int32_t* rows_in = nullptr;
  std::int32_t* keys = nullptr;
  std::int32_t* src_rows = nullptr;
  void* sort_temp = nullptr;
  std::size_t sort_temp_bytes = 0;
  std::size_t total_bytes = 0;
};

constexpr std::size_t kScratchAlign = 256;

std::size_t align_scratch(std::size_t n) {
  return (n + kScratchAlign - 1) / kScratchAlign * kScratchAlign;
}

// Lays the scratch out at `base` (null: sizes only). Asks CUB for its temporary storage size,
// which depends on rows and the current device.
cudaError_t backward_scratch(std::int64_t rows, void* base, BackwardScratch* s) {
  const int n = static_cast<int>(rows);
  cudaError_t e = cub::DeviceRadixSort::SortPairs<std::int32_t, std::int32_t>(
      nullptr, s->sort_temp_bytes, nullptr, nullptr, nullptr, nullptr, n);
  if (e != cudaSuccess) return e;
  const std::size_t array_bytes =
      align_scratch(static_cast<std::size_t>(rows) * sizeof(std::int32_t));
  auto* b = static_cast<unsigned char*>(base);
  if (b != nullptr) {
    s->rows_in = reinterpret_cast<std::int32_t*>(b);
    s->keys = reinterpret_cast<std::int32_t*>(b + array_bytes);
    s->src_rows = reinterpret_cast<std::int32_t*>(b + 2 * array_bytes);
    s->sort_temp = b + 3 * array_bytes;
  }
  s->total_bytes = 3 * array_bytes + align_scratch(s->sort_temp_bytes);
  return cudaSuccess;
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

std::size_t embedding_backward_scratch_bytes(std::int64_t rows) {
  if (rows <= 0 || rows > 0x7fffffff) return 0;
  BackwardScratch s;
  // A failed query is reported again, as the launch's error, by embedding_backward.
  return backward_scratch(rows, nullptr, &s) == cudaSuccess ? s.total_bytes : 0;
}

int embedding_backward(const LaunchContext& ctx, const std::int32_t* ids, std::int64_t rows,
                       const void* dout, std::int64_t dim, void* dtable, Elem dtype,
                       void* scratch) {
  if (rows <= 0 || dim <= 0) return 0;
  const std::int64_t col_blocks = (dim + kSegThreads - 1) / kSegThreads;
  if (rows > 0x7fffffff || col_blocks > 65535) return static_cast<int>(cudaErrorInvalidValue);
  BackwardScratch s;
  if (const cudaError_t e = backward_scratch(rows, scratch, &s); e != cudaSuccess) {
    return static_cast<int>(e);
  }
  cudaStream_t stream = stream_of(ctx);
  constexpr int kIotaThreads = 256;
  iota_kernel<<<grid_for(rows, kIotaThreads), kIotaThreads, 0, stream>>>(s.rows_in, rows);
  if (const int e = launch_check(); e != 0) return e;
  // Stable: equal ids keep their ascending row order.
  if (const cudaError_t e =
          cub::DeviceRadixSort::SortPairs(s.sort_temp, s.sort_temp_bytes, ids, s.keys, s.rows_in,
                                          s.src_rows, static_cast<int>(rows), 0, 32, stream);
      e != cudaSuccess) {
    return static_cast<int>(e);
  }
  const dim3 grid(static_cast<unsigned>((rows + kSegThreads - 1) / kSegThreads),
                  static_cast<unsigned>(col_blocks));
  return dispatch_float(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    embedding_segment_sum_kernel<T><<<grid, kSegThreads, 0, stream>>>(
        s.keys, s.src_rows, rows, static_cast<const T*>(dout), dim, static_cast<T*>(dtable));
    return launch_check();
  });
}

}  // namespace strata::kernels
