// Shared pieces of the flash-attention kernels (bf16, head_dim 64 or 128, sm_80+): raw
// mma.sync m16n8k16 tensor-core products whose fragment layout the PTX ISA documents, so scores,
// probabilities and accumulators stay in registers (a thread knows the row and column of every
// element it holds), ldmatrix loads from padded shared tiles, and cp.async double buffering.
//
// Fragment layout of mma.m16n8k16 (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating
// point type"), with grp = lane / 4 and tig = lane % 4:
//   A (16x16 bf16, 4 regs of 2): reg 0 row grp, cols 2 tig + {0,1}; reg 1 row grp + 8, same
//     cols; regs 2, 3 the same rows at cols 8 + 2 tig + {0,1}.
//   B (16x8 bf16, 2 regs of 2): reg 0 rows (k) 2 tig + {0,1}, col (n) grp; reg 1 rows 8 + ...
//   C (16x8 f32, 4 floats): c0, c1 row grp, cols 2 tig + {0,1}; c2, c3 row grp + 8.
// So the C fragments of two adjacent 8-column blocks, rounded to bf16 pairs, are exactly the A
// fragment of the 16-column block they make up (a product's output feeds the next product).
#pragma once

#include "common.cuh"

namespace strata::kernels {

// Dynamic shared memory the flash2 kernels need for this head_dim (0: not supported).
std::size_t flash2_forward_smem_bytes(std::int64_t head_dim);
std::size_t flash2_backward_smem_bytes(std::int64_t head_dim);  // the larger of its two kernels
// cudaSuccess on a device of compute capability 8.0 or later (cp.async, bf16 mma.sync), else
// cudaErrorNotSupported (or the runtime's error).
cudaError_t flash2_device_supported();

}  // namespace strata::kernels

namespace strata::kernels::flash2 {

// Shapes of one call, as the kernels see them.
struct Dims {
  std::int64_t batch, seq, heads, kv_heads, group;
  std::int64_t window;  // sliding window; 0: full causal (see dims_of)
  float scale;          // 1 / sqrt(head_dim), as the CPU backend computes it
};

// The kernels' dims: the window bounded as every attention kernel bounds it (full causal as 0).
inline Dims dims_of(const AttentionDims& ad) {
  return Dims{ad.batch,
              ad.seq,
              ad.heads,
              ad.kv_heads,
              ad.group(),
              ad.bounded_window(),
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

// Byte offsets of shared-memory regions, each aligned to 128 bytes (ldmatrix and cp.async need
// 16; 128 for good measure).
constexpr std::size_t align_region(std::size_t bytes) { return (bytes + 127) / 128 * 128; }

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr float kLog2e = 1.4426950408889634f;

// Every bf16 tile in shared memory is [rows][HD + 8]: a row is 16 bytes longer than the data, so
// the 8 rows one ldmatrix phase reads (16 bytes each) start 4 banks apart and never conflict,
// and neither do the 16-byte cp.async writes of 8 consecutive threads (one row).
template <int HD>
constexpr int kLd = HD + 8;

__device__ __forceinline__ unsigned smem_u32(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared without staging in registers; !valid writes 16 zero bytes (src is
// not read, but must still be a valid address).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src),
               "r"(valid ? 16 : 0)
               : "memory");
#else
  __trap();
#endif
}
// 4 bytes (one float), likewise.
__device__ __forceinline__ void cp_async4(void* dst, const void* src, bool valid) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_u32(dst)), "l"(src),
               "r"(valid ? 4 : 0)
               : "memory");
#else
  __trap();
#endif
}
__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}
// Waits until at most kPending of this thread's committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
#endif
}

// Four 8x8 bf16 matrices; lanes 8m..8m+7 give the row addresses of matrix m, and register m
// receives matrix m in the A/B/C pair layout (row lane / 4, columns 2 (lane % 4) + {0,1}), or,
// with trans, matrix m transposed.
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const bf16_t* p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p))
               : "memory");
#else
  __trap();
#endif
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], const bf16_t* p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p))
               : "memory");
#else
  __trap();
#endif
}

// c += a b for one 16x8x16 block, fp32 accumulation.
__device__ __forceinline__ void mma(float (&c)[4], const unsigned (&a)[4], unsigned b0,
                                    unsigned b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  __trap();
#endif
}

// Two floats rounded to bf16 (to nearest even) in one register, lo in the low half: the element
// with the lower column index, as fragments want it.
__device__ __forceinline__ unsigned pack_bf16(float lo, float hi) {
  return static_cast<unsigned>(__bfloat16_as_ushort(__float2bfloat16_rn(lo))) |
         (static_cast<unsigned>(__bfloat16_as_ushort(__float2bfloat16_rn(hi))) << 16);
}

// The A fragment of 16-column block kk, made of the C fragments of its 8-column halves 2 kk and
// 2 kk + 1 rounded to bf16 (the layout note above): a product's output as the next one's input.
template <int N>
__device__ __forceinline__ void a_from_c(unsigned (&a)[4], const float (&c)[N][4], int kk) {
  a[0] = pack_bf16(c[2 * kk][0], c[2 * kk][1]);
  a[1] = pack_bf16(c[2 * kk][2], c[2 * kk][3]);
  a[2] = pack_bf16(c[2 * kk + 1][0], c[2 * kk + 1][1]);
  a[3] = pack_bf16(c[2 * kk + 1][2], c[2 * kk + 1][3]);
}

// ldmatrix row addresses for a 16x16 block at (row0, col0) of a [rows][ld] tile:
//  - as an A operand (registers: rows 0-7/8-15 x cols 0-7, then x cols 8-15);
__device__ __forceinline__ const bf16_t* a_addr(const bf16_t* t, int ld, int row0, int col0) {
  const int lane = threadIdx.x & 31;
  return t + (row0 + (lane & 15)) * ld + col0 + (lane >> 4) * 8;
}
//  - as the B operand of two 8-column blocks when the tile holds B^T, i.e. rows are B's columns
//    (n) and columns are B's k (registers: n-block 0 k 0-7, k 8-15, n-block 1 k 0-7, k 8-15);
__device__ __forceinline__ const bf16_t* bt_addr(const bf16_t* t, int ld, int n0, int k0) {
  const int lane = threadIdx.x & 31;
  return t + (n0 + (lane & 7) + (lane >> 4) * 8) * ld + k0 + ((lane >> 3) & 1) * 8;
}
//  - with ldmatrix_x4_trans, as the B operand of two 8-column blocks when the tile holds B
//    itself, rows k and columns n (registers as for bt_addr).
__device__ __forceinline__ const bf16_t* b_addr(const bf16_t* t, int ld, int k0, int n0) {
  const int lane = threadIdx.x & 31;
  return t + (k0 + (lane & 7) + ((lane >> 3) & 1) * 8) * ld + n0 + (lane >> 4) * 8;
}

// Starts copying kRows rows from row0 of head `head` of a [batch, seq, num_heads, HD] bf16
// tensor into a [kRows][HD + 8] tile; rows at or past seq become zeros.
template <int kRows, int HD>
__device__ __forceinline__ void load_rows_async(bf16_t* dst, const bf16_t* __restrict__ src,
                                                std::int64_t b, std::int64_t row0, std::int64_t seq,
                                                std::int64_t num_heads, std::int64_t head) {
  constexpr int kVecsPerRow = HD / 8;
  for (int idx = threadIdx.x; idx < kRows * kVecsPerRow; idx += kThreads) {
    const int r = idx / kVecsPerRow, c = (idx % kVecsPerRow) * 8;
    const std::int64_t s = row0 + r;
    const bool in = s < seq;
    cp_async16(dst + r * kLd<HD> + c, in ? src + ((b * seq + s) * num_heads + head) * HD + c : src,
               in);
  }
}

// One warp stores 16 rows of an fp32 fragment accumulator acc[HD / 8][4] (rows grp and grp + 8
// of the warp's block), times row_scale (lo: row grp, hi: row grp + 8), as bf16 rows row0..
// row0 + 15 of head `head`: through the warp's own [16][HD + 8] shared tile `stage`, so the
// global stores are whole 16-byte vectors. Rows at or past seq are skipped.
template <int HD>
__device__ __forceinline__ void store_rows(const float (&acc)[HD / 8][4], float scale_lo,
                                           float scale_hi, bf16_t* stage, bf16_t* __restrict__ dst,
                                           std::int64_t b, std::int64_t row0, std::int64_t seq,
                                           std::int64_t num_heads, std::int64_t head) {
  const int lane = threadIdx.x & 31, grp = lane >> 2, tig = lane & 3;
#pragma unroll
  for (int nb = 0; nb < HD / 8; ++nb) {
    *reinterpret_cast<unsigned*>(stage + grp * kLd<HD> + nb * 8 + tig * 2) =
        pack_bf16(acc[nb][0] * scale_lo, acc[nb][1] * scale_lo);
    *reinterpret_cast<unsigned*>(stage + (grp + 8) * kLd<HD> + nb * 8 + tig * 2) =
        pack_bf16(acc[nb][2] * scale_hi, acc[nb][3] * scale_hi);
  }
  __syncwarp();
  constexpr int kVecsPerRow = HD / 8;
  for (int idx = lane; idx < 16 * kVecsPerRow; idx += 32) {
    const int r = idx / kVecsPerRow, c = (idx % kVecsPerRow) * 8;
    const std::int64_t s = row0 + r;
    if (s < seq) {
      *reinterpret_cast<uint4*>(dst + ((b * seq + s) * num_heads + head) * HD + c) =
          *reinterpret_cast<const uint4*>(stage + r * kLd<HD> + c);
    }
  }
}

}  // namespace strata::kernels::flash2
