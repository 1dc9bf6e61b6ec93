// The op table every backend implements: the LLaMA training step's math.
//
// Conventions: row-major; activations have shape [rows, dim] with rows = batch * seq tokens;
// attention tensors are [batch, seq, heads, head_dim]. Float tensors of one call share `dtype`
// (f32 or bf16); statistics kept for backward (rstd, lse) and losses are always f32; token ids
// are int32. "accumulate" outputs are added to (+=), others are overwritten. Pointers are device
// pointers of the backend that owns the table.
#pragma once

#include <cstdint>

#include "strata/core/dtype.h"
#include "strata/core/exact_sum.h"
#include "strata/core/rng.h"
#include "strata/device/adamw_constants.h"
#include "strata/device/rope.h"

namespace strata::device {

struct GemmArgs {
  // C[m, n] = alpha * op(A)[m, k] * op(B)[k, n] + beta * C, all of `dtype`, fp32 accumulation.
  bool trans_a = false;
  bool trans_b = false;
  std::int64_t m = 0, n = 0, k = 0;
  float alpha = 1.0f;
  const void* a = nullptr;
  std::int64_t lda = 0;
  const void* b = nullptr;
  std::int64_t ldb = 0;
  float beta = 0.0f;
  void* c = nullptr;
  std::int64_t ldc = 0;
  DType dtype = DType::kF32;
};

struct AttentionShape {
  std::int64_t batch = 0, seq = 0, heads = 0, kv_heads = 0, head_dim = 0;
  // Sliding window: query i attends to keys j with 0 <= i - j < window; 0 = full causal.
  std::int64_t window = 0;
};

// Attention of `queries` new tokens of one sequence against a cache of every key and value so
// far: query i sits at position past + i and attends keys j with j <= past + i (and
// past + i - j < window when window > 0). q/out: [queries, heads, head_dim];
// k_cache/v_cache: [past + queries, kv_heads, head_dim] (the new tokens' keys already in).
struct DecodeAttentionShape {
  std::int64_t queries = 0, past = 0, heads = 0, kv_heads = 0, head_dim = 0;
  std::int64_t window = 0;
};

// How bf16 master weights are kept accurate (optimizer.master_rounding).
enum class MasterRounding : std::uint8_t {
  // Each stored weight rounded stochastically: element i's random bits
  // splitmix64_at(rounding_seed, element_offset + i), so the expected weight is the exact one.
  kStochastic,
  // Kahan-style compensation: a second bf16 array holds what rounding the weight dropped; the
  // weight the step starts from is param + param_comp (summed in f32), the new weight w is
  // stored as param = w rounded to nearest and param_comp = w - param rounded toward zero (so
  // param + param_comp rounds back to param, and a checkpoint's f32 sum splits back into the
  // same pair).
  kKahan,
};

struct AdamWArgs {
  // One AdamW step over n elements, torch.optim.AdamW semantics; param is f32, the moments m/v
  // of state_dtype: f32, bf16 (read widened to f32, the step computed in f32 and the new moments
  // rounded to nearest even when stored: the parameter's update uses them unrounded), or
  // kAdam8StateDType (block-wise 8-bit, device/adam8bit.h: bytes of code in exp_avg and
  // exp_avg_sq, each block's f32 scale in exp_avg_scale and exp_avg_sq_scale, the blocks counted
  // from the span's first element; also used unrounded by the update).
  // grad is of grad_dtype and multiplied by grad_scale first. If param_out is set, the updated
  // parameter is also written there as out_dtype (f32/bf16/f16).
  void* param = nullptr;  // of master_dtype
  const void* grad = nullptr;
  DType grad_dtype = DType::kF32;
  void* exp_avg = nullptr;
  void* exp_avg_sq = nullptr;
  DType state_dtype = DType::kF32;
  float* exp_avg_scale = nullptr;  // 8-bit moments only
  float* exp_avg_sq_scale = nullptr;
  // The master weights' storage: f32, or bf16 (optimizer.master_dtype), widened for the step and
  // stored as master_rounding says (element_offset: the span's first element's place in its
  // group, so a shard rounds as the whole would); param_out then converts the value stored (with
  // Kahan, param + param_comp). The host and the GPU alike.
  DType master_dtype = DType::kF32;
  MasterRounding master_rounding = MasterRounding::kStochastic;
  void* param_comp = nullptr;  // kKahan: bf16, n elements
  std::uint64_t rounding_seed = 0;
  std::uint64_t element_offset = 0;
  std::int64_t n = 0;
  // Hyperparameters in double, as torch holds them (Python floats): 1 - beta, lr / bias
  // correction and 1 - lr * weight_decay are formed in double and rounded to f32 once.
  double lr = 0, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0;
  float grad_scale = 1.0f;
  std::int64_t step = 1;   // 1-based, after increment
  bool adamw_mode = true;  // false: Adam with L2 added to the gradient
  void* param_out = nullptr;
  DType out_dtype = DType::kBF16;
  // Out of place (the shadow optimizer state): when set, the step reads the parameters and
  // moments from these (and the compensation and scales from the *_in beside them, where the
  // storage has them) and writes its results to param, exp_avg and exp_avg_sq, leaving the state
  // before the step intact. All three or none. Host steps only (optim::CpuAdam,
  // adamw_reference and the CPU backend's op); the CUDA backend's op refuses them.
  const void* param_in = nullptr;
  const void* exp_avg_in = nullptr;
  const void* exp_avg_sq_in = nullptr;
  const void* param_comp_in = nullptr;
  const float* exp_avg_scale_in = nullptr;
  const float* exp_avg_sq_scale_in = nullptr;
};

// The elements a dropout covers: `rows` rows of `cols`, columns [col_begin, col_begin + cols) of
// a [rows, full_cols] matrix whose mask they take (a row-parallel layer's slice of its input:
// every rank draws the whole matrix's mask at its own columns). flat(n): n elements, the whole.
struct DropoutBlock {
  std::int64_t rows = 0, cols = 0, full_cols = 0, col_begin = 0;
  static DropoutBlock flat(std::int64_t n) { return {1, n, n, 0}; }
  // Inside its matrix, sizes not negative.
  bool valid() const {
    return rows >= 0 && cols >= 0 && col_begin >= 0 && col_begin + cols <= full_cols;
  }
  std::int64_t size() const { return rows * cols; }
  // Element i's place in the whole matrix: the mask's counter.
  std::uint64_t index(std::int64_t i) const {
    return static_cast<std::uint64_t>((i / cols) * full_cols + col_begin + i % cols);
  }
};

class Ops {
 public:
  virtual ~Ops() = default;

  virtual void gemm(const GemmArgs& args) const = 0;

  // out[i, :] = table[ids[i], :], or zeros where ids[i] < 0 (a token whose row another
  // tensor-parallel rank holds). ids are validated by the caller.
  virtual void embedding_forward(const std::int32_t* ids, std::int64_t rows, const void* table,
                                 std::int64_t dim, void* out, DType dtype) const = 0;
  // dtable[ids[i], :] += dout[i, :] (accumulate), nothing where ids[i] < 0.
  virtual void embedding_backward(const std::int32_t* ids, std::int64_t rows, const void* dout,
                                  std::int64_t dim, void* dtable, DType dtype) const = 0;

  // out = x / sqrt(mean(x^2) + eps) * w; rstd[rows] saved.
  virtual void rmsnorm_forward(const void* x, const void* w, void* out, float* rstd,
                               std::int64_t rows, std::int64_t dim, float eps,
                               DType dtype) const = 0;
  // dx overwritten, dw accumulated; dw null (a frozen weight): no weight gradient.
  virtual void rmsnorm_backward(const void* dout, const void* x, const void* w, const float* rstd,
                                void* dx, void* dw, std::int64_t rows, std::int64_t dim,
                                DType dtype) const = 0;

  // In-place rotary embedding (Hugging Face rotate_half convention) on x[batch, seq, heads, hd],
  // position = rope.position_offset + sequence index, frequencies rope.inv_freq (angles in
  // double). inverse = true applies the transpose (used by backward).
  virtual void rope(void* x, std::int64_t batch, std::int64_t seq, std::int64_t heads,
                    std::int64_t head_dim, const RopeParams& rope, bool inverse,
                    DType dtype) const = 0;

  // Causal grouped-query attention, softmax scale 1/sqrt(head_dim). q/out: [b, s, heads, hd];
  // k/v: [b, s, kv_heads, hd]; lse: [b, heads, s] (log-sum-exp of scaled scores, f32).
  virtual void attention_forward(const void* q, const void* k, const void* v, void* out, float* lse,
                                 const AttentionShape& shape, DType dtype) const = 0;
  // dq, dk, dv overwritten.
  virtual void attention_backward(const void* dout, const void* q, const void* k, const void* v,
                                  const void* out, const float* lse, void* dq, void* dk, void* dv,
                                  const AttentionShape& shape, DType dtype) const = 0;

  // Decoding with a KV cache (no backward); softmax scale 1/sqrt(head_dim), f32 sums.
  virtual void attention_decode(const void* q, const void* k_cache, const void* v_cache, void* out,
                                const DecodeAttentionShape& shape, DType dtype) const = 0;

  // out = silu(gate) * up, elementwise over n.
  virtual void swiglu_forward(const void* gate, const void* up, void* out, std::int64_t n,
                              DType dtype) const = 0;
  // dgate = dout * up * silu'(gate), dup = dout * silu(gate); dgate may be gate and dup up
  // (each element's inputs are read before its outputs are written).
  virtual void swiglu_backward(const void* dout, const void* gate, const void* up, void* dgate,
                               void* dup, std::int64_t n, DType dtype) const = 0;

  // out = a + b (out may alias a or b).
  virtual void add(const void* a, const void* b, void* out, std::int64_t n, DType dtype) const = 0;
  // out[i] = the sum over b of in[b * n + i] (`blocks` blocks of n elements, in_dtype; out in
  // out_dtype, not overlapping in), in f32 in the canonical tree over the blocks
  // (core/summation_tree.h: pairs, then pairs of pairs), each leaf from +0, rounded once: the
  // ranks' gathered gradients summed as one rank sums its micro-batches'.
  virtual void sum_blocks(const void* in, std::int64_t blocks, std::int64_t n, DType in_dtype,
                          void* out, DType out_dtype) const = 0;

  // x[r, :] += bias for every row of x[rows, cols] (a linear layer's bias).
  virtual void add_bias(void* x, const void* bias, std::int64_t rows, std::int64_t cols,
                        DType dtype) const = 0;
  // dbias += sum over rows of dy[rows, cols] (accumulate; sums in f32).
  virtual void bias_grad(const void* dy, void* dbias, std::int64_t rows, std::int64_t cols,
                         DType dtype) const = 0;

  // Fused softmax cross-entropy over logits[rows, vocab]. losses[i] = -log softmax(logits_i)[t_i]
  // (0 where targets[i] < 0, which is ignored). If dlogits is non-null it receives
  // (softmax - onehot) * dloss_scale per valid row (zero rows for ignored ones); dlogits may
  // alias logits.
  virtual void cross_entropy(const void* logits, const std::int32_t* targets, float* losses,
                             void* dlogits, std::int64_t rows, std::int64_t vocab,
                             float dloss_scale, DType dtype) const = 0;

  // Vocabulary-parallel cross-entropy (Megatron's), in two passes around the tensor-parallel
  // group's exchange of per-row statistics; logits[rows, vocab] are the vocabulary's slice
  // [vocab_begin, vocab_begin + vocab) and targets index the whole vocabulary.
  // stats[3 i ..] = {max_j z_ij, sum_j exp(z_ij - that max), z_i,t - vocab_begin if the target is
  // in the slice else 0}; {-inf, 0, 0} for an ignored row (targets[i] < 0).
  virtual void cross_entropy_stats(const void* logits, const std::int32_t* targets,
                                   std::int64_t rows, std::int64_t vocab, std::int64_t vocab_begin,
                                   float* stats, DType dtype) const = 0;
  // dlogits = (exp(z - row_max) / row_sum - [j + vocab_begin == t]) * dloss_scale per valid row,
  // with the whole vocabulary's row_max[rows] and row_sum[rows]; zero rows for ignored ones.
  // dlogits may alias logits.
  virtual void cross_entropy_grad(const void* logits, const std::int32_t* targets,
                                  std::int64_t rows, std::int64_t vocab, std::int64_t vocab_begin,
                                  const float* row_max, const float* row_sum, void* dlogits,
                                  float dloss_scale, DType dtype) const = 0;

  virtual void cast(const void* src, DType src_dtype, void* dst, DType dst_dtype,
                    std::int64_t n) const = 0;

  // Inverted dropout over block.size() elements: out[i] = x[i] * (1 / (1 - p)) where
  // dropout_keeps(key, block.index(i), dropout_threshold(p)), else 0 (out may alias x). Applied to
  // a gradient with the same key, it is the backward of the same mask.
  virtual void dropout(const void* x, void* out, const DropoutBlock& block, float p,
                       std::uint64_t key, DType dtype) const = 0;

  // A weight of n elements packed as NF4 (strata/device/nf4.h: nf4_bytes(n) bytes at `packed`),
  // decoded into out [n] of `dtype`: each element its level times its block's maximum (one f32
  // product), rounded once to `dtype`; the same bits as nf4_dequantize_reference on every backend.
  virtual void dequantize_nf4(const void* packed, std::int64_t n, void* out, DType dtype) const = 0;

  // Mixture-of-experts routing (transformers' Qwen3MoeSparseMoeBlock and MixtralSparseMoeBlock)
  // of `tokens` rows of router logits [tokens, experts] (f32): probs = softmax(logits) [tokens,
  // experts]; chosen [tokens, k] its k largest probabilities' experts, largest first (the lower
  // expert first among equals); weights [tokens, k] their probabilities, divided by their sum
  // with `normalize`. All f32 (chosen int32).
  virtual void moe_route(const float* logits, std::int64_t tokens, std::int64_t experts,
                         std::int64_t k, bool normalize, float* probs, std::int32_t* chosen,
                         float* weights) const = 0;
  // Its backward: dlogits [tokens, experts] (overwritten) from dweights [tokens, k], the gradient
  // of moe_route's weights, and where aux_grad is not null, aux_grad [experts] added to every
  // token's gradient of its probabilities (the load-balancing loss's, which reads every
  // probability). All f32.
  virtual void moe_route_backward(const float* probs, const std::int32_t* chosen,
                                  const float* dweights, const float* aux_grad, std::int64_t tokens,
                                  std::int64_t experts, std::int64_t k, bool normalize,
                                  float* dlogits) const = 0;
  // x [rows, cols]: each row times its scale[i] (f32, rounded to dtype first; each product
  // rounded to dtype): an expert's outputs weighted by its tokens' routing weights.
  virtual void scale_rows(void* x, const float* scale, std::int64_t rows, std::int64_t cols,
                          DType dtype) const = 0;
  // out[index[i]] = the dot product of rows i of a and b [rows, cols], summed in f32: the
  // gradient of each routing weight, written at its token's slot.
  virtual void row_dots(const void* a, const void* b, std::int64_t rows, std::int64_t cols,
                        const std::int32_t* index, float* out, DType dtype) const = 0;

  // sum(x^2) over n elements (for gradient norms of device-resident gradients): the chunks of
  // kSumSquaresChunkElems from x's start each summed in float64 in a fixed order, the chunks'
  // sums added exactly, written to *result (device memory) in compute-stream order: many sums
  // are read back to the host with one copy and one synchronization. An array cut at chunk
  // boundaries gives the same ExactSum in pieces as whole.
  virtual void sum_squares(const void* x, std::int64_t n, DType dtype, ExactSum* result) const = 0;

  // Optimizer step for state that stays on the device (offload_optimizer: none).
  virtual void adamw(const AdamWArgs& args) const = 0;
};

}  // namespace strata::device

namespace strata::device {
// Dropout masks: element i is kept when the top 24 bits of splitmix64_at(key, i) are at least
// round(p * 2^24). Integer arithmetic only, so every backend (and tools/golden/lora_golden.py)
// draws the same mask.
inline std::uint32_t dropout_threshold(float p) {
  return static_cast<std::uint32_t>(static_cast<double>(p) * 16777216.0 + 0.5);
}
inline constexpr bool dropout_keeps(std::uint64_t key, std::uint64_t i, std::uint32_t threshold) {
  return static_cast<std::uint32_t>(splitmix64_at(key, i) >> 40) >= threshold;
}

// The scalar AdamW every backend and the host optimizer are tested against; the CPU backend's
// adamw op runs exactly this, so optimizer placement never changes results.
void adamw_reference(const AdamWArgs& args);

// The arguments every AdamW implementation needs, checked alike (a failed check aborts, naming
// `who` and what is missing): a non-negative count; with elements, the parameter, gradient and
// moment pointers, and out of place all three inputs; f32, bf16 or 8-bit moments, with 8-bit ones
// their block scales (and the inputs' scales); f32 or bf16 master weights, with Kahan ones their
// compensation (and the input's). The CPU backend's op, CpuAdam and the CUDA op call it.
void check_adamw_args(const AdamWArgs& args, const char* who);

// The arguments every GEMM needs, checked alike (a failed check aborts, naming `who`): sizes not
// negative, and each leading dimension at least its matrix's columns as stored (1 for none). Both
// backends' gemm call it.
void check_gemm_args(const GemmArgs& args, const char* who);

// One step's scalars (adamw_constants.h), formed in double (as torch does on Python floats) and
// rounded to f32 once. Every AdamW implementation takes them from here, so they agree bit for bit.
AdamWConstants adamw_constants(const AdamWArgs& args);
}  // namespace strata::device
