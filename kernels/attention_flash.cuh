// Shared pieces of the flash-attention kernels (bf16, head_dim 64 or 128, tensor cores through
// WMMA 16x16x16 tiles with fp32 accumulation): tile loads and shared-memory layout helpers.
//
// WMMA leaves the accumulator's element-to-thread mapping unspecified, so every elementwise
// step (masking, softmax, rescaling) goes through shared memory: a warp stores its tile, its
// lanes work on rows, and it loads the result back. Each warp owns 16 rows of every per-row
// buffer, so those steps need only __syncwarp; block barriers guard the shared K/V/Q tiles.
#pragma once

#include <mma.h>

#include "common.cuh"

namespace strata::kernels {

// Dynamic shared memory the flash kernels need for this head_dim (0: not supported).
std::size_t flash_forward_smem_bytes(std::int64_t head_dim);
std::size_t flash_backward_smem_bytes(std::int64_t head_dim);  // the larger of its two kernels

}  // namespace strata::kernels

namespace strata::kernels::flash {

namespace wmma = nvcuda::wmma;

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;

using FragA = wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16_t, wmma::row_major>;
using FragBRow = wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16_t, wmma::row_major>;
using FragBCol = wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16_t, wmma::col_major>;
using FragC = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;

// Shapes of one call, as the kernels see them.
struct Dims {
  std::int64_t batch, seq, heads, kv_heads, group;
  std::int64_t window;  // sliding window; 0: full causal (see dims_of)
  float scale;          // 1 / sqrt(head_dim), as the CPU backend computes it
};

// A window of seq or more is full causal attention: stored as 0, so that no bound below adds
// a huge window to a position.
inline Dims dims_of(const AttentionDims& ad) {
  return Dims{ad.batch,
              ad.seq,
              ad.heads,
              ad.kv_heads,
              ad.heads / ad.kv_heads,
              ad.window > 0 && ad.window < ad.seq ? ad.window : 0,
              1.0f / sqrtf(static_cast<float>(ad.head_dim))};
}

// Whether query i attends to key j (both below seq): causal, and within the window.
__device__ __forceinline__ bool attends(const Dims& d, std::int64_t i, std::int64_t j) {
  return j <= i && (d.window == 0 || i - j < d.window);
}
// The first key query i attends to.
__device__ __forceinline__ std::int64_t first_key(const Dims& d, std::int64_t i) {
  return d.window > 0 && i - d.window + 1 > 0 ? i - d.window + 1 : 0;
}
// One past the last query that key j is attended by.
__device__ __forceinline__ std::int64_t query_end(const Dims& d, std::int64_t j) {
  return d.window > 0 && j + d.window < d.seq ? j + d.window : d.seq;
}

// Byte offsets of shared-memory regions, each aligned for WMMA (32 bytes; 128 for good
// measure) so that any 16-row, 16-column sub-tile is a valid fragment address.
constexpr std::size_t align_region(std::size_t bytes) { return (bytes + 127) / 128 * 128; }

// Copies kRows rows starting at row0 of head `head` of a [batch, seq, num_heads, HD] bf16
// tensor into shared memory with leading dimension ld (elements), 16 bytes per thread per step;
// rows at or past seq become zeros so that partial tiles compute on zeros, never on garbage.
template <int kRows, int HD>
__device__ __forceinline__ void load_tile(bf16_t* dst, int ld, const bf16_t* __restrict__ src,
                                          std::int64_t b, std::int64_t row0, std::int64_t seq,
                                          std::int64_t num_heads, std::int64_t head) {
  constexpr int kVecsPerRow = HD / 8;
  for (int idx = threadIdx.x; idx < kRows * kVecsPerRow; idx += blockDim.x) {
    const int r = idx / kVecsPerRow, c = (idx % kVecsPerRow) * 8;
    const std::int64_t s = row0 + r;
    uint4 val = make_uint4(0u, 0u, 0u, 0u);
    if (s < seq) {
      val = *reinterpret_cast<const uint4*>(src + ((b * seq + s) * num_heads + head) * HD + c);
    }
    *reinterpret_cast<uint4*>(dst + r * ld + c) = val;
  }
}

// Writes 16 rows (starting at tile row r0, global row row0 + r0) of an fp32 shared tile with
// leading dimension ld, multiplied by row_scale[r] (or 1), as bf16 rows of head `head`; one
// warp, 16 bytes per lane per step; rows at or past seq are skipped.
template <int HD>
__device__ __forceinline__ void store_rows(const float* tile, int ld, int r0,
                                           const float* row_scale, bf16_t* __restrict__ dst,
                                           std::int64_t b, std::int64_t row0, std::int64_t seq,
                                           std::int64_t num_heads, std::int64_t head) {
  constexpr int kVecsPerRow = HD / 8;
  const int lane = threadIdx.x & 31;
  for (int idx = lane; idx < 16 * kVecsPerRow; idx += 32) {
    const int r = r0 + idx / kVecsPerRow, c = (idx % kVecsPerRow) * 8;
    const std::int64_t s = row0 + r;
    if (s >= seq) continue;
    const float scale = row_scale == nullptr ? 1.0f : row_scale[r];
    Vec16<bf16_t> v;
#pragma unroll
    for (int e = 0; e < 8; ++e) v.v[e] = __float2bfloat16_rn(tile[r * ld + c + e] * scale);
    store16(dst + ((b * seq + s) * num_heads + head) * HD + c, v);
  }
}

}  // namespace strata::kernels::flash
