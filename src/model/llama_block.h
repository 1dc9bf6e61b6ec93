// Private to the model: shapes, per-layer tensor views and one decoder block's forward and
// backward through the device op table.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>

#include "src/model/dense_mlp.h"
#include "src/model/moe_mlp.h"
#include "src/model/parallel_layers.h"
#include "strata/core/dtype.h"
#include "strata/device/ops.h"
#include "strata/model/llama_config.h"
#include "strata/model/lora.h"
#include "strata/model/model_options.h"

namespace strata::model::detail {

// Sizes of one micro-batch through the model, as this rank computes it: rows = batch * seq
// tokens; under tensor parallelism heads, kv_heads, q_dim, kv_dim, ffn and vocab are this
// rank's share (ModelOptions::tensor_parallel).
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
  // Rows the LM head and the loss run at once (ModelOptions::lm_head_chunk_tokens).
  std::int64_t head_rows = 0;
  // Mixture of experts (0 experts: none): each MoE layer's experts, the ones a token picks, and
  // an expert's intermediate size.
  std::int64_t experts = 0, experts_per_token = 0, expert_ffn = 0;
  // Expert parallelism: the ranks sharing the experts (1: none). This rank's experts then run
  // over the rows every rank of the group sends them: at most expert_ranks x rows x k.
  std::int64_t expert_ranks = 1;

  // The widest input of any projection: an adapter's dropout scratch holds rows of it.
  std::int64_t max_in() const { return std::max({hidden, q_dim, ffn}); }
  // The largest projection weight, in elements.
  std::int64_t max_weight() const { return std::max({q_dim, ffn, expert_ffn}) * hidden; }
  // The token rows this rank's experts run over at most: each token's k picks, times the ranks
  // that may send theirs here.
  std::int64_t expert_rows() const { return expert_ranks * rows * experts_per_token; }
  // Elements of a layer's MLP activations (gate, up, m) and their gradient: a dense MLP's rows
  // of ffn, or an MoE layer's expert rows of expert_ffn.
  std::int64_t mlp_elems() const { return std::max(rows * ffn, expert_rows() * expert_ffn); }
  device::AttentionShape attention() const {
    return {batch, seq, heads, kv_heads, head_dim, window};
  }
};

// An MoE layer's settings beyond its shapes, and what it runs with: the device (the routing is
// read back) and the scratch the layers share, set with the workspace; per layer, its experts and
// the micro-batch's load-balancing sums (counted in forward; with aux_grad, their gradient in
// scratch.aux_grad is added in backward).
struct MoeSpec {
  bool normalize = false;
  device::Device* device = nullptr;
  ExpertSource* source = nullptr;
  MoeScratch scratch;
  MoeAux* aux = nullptr;
  bool aux_grad = false;
  ExpertTraffic* traffic = nullptr;
  std::int64_t num_layers = 0;  // the model's (the experts' adapters' dropout keys)
  ExpertParallel ep;            // group null: every expert on this rank
};

// What a block is computed with: this rank's shapes, the tensor split and its collectives, the
// adapters' settings and the base weights' format. The block's layers are made from it.
struct BlockSetup {
  Dims d;
  TensorSplit split;
  AdapterSpec lora;
  BaseFormat base;
  MoeSpec moe;

  // The options' dtype, split, adapters (rank, targets, scaling, training dropout) and base
  // format for a micro-batch of batch x seq tokens.
  static BlockSetup make(const LlamaConfig& c, const ModelOptions& options, std::int64_t batch,
                         std::int64_t seq);
};

// Element offsets of one block's tensors inside a group (same for parameters and gradients);
// -1 for a tensor the family does not have (biases, q/k norms) or that lives in another group.
struct BlockOffsets {
  std::int64_t ln1 = -1, wq = -1, wk = -1, wv = -1, wo = -1, ln2 = -1, wg = -1, wu = -1, wd = -1;
  std::int64_t bq = -1, bk = -1, bv = -1, bo = -1, qn = -1, kn = -1, bg = -1, bu = -1, bd = -1;
  std::int64_t router = -1;  // an MoE layer's (its experts live in groups of their own)
};

// Element offsets of one block's adapters inside its adapter group, per LoraTarget: lora_A
// [r, in] and lora_B [out, r]; -1 for a projection without one.
struct LoraOffsets {
  static constexpr std::array<std::int64_t, kNumLoraTargets> kNone = [] {
    std::array<std::int64_t, kNumLoraTargets> none{};
    none.fill(-1);
    return none;
  }();
  std::array<std::int64_t, kNumLoraTargets> a = kNone;
  std::array<std::int64_t, kNumLoraTargets> b = kNone;
};

// Views of one block's weights (or of its gradients): HF shapes, [out, in] for projections;
// nullptr where the family has no such tensor, and for every base gradient of a frozen base.
template <typename Ptr>
struct BlockTensors {
  Ptr ln1 = nullptr;                                           // [hidden]
  Ptr wq = nullptr;                                            // [q_dim, hidden]
  Ptr wk = nullptr;                                            // [kv_dim, hidden]
  Ptr wv = nullptr;                                            // [kv_dim, hidden]
  Ptr wo = nullptr;                                            // [hidden, q_dim]
  Ptr ln2 = nullptr;                                           // [hidden]
  Ptr wg = nullptr;                                            // [ffn, hidden]
  Ptr wu = nullptr;                                            // [ffn, hidden]
  Ptr wd = nullptr;                                            // [hidden, ffn]
  Ptr bq = nullptr, bk = nullptr, bv = nullptr, bo = nullptr;  // [q_dim], [kv_dim] x2, [hidden]
  Ptr qn = nullptr, kn = nullptr;                              // [head_dim] each (Qwen3)
  Ptr bg = nullptr, bu = nullptr, bd = nullptr;                // [ffn] x2, [hidden]
  Ptr router = nullptr;  // [experts, hidden]: an MoE layer's, whose MLP is its experts
  LoraPair<Ptr> lora[kNumLoraTargets];  // per LoraTarget

  static BlockTensors at(Ptr base, const BlockOffsets& o, std::size_t eb) {
    BlockTensors t;
    t.overlay(base, o, eb);
    return t;
  }
  // The tensors `o` places (offset >= 0) at `base`, the others kept: a block's tensors that live
  // in its adapter group (norms that train beside the adapters).
  void overlay(Ptr base, const BlockOffsets& o, std::size_t eb) {
    auto view = [&](std::int64_t off, Ptr& p) {
      if (off >= 0) p = static_cast<Ptr>(offset_ptr(base, off, eb));
    };
    view(o.ln1, ln1);
    view(o.wq, wq);
    view(o.wk, wk);
    view(o.wv, wv);
    view(o.wo, wo);
    view(o.ln2, ln2);
    view(o.wg, wg);
    view(o.wu, wu);
    view(o.wd, wd);
    view(o.bq, bq);
    view(o.bk, bk);
    view(o.bv, bv);
    view(o.bo, bo);
    view(o.qn, qn);
    view(o.kn, kn);
    view(o.bg, bg);
    view(o.bu, bu);
    view(o.bd, bd);
    view(o.router, router);
  }
  // The adapters at `base` (an adapter group's parameters or gradients).
  void attach_lora(Ptr base, const LoraOffsets& o, std::size_t eb) {
    for (int i = 0; i < kNumLoraTargets; ++i) {
      if (o.a[i] < 0) continue;
      lora[i].a = static_cast<Ptr>(offset_ptr(base, o.a[i], eb));
      lora[i].b = static_cast<Ptr>(offset_ptr(base, o.b[i], eb));
    }
  }
};
using BlockWeights = BlockTensors<const void*>;
using BlockGrads = BlockTensors<void*>;

// What one block's backward needs from its forward (all device pointers, compute dtype unless
// noted). x is the block input, kept by the caller. Under sequence parallelism x, rstd1, hmid
// and rstd2 hold this rank's local_rows, and a and b every row, gathered from this rank's norm
// output: written into its rows of them, or, where a_local and b_local are set (every layer's
// activations kept, a and b shared by the layers), kept there and gathered again in backward.
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
  void* m = nullptr;        // [rows, ffn]      silu(gate) * up (Dims::mlp_elems)
  // Each adapter's dropout(x) A^T [rows, r], per LoraTarget (nullptr without one; an MoE
  // layer's router's is in `moe`).
  void* lora_t[kNumLoraTargets] = {};
  // Scratch [rows, max in features], not kept: an adapter's input after dropout (lora_dropout > 0).
  void* lora_x = nullptr;
  // Sequence parallelism: scratch [rows, hidden], not kept: a row-parallel product before its
  // reduce-scatter (without it the product is summed where it lands).
  void* partial = nullptr;
  void* a_local = nullptr;  // [local_rows, hidden] this rank's rows of a, where kept apart
  void* b_local = nullptr;  // [local_rows, hidden] this rank's rows of b, where kept apart
  // An MoE layer's routing and expert activations (its gate, up and m: the ones above, as
  // [rows k, expert_ffn]).
  MoeActs moe;
};

// Backward scratch shared by all blocks. The MLP part (dm; the gate and up gradients take the
// room of the layer's own gate and up) and the attention part (datt, dq, dk, dv) are never live
// together and share memory.
struct BackwardScratch {
  // [rows, hidden] gradient of the residual stream, updated in place; under sequence parallelism
  // [local_rows, hidden], this rank's rows of dh_full [rows, hidden] (gathered before the
  // row-parallel products' backward), and dx_local [local_rows, hidden] this rank's rows of a
  // column-parallel input gradient, reduce-scattered from dx; dln [hidden] a norm's weight
  // gradient from this rank's rows, summed over the group (zero when block_backward starts).
  void* dh = nullptr;
  void* dh_full = nullptr;
  void* dx_local = nullptr;
  void* dln1 = nullptr;
  void* dln2 = nullptr;
  void* dtmp = nullptr;    // [rows, hidden]
  void* dx = nullptr;      // [rows, hidden] gradient of a norm's output
  void* dm = nullptr;      // [rows, ffn]
  void* datt = nullptr;    // [rows, q_dim]
  void* dq = nullptr;      // [rows, q_dim]
  void* dk = nullptr;      // [rows, kv_dim]
  void* dv = nullptr;      // [rows, kv_dim]
  void* dq_pre = nullptr;  // [rows, q_dim]  through q_norm (Qwen3 only)
  void* dk_pre = nullptr;  // [rows, kv_dim] through k_norm (Qwen3 only)
  // Adapters: the gradient of an adapter's t [rows, r], and (lora_dropout > 0) of its dropped-out
  // input [rows, max in features].
  void* lora_dt = nullptr;
  void* lora_dx = nullptr;
  // Split: an adapter weight's gradient before its sum (AdapterScratch::grad), [r, max in].
  void* lora_grad = nullptr;
  // Tensor parallelism: q/k norms' weight gradients of this rank's heads [head_dim] each, summed
  // over the group before they are added (Qwen3 only); zero when block_backward starts.
  void* dqn = nullptr;
  void* dkn = nullptr;
  // Tensor parallelism with kv heads whole on several ranks: k's and v's weight gradient
  // [kv_dim, hidden] (one after the other) and bias gradients [kv_dim] each, summed over the
  // replicas before they are added; the bias ones zero when block_backward starts.
  void* kv_dw = nullptr;
  void* kdb = nullptr;
  void* vdb = nullptr;
};

// x [rows, hidden] -> out [rows, hidden]; fills acts (acts.x must be x). out == nullptr stops
// after the SwiGLU (recomputation for backward needs no block output).
Status block_forward(const device::Ops& ops, const BlockSetup& b, const BlockWeights& w,
                     const BlockActs& acts, void* out);

// s.dh [rows, hidden]: dL/d(block output) on entry, dL/d(block input) on exit. Accumulates
// (+=) into the block's gradients g.
Status block_backward(const device::Ops& ops, const BlockSetup& b, const BlockWeights& w,
                      const BlockActs& acts, const BlockGrads& g, const BackwardScratch& s);

// What one block needs to decode `rows` new tokens of one sequence (all device pointers,
// compute dtype unless noted); shared by the layers, which run one after another.
struct DecodeActs {
  void* x = nullptr;       // [rows, hidden] block input
  void* a = nullptr;       // [rows, hidden]
  void* q = nullptr;       // [rows, q_dim]
  void* q_pre = nullptr;   // [rows, q_dim]  (Qwen3)
  void* k_pre = nullptr;   // [rows, kv_dim] (Qwen3)
  float* rstd = nullptr;   // [rows * heads] f32: every norm's statistics (not kept)
  void* att = nullptr;     // [rows, q_dim]
  void* hmid = nullptr;    // [rows, hidden]
  void* b = nullptr;       // [rows, hidden]
  void* gate = nullptr;    // [rows, ffn]
  void* up = nullptr;      // [rows, ffn]
  void* m = nullptr;       // [rows, ffn]
  void* lora_t = nullptr;  // [rows, r]: one adapter's x A^T at a time
  MoeActs moe;             // an MoE layer's (its gate, up and m: the ones above)
};

// Decodes d.rows new tokens at positions past.. past + rows - 1 (d.batch 1, d.seq = rows):
// their keys and values go into rows [past, past + rows) of the layer's caches ([positions,
// kv_dim] each), and their queries attend every cached position. x -> out [rows, hidden].
Status block_decode(const device::Ops& ops, const BlockSetup& b, const BlockWeights& w,
                    const DecodeActs& s, void* k_cache, void* v_cache, std::int64_t past,
                    void* out);

// rmsnorm_backward over this rank's rows of [rows, hidden]; under sequence parallelism the weight
// gradient of those rows is summed over the group in `scratch` (zero on entry) before it is added
// to gw.
Status norm_backward(const device::Ops& ops, const Dims& d, const TensorSplit& split,
                     const void* dy, const void* x, const void* w, const float* rstd, void* dx,
                     void* gw, void* scratch, std::string_view what);

}  // namespace strata::model::detail
