// Host launchers of every CUDA kernel, callable from plain C++ (no CUDA types): the CUDA
// backend's op table (src/device/cuda/cuda_ops.cpp) is written against this header only.
//
// Conventions follow strata/device/ops.h (row-major, [batch, seq, heads, head_dim] attention
// tensors, f32 statistics). Every launcher enqueues on ctx.stream, never synchronizes, and
// returns the cudaError_t of its launch check (0 = success) as an int; error_text() names it.
// Scratch is device memory the caller owns, at least *_scratch_bytes() large, used only by
// work on ctx.stream (so one buffer can serve every op in stream order).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "strata/device/adamw_constants.h"
#include "strata/device/rope.h"

namespace strata::kernels {

enum class Elem : std::uint8_t { kF32, kBF16, kF16 };

struct LaunchContext {
  void* stream = nullptr;                // a cudaStream_t
  std::size_t max_smem_optin_bytes = 0;  // cudaDevAttrMaxSharedMemoryPerBlockOptin
  int compute_major = 0;                 // the device's compute capability (major); 0: unknown
};

// "cudaErrorIllegalAddress: an illegal memory access was encountered".
std::string error_text(int code);

// ---- GEMM helper (gemm_scale.cu): C[m, n] (leading dim ldc) = beta * C; beta 0 writes zeros
// without reading C. Used for k == 0, which cuBLASLt does not accept.
int scale_matrix(const LaunchContext& ctx, void* c, std::int64_t m, std::int64_t n,
                 std::int64_t ldc, float beta, Elem dtype);

// ---- embedding.cu
int embedding_forward(const LaunchContext& ctx, const std::int32_t* ids, std::int64_t rows,
                      const void* table, std::int64_t dim, void* out, Elem dtype);
// dtable[ids[i], :] += dout[i, :], deterministic: a stable radix sort of (id, row) pairs, then
// one writer per id that adds the id's rows in ascending row order, in fp32, starting from the
// table's value, and rounds once (for f32 this is exactly the CPU backend's order). ids are not
// range-checked (the caller validates them, as for the forward). rows < 2^31.
std::size_t embedding_backward_scratch_bytes(std::int64_t rows);
int embedding_backward(const LaunchContext& ctx, const std::int32_t* ids, std::int64_t rows,
                       const void* dout, std::int64_t dim, void* dtable, Elem dtype, void* scratch);

// ---- rmsnorm.cu
int rmsnorm_forward(const LaunchContext& ctx, const void* x, const void* w, void* out, float* rstd,
                    std::int64_t rows, std::int64_t dim, float eps, Elem dtype);
std::size_t rmsnorm_backward_scratch_bytes(std::int64_t rows, std::int64_t dim);
// dx overwritten; dw += sum over rows (per-chunk fp32 partials, then one ordered sum), unless
// dw is null (a frozen weight).
int rmsnorm_backward(const LaunchContext& ctx, const void* dout, const void* x, const void* w,
                     const float* rstd, void* dx, void* dw, std::int64_t rows, std::int64_t dim,
                     Elem dtype, void* scratch);

// ---- rope.cu: angles (position_offset + p) * params.inv_freq(j, head_dim), in double.
std::size_t rope_scratch_bytes(std::int64_t seq, std::int64_t head_dim);
int rope(const LaunchContext& ctx, void* x, std::int64_t batch, std::int64_t seq,
         std::int64_t heads, std::int64_t head_dim, const ::strata::device::RopeParams& params,
         bool inverse, Elem dtype, void* scratch);

// ---- attention (attention_simple.cu, attention_flash2_{forward,backward}.cu; dispatch in
// attention.cu)
struct AttentionDims {
  std::int64_t batch = 0, seq = 0, heads = 0, kv_heads = 0, head_dim = 0;
  // Sliding window: query i attends to keys j with 0 <= i - j < window; 0 (or any window not
  // below seq) = full causal.
  std::int64_t window = 0;
  // The window the kernels bound keys by: a window of seq or more is full causal, 0, so that no
  // bound adds a huge window to a position.
  std::int64_t bounded_window() const { return window > 0 && window < seq ? window : 0; }
  std::int64_t group() const { return heads / kv_heads; }  // query heads per kv head
};
enum class AttentionKernel : std::uint8_t {
  // kFlash2 where it applies (bf16, head_dim 64 or 128, aligned, shared memory fits, sm_80+: the
  // context's compute_major), else kSimple.
  kAuto,
  kSimple,  // one block per row, online softmax over key chunks: any shape and dtype
  // bf16, head_dim 64 or 128, sm_80+: mma.sync with register-resident softmax and accumulators,
  // cp.async double buffering (attention_flash2_*.cu); an error where it does not apply.
  kFlash2,
};
// Whether the flash kernels serve this call on a device with the given shared memory (they also
// need compute capability 8.0, checked at launch).
bool flash_attention_applies(const LaunchContext& ctx, const AttentionDims& d, Elem dtype,
                             bool backward);
int attention_forward(const LaunchContext& ctx, const void* q, const void* k, const void* v,
                      void* out, float* lse, const AttentionDims& d, Elem dtype,
                      AttentionKernel kernel);
std::size_t attention_backward_scratch_bytes(const AttentionDims& d);
int attention_backward(const LaunchContext& ctx, const void* dout, const void* q, const void* k,
                       const void* v, const void* out, const float* lse, void* dq, void* dk,
                       void* dv, const AttentionDims& d, Elem dtype, AttentionKernel kernel,
                       void* scratch);
// The variants, for attention_forward/backward's dispatch (and tests).
int attention_forward_simple(const LaunchContext& ctx, const void* q, const void* k, const void* v,
                             void* out, float* lse, const AttentionDims& d, Elem dtype);
int attention_forward_flash2(const LaunchContext& ctx, const void* q, const void* k, const void* v,
                             void* out, float* lse, const AttentionDims& d);
// Decoding with a KV cache (batch 1): `queries` new rows of q attend the cache's past + queries
// rows; per_head gives heads, kv_heads, head_dim and window (batch and seq are ignored).
int attention_decode(const LaunchContext& ctx, const void* q, const void* k_cache,
                     const void* v_cache, void* out, std::int64_t queries, std::int64_t past,
                     const AttentionDims& per_head, Elem dtype);
// drow[b, h, i] = dout_i . out_i in fp32: the softmax backward's row term, shared by both.
int attention_row_dot(const LaunchContext& ctx, const void* dout, const void* out, float* drow,
                      const AttentionDims& d, Elem dtype);
int attention_backward_simple(const LaunchContext& ctx, const void* dout, const void* q,
                              const void* k, const void* v, const float* lse, const float* drow,
                              void* dq, void* dk, void* dv, const AttentionDims& d, Elem dtype);
int attention_backward_flash2(const LaunchContext& ctx, const void* dout, const void* q,
                              const void* k, const void* v, const float* lse, const float* drow,
                              void* dq, void* dk, void* dv, const AttentionDims& d);

// ---- swiglu.cu
int swiglu_forward(const LaunchContext& ctx, const void* gate, const void* up, void* out,
                   std::int64_t n, Elem dtype);
int swiglu_backward(const LaunchContext& ctx, const void* dout, const void* gate, const void* up,
                    void* dgate, void* dup, std::int64_t n, Elem dtype);

// ---- add.cu (out may alias a or b)
// out[i] = sum over b of in[b * n + i] in f32, in strata::canonical_sum's tree, rounded once.
int sum_blocks(const LaunchContext& ctx, const void* in, std::int64_t blocks, std::int64_t n,
               Elem in_dtype, void* out, Elem out_dtype);
int add(const LaunchContext& ctx, const void* a, const void* b, void* out, std::int64_t n,
        Elem dtype);

// ---- bias.cu: a linear layer's bias. add_bias: x[r, :] += bias, in f32, rounded once.
int add_bias(const LaunchContext& ctx, void* x, const void* bias, std::int64_t rows,
             std::int64_t cols, Elem dtype);
// dbias += sum over rows of dy[rows, cols] (per-chunk fp32 partials, then one ordered sum; the
// chunking depends on rows only, so the result is reproducible on any device).
std::size_t bias_grad_scratch_bytes(std::int64_t rows, std::int64_t cols);
int bias_grad(const LaunchContext& ctx, const void* dy, void* dbias, std::int64_t rows,
              std::int64_t cols, Elem dtype, void* scratch);

// ---- cross_entropy.cu (dlogits may be null, or alias logits)
int cross_entropy(const LaunchContext& ctx, const void* logits, const std::int32_t* targets,
                  float* losses, void* dlogits, std::int64_t rows, std::int64_t vocab,
                  float dloss_scale, Elem dtype);
// The vocabulary-parallel passes (Ops::cross_entropy_stats and cross_entropy_grad).
int cross_entropy_stats(const LaunchContext& ctx, const void* logits, const std::int32_t* targets,
                        std::int64_t rows, std::int64_t vocab, std::int64_t vocab_begin,
                        float* stats, Elem dtype);
int cross_entropy_grad(const LaunchContext& ctx, const void* logits, const std::int32_t* targets,
                       std::int64_t rows, std::int64_t vocab, std::int64_t vocab_begin,
                       const float* row_max, const float* row_sum, void* dlogits, float dloss_scale,
                       Elem dtype);

// ---- cast.cu (src_dtype != dst_dtype)
int cast(const LaunchContext& ctx, const void* src, Elem src_dtype, void* dst, Elem dst_dtype,
         std::int64_t n);

// ---- dropout.cu: over rows x cols elements, columns [col_begin, col_begin + cols) of a
// [rows, full_cols] matrix: out[i] = x[i] * scale where the top 24 bits of splitmix64_at(key, j)
// are at least `threshold` (j: the element's place in the whole matrix), else 0
// (device::Ops::dropout; out may alias x).
int dropout(const LaunchContext& ctx, const void* x, void* out, std::int64_t rows,
            std::int64_t cols, std::int64_t full_cols, std::int64_t col_begin,
            std::uint32_t threshold, float scale, std::uint64_t key, Elem dtype);

// ---- nf4.cu: out[n] = the NF4 weight at `packed` decoded (device::Ops::dequantize_nf4).
// Byte offsets of its parts (device::Nf4Layout) and the format's tables (device::Nf4Tables).
struct Nf4Parts {
  std::int64_t elems = 0;
  std::uint64_t codes = 0, absmax = 0, scales = 0, mean = 0;
};
struct Nf4Tables {
  float levels[16];
  float absmax_code[256];
};
int dequantize_nf4(const LaunchContext& ctx, const void* packed, const Nf4Parts& parts,
                   const Nf4Tables& tables, void* out, Elem dtype);

// ---- moe.cu: device::Ops::moe_route, moe_route_backward, scale_rows and row_dots.
int moe_route(const LaunchContext& ctx, const float* logits, std::int64_t tokens,
              std::int64_t experts, std::int64_t k, bool normalize, float* probs,
              std::int32_t* chosen, float* weights);
int moe_route_backward(const LaunchContext& ctx, const float* probs, const std::int32_t* chosen,
                       const float* dweights, const float* aux_grad, std::int64_t tokens,
                       std::int64_t experts, std::int64_t k, bool normalize, float* dlogits);
int scale_rows(const LaunchContext& ctx, void* x, const float* scale, std::int64_t rows,
               std::int64_t cols, Elem dtype);
int row_dots(const LaunchContext& ctx, const void* a, const void* b, std::int64_t rows,
             std::int64_t cols, const std::int32_t* index, float* out, Elem dtype);

// ---- sum_squares.cu: writes sum(x^2) to *result (device memory), a strata::ExactSum's layout:
// chunks of kSumSquaresChunk elements from x's start, each summed in double, added exactly.
inline constexpr std::int64_t kSumSquaresChunk = 256;  // strata::kSumSquaresChunkElems
inline constexpr int kExactSumLimbs = 20;              // strata::ExactSum's
inline constexpr int kExactSumLowBit = -320;
inline constexpr int kExactSumHighBit = kExactSumLowBit + 32 * (kExactSumLimbs - 1);
struct ExactSumLayout {
  unsigned long long limbs[kExactSumLimbs];
  double special;
};
int sum_squares(const LaunchContext& ctx, const void* x, std::int64_t n, Elem dtype,
                ExactSumLayout* result);

// ---- adamw.cu: device::adamw_reference's arithmetic, operation for operation, compiled
// without multiply-add contraction; the scalars are computed on the host exactly as the
// reference computes them.
using AdamWScalars = ::strata::device::AdamWConstants;
// The master weights (optimizer.master_dtype): f32, or bf16 with a bf16 compensation (Kahan) or
// rounded stochastically with the bits of splitmix64_at(seed, first + i) for element i.
enum class MasterForm : std::uint8_t { kF32, kKahan, kStochastic };
struct MasterWeights {
  MasterForm form = MasterForm::kF32;
  void* param = nullptr;          // float, or bf16 bits (std::uint16_t)
  std::uint16_t* comp = nullptr;  // kKahan: what rounding dropped, bf16 bits
  std::uint64_t seed = 0;         // kStochastic
  std::uint64_t first = 0;        // kStochastic: element 0's index in the draw
};
// exp_avg and exp_avg_sq of state_dtype: f32 or bf16 (widened for the step, rounded when stored).
int adamw(const LaunchContext& ctx, const MasterWeights& w, const void* grad, Elem grad_dtype,
          void* exp_avg, void* exp_avg_sq, Elem state_dtype, std::int64_t n, const AdamWScalars& s,
          void* param_out, Elem out_dtype);
// Block-wise 8-bit moments (strata/device/adam8bit.h): a byte each and an f32 scale per block of
// 256 elements (the span starts on a block). The step dequantizes, runs the f32 step above, and
// quantizes as device::adam8_quantize_m / adam8_quantize_v do (the block's largest magnitude, its
// f32 reciprocal, the nearest magnitude by these thresholds, a tie to the smaller). The tables,
// from device::adam8_search and the codes, travel as a kernel argument (3 KiB).
// Elements an 8-bit block holds: device::kAdam8BlockElems (which this C++17 code cannot include;
// cuda_ops.cpp checks the two agree).
inline constexpr int kAdam8BlockElems = 64;
struct Adam8Tables {
  float m_magnitude[128];  // the signed code's magnitudes, by the byte without its sign bit
  float m_threshold[128];  // between them (127), then +infinity
  float v_value[256];      // the unsigned code (the second moment's root)
  float v_threshold[256];  // 255, then +infinity
};
int adamw8(const LaunchContext& ctx, const MasterWeights& w, const void* grad, Elem grad_dtype,
           std::uint8_t* exp_avg, float* exp_avg_scale, std::uint8_t* exp_avg_sq,
           float* exp_avg_sq_scale, std::int64_t n, const AdamWScalars& s, const Adam8Tables& t,
           void* param_out, Elem out_dtype);

}  // namespace strata::kernels
