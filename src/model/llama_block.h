// Private to the model: shapes, per-layer tensor views and one decoder block's forward and
// backward through the device op table.
#pragma once

#include <cstddef>
#include <cstdint>

#include "strata/core/dtype.h"
#include "strata/device/ops.h"
#include "strata/model/llama_config.h"

namespace strata::model::detail {

// Sizes of one micro-batch through the model. rows = batch * seq tokens.
struct Dims {
  std::int64_t batch = 0, seq = 0, rows = 0;
  std::int64_t hidden = 0, heads = 0, kv_heads = 0, head_dim = 0, q_dim = 0, kv_dim = 0, ffn = 0,
               vocab = 0;
  float eps = 0;
  device::RopeParams rope;
  std::int64_t window = 0;  // this layer's sliding window (0: none); set per layer
  bool qk_norm = false;
  DType dtype = DType::kF32;
  std::size_t elem_bytes = 4;

  static Dims make(const LlamaConfig& c, DType dtype, std::int64_t batch, std::int64_t seq);
  device::AttentionShape attention() const {
    return {batch, seq, heads, kv_heads, head_dim, window};
  }
};

// Pointer `elems` elements of `elem_bytes` past `base`.
inline void* offset_ptr(const void* base, std::int64_t elems, std::size_t elem_bytes) {
  return const_cast<std::byte*>(static_cast<const std::byte*>(base)) +
         static_cast<std::size_t>(elems) * elem_bytes;
}

// Element offsets of one block's tensors inside its group (same for parameters and gradients);
// -1 for a tensor the family does not have (biases, q/k norms).
struct BlockOffsets {
  std::int64_t ln1, wq, wk, wv, wo, ln2, wg, wu, wd;
  std::int64_t bq = -1, bk = -1, bv = -1, bo = -1, qn = -1, kn = -1, bg = -1, bu = -1, bd = -1;
};

// Views of one block's weights (or of its gradients): HF shapes, [out, in] for projections;
// nullptr where the family has no such tensor.
template <typename Ptr>
struct BlockTensors {
  Ptr ln1;                                                     // [hidden]
  Ptr wq;                                                      // [q_dim, hidden]
  Ptr wk;                                                      // [kv_dim, hidden]
  Ptr wv;                                                      // [kv_dim, hidden]
  Ptr wo;                                                      // [hidden, q_dim]
  Ptr ln2;                                                     // [hidden]
  Ptr wg;                                                      // [ffn, hidden]
  Ptr wu;                                                      // [ffn, hidden]
  Ptr wd;                                                      // [hidden, ffn]
  Ptr bq = nullptr, bk = nullptr, bv = nullptr, bo = nullptr;  // [q_dim], [kv_dim] x2, [hidden]
  Ptr qn = nullptr, kn = nullptr;                              // [head_dim] each (Qwen3)
  Ptr bg = nullptr, bu = nullptr, bd = nullptr;                // [ffn] x2, [hidden]

  static BlockTensors at(Ptr base, const BlockOffsets& o, std::size_t eb) {
    auto view = [&](std::int64_t off) {
      return off < 0 ? static_cast<Ptr>(nullptr) : static_cast<Ptr>(offset_ptr(base, off, eb));
    };
    BlockTensors t{view(o.ln1), view(o.wq), view(o.wk), view(o.wv), view(o.wo),
                   view(o.ln2), view(o.wg), view(o.wu), view(o.wd)};
    t.bq = view(o.bq);
    t.bk = view(o.bk);
    t.bv = view(o.bv);
    t.bo = view(o.bo);
    t.qn = view(o.qn);
    t.kn = view(o.kn);
    t.bg = view(o.bg);
    t.bu = view(o.bu);
    t.bd = view(o.bd);
    return t;
  }
};
using BlockWeights = BlockTensors<const void*>;
using BlockGrads = BlockTensors<void*>;

// What one block's backward needs from its forward (all device pointers, compute dtype unless
// noted). x is the block input, kept by the caller.
struct BlockActs {
  void* x = nullptr;        // [rows, hidden]
  float* rstd1 = nullptr;   // [rows]
  void* a = nullptr;        // [rows, hidden]   input_layernorm(x)
  void* q = nullptr;        // [rows, q_dim]    after (q_norm and) rope
  void* k = nullptr;        // [rows, kv_dim]   after (k_norm and) rope
  void* v = nullptr;        // [rows, kv_dim]
  void* q_pre = nullptr;    // [rows, q_dim]    q_proj output before q_norm (Qwen3 only)
  void* k_pre = nullptr;    // [rows, kv_dim]   k_proj output before k_norm (Qwen3 only)
  float* rstd_q = nullptr;  // [rows * heads]   (Qwen3 only)
  float* rstd_k = nullptr;  // [rows * kv_heads] (Qwen3 only)
  void* att = nullptr;      // [rows, q_dim]    attention output before o_proj
  float* lse = nullptr;     // [batch, heads, seq]
  void* hmid = nullptr;     // [rows, hidden]   x + att Wo^T
  float* rstd2 = nullptr;   // [rows]
  void* b = nullptr;        // [rows, hidden]   post_attention_layernorm(hmid)
  void* gate = nullptr;     // [rows, ffn]
  void* up = nullptr;       // [rows, ffn]
  void* m = nullptr;        // [rows, ffn]      silu(gate) * up
};

// Backward scratch shared by all blocks. The MLP part (dm, dgate, dup) and the attention part
// (datt, dq, dk, dv) are never live together and share memory.
struct BackwardScratch {
  void* dh = nullptr;      // [rows, hidden] gradient of the residual stream, updated in place
  void* dtmp = nullptr;    // [rows, hidden]
  void* dx = nullptr;      // [rows, hidden] gradient of a norm's output
  void* dm = nullptr;      // [rows, ffn]
  void* dgate = nullptr;   // [rows, ffn]
  void* dup = nullptr;     // [rows, ffn]
  void* datt = nullptr;    // [rows, q_dim]
  void* dq = nullptr;      // [rows, q_dim]
  void* dk = nullptr;      // [rows, kv_dim]
  void* dv = nullptr;      // [rows, kv_dim]
  void* dq_pre = nullptr;  // [rows, q_dim]  through q_norm (Qwen3 only)
  void* dk_pre = nullptr;  // [rows, kv_dim] through k_norm (Qwen3 only)
};

// x [rows, hidden] -> out [rows, hidden]; fills acts (acts.x must be x). out == nullptr stops
// after the SwiGLU (recomputation for backward needs no block output).
void block_forward(const device::Ops& ops, const Dims& d, const BlockWeights& w,
                   const BlockActs& acts, void* out);

// s.dh [rows, hidden]: dL/d(block output) on entry, dL/d(block input) on exit. Accumulates
// (+=) into the block's gradients g.
void block_backward(const device::Ops& ops, const Dims& d, const BlockWeights& w,
                    const BlockActs& acts, const BlockGrads& g, const BackwardScratch& s);

// What one block needs to decode `rows` new tokens of one sequence (all device pointers,
// compute dtype unless noted); shared by the layers, which run one after another.
struct DecodeActs {
  void* x = nullptr;      // [rows, hidden] block input
  void* a = nullptr;      // [rows, hidden]
  void* q = nullptr;      // [rows, q_dim]
  void* q_pre = nullptr;  // [rows, q_dim]  (Qwen3)
  void* k_pre = nullptr;  // [rows, kv_dim] (Qwen3)
  float* rstd = nullptr;  // [rows * heads] f32: every norm's statistics (not kept)
  void* att = nullptr;    // [rows, q_dim]
  void* hmid = nullptr;   // [rows, hidden]
  void* b = nullptr;      // [rows, hidden]
  void* gate = nullptr;   // [rows, ffn]
  void* up = nullptr;     // [rows, ffn]
  void* m = nullptr;      // [rows, ffn]
};

// Decodes d.rows new tokens at positions past.. past + rows - 1 (d.batch 1, d.seq = rows):
// their keys and values go into rows [past, past + rows) of the layer's caches ([positions,
// kv_dim] each), and their queries attend every cached position. x -> out [rows, hidden].
void block_decode(const device::Ops& ops, const Dims& d, const BlockWeights& w, const DecodeActs& s,
                  void* k_cache, void* v_cache, std::int64_t past, void* out);

// Thin wrapper over Ops::gemm for row-major operands with tight leading dimensions:
// C[m, n] = op(A) op(B) (+ C if accumulate).
void matmul(const device::Ops& ops, DType dtype, bool trans_a, bool trans_b, std::int64_t m,
            std::int64_t n, std::int64_t k, const void* a, const void* b, void* c, bool accumulate);

}  // namespace strata::model::detail
