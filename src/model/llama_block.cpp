// One LLaMA decoder block (HF LlamaDecoderLayer): forward and hand-written backward, composed of
// its layers (parallel_layers.h) and its MLP (dense_mlp.h).
#include "src/model/llama_block.h"

#include "strata/core/check.h"

namespace strata::model::detail {

BlockSetup BlockSetup::make(const LlamaConfig& c, const ModelOptions& options, std::int64_t batch,
                            std::int64_t seq) {
  const DType dtype = options.compute_dtype;
  BlockSetup b;
  Dims& d = b.d;
  d.batch = batch;
  d.seq = seq;
  d.rows = batch * seq;
  d.hidden = c.hidden_size;
  d.heads = c.num_attention_heads;
  d.kv_heads = c.num_key_value_heads;
  d.head_dim = c.head_dim();
  d.q_dim = c.q_dim();
  d.kv_dim = c.kv_dim();
  d.ffn = c.intermediate_size;
  d.vocab = c.vocab_size;
  d.eps = static_cast<float>(c.rms_norm_eps);
  d.rope = c.rope();
  d.qk_norm = c.qk_norm;
  if (c.has_moe()) {
    d.experts = c.moe.num_experts;
    d.experts_per_token = c.moe.experts_per_token;
    d.expert_ffn = c.moe.expert_intermediate_size;
    b.moe.normalize = c.moe.normalize_top_k;
    b.moe.num_layers = c.num_hidden_layers;
    if (options.expert_parallel.split()) {
      d.expert_ranks = options.expert_parallel.size;
      b.moe.ep.group = options.expert_group;
      b.moe.ep.capacity = d.expert_rows();
    }
  }
  d.dtype = dtype;
  d.elem_bytes = dtype_size(dtype);
  if (const std::optional<LoraConfig>& lora = options.lora) {
    b.lora.rank = lora->r;
    for (int i = 0; i < kNumLoraTargets; ++i) {
      b.lora.on[i] = lora->has(static_cast<LoraTarget>(i));
    }
    b.lora.scaling = static_cast<float>(lora->scaling());
    b.lora.dropout = static_cast<float>(lora->dropout);
  }
  b.base.nf4 = options.nf4_base;
  TensorSplit& split = b.split;
  split.group = options.tensor_group;
  split.size = options.tensor_parallel.size;
  split.rank = options.tensor_parallel.rank;
  split.dtype = dtype;
  split.elem_bytes = d.elem_bytes;
  if (split.split()) {
    // This rank's share (ParamLayout::build's slices): its heads, its kv heads (one, whole, when
    // they are fewer than the ranks), its part of the MLP and of the vocabulary.
    const std::int64_t t = split.size;
    d.heads /= t;
    split.kv_replicas = kv_head_replicas(c.num_key_value_heads, split.size);
    d.kv_heads = c.num_key_value_heads * split.kv_replicas / t;
    d.q_dim = d.heads * d.head_dim;
    d.kv_dim = d.kv_heads * d.head_dim;
    d.ffn /= t;
    d.vocab /= t;
    split.vocab_begin = d.vocab * options.tensor_parallel.rank;
  }
  if (options.lm_head_chunk_tokens > 0) {
    d.head_rows = std::min(options.lm_head_chunk_tokens, d.rows);
  } else if (d.vocab <= 2 * d.hidden) {
    d.head_rows = d.rows;
  } else {
    d.head_rows =
        std::clamp<std::int64_t>((2 * d.hidden * d.rows + d.vocab - 1) / d.vocab, 1, d.rows);
  }
  split.rows = split.local_rows = d.rows;
  if (split.split() && options.sequence_parallel) {
    split.seq_parallel = true;
    split.local_rows = d.rows / split.size;
    split.row_begin = split.local_rows * options.tensor_parallel.rank;
  }
  return b;
}

Status norm_backward(const device::Ops& ops, const Dims& d, const TensorSplit& split,
                     const void* dy, const void* x, const void* w, const float* rstd, void* dx,
                     void* gw, void* scratch, std::string_view what) {
  const std::int64_t R = split.local_rows, H = d.hidden;
  if (!split.seq_parallel || gw == nullptr) {
    ops.rmsnorm_backward(dy, x, w, rstd, dx, gw, R, H, d.dtype);
    return Status::ok();
  }
  ops.rmsnorm_backward(dy, x, w, rstd, dx, scratch, R, H, d.dtype);
  STRATA_RETURN_IF_ERROR(split.sum(scratch, H, what));
  ops.add(gw, scratch, gw, H, d.dtype);
  return Status::ok();
}

namespace {

// The block's layers over its weights: q/k/v one column-parallel layer, o_proj a row-parallel
// one, and the MLP. A row-parallel projection's bias is added after the ranks' sum.
struct BlockLayers {
  ColumnParallelLinear<3> qkv;
  RowParallelLinear o;
  DenseMlp mlp;
};

BlockLayers layers_of(const BlockSetup& b, const BlockWeights& w) {
  const Dims& d = b.d;
  const bool split = b.split.split();
  const auto linear = [&](LoraTarget target, std::int64_t out, std::int64_t in, const void* wt,
                          const void* bias, ParallelKind kind) {
    Linear l;
    l.kind = kind;
    l.tp = &b.split;
    l.in_begin = kind == ParallelKind::kRow ? in * b.split.rank : 0;
    l.full_in = kind == ParallelKind::kRow ? in * b.split.size : in;
    l.target = target;
    l.rows = d.rows;
    l.out = out;
    l.in = in;
    l.w = wt;
    l.b = bias;
    l.adapter = w.lora[static_cast<std::size_t>(target)];
    l.lora = &b.lora;
    l.base = &b.base;
    l.dtype = d.dtype;
    return l;
  };
  BlockLayers L;
  L.qkv.split = &b.split;
  constexpr ParallelKind kColumn = ParallelKind::kColumn, kRow = ParallelKind::kRow;
  L.qkv.parts = {linear(LoraTarget::kQ, d.q_dim, d.hidden, w.wq, w.bq, kColumn),
                 linear(LoraTarget::kK, d.kv_dim, d.hidden, w.wk, w.bk, kColumn),
                 linear(LoraTarget::kV, d.kv_dim, d.hidden, w.wv, w.bv, kColumn)};
  if (b.split.kv_replicas > 1) {
    for (std::size_t i : {1, 2}) L.qkv.parts[i].replicas = b.split.group;
  }
  L.o.split = &b.split;
  L.o.part = linear(LoraTarget::kO, d.hidden, d.q_dim, w.wo, split ? nullptr : w.bo, kRow);
  L.o.bias = w.bo;
  L.mlp.gate_up.split = &b.split;
  L.mlp.gate_up.parts = {linear(LoraTarget::kGate, d.ffn, d.hidden, w.wg, w.bg, kColumn),
                         linear(LoraTarget::kUp, d.ffn, d.hidden, w.wu, w.bu, kColumn)};
  L.mlp.down.split = &b.split;
  L.mlp.down.part = linear(LoraTarget::kDown, d.hidden, d.ffn, w.wd, split ? nullptr : w.bd, kRow);
  L.mlp.down.bias = w.bd;
  return L;
}

void* t_of(void* const (&ts)[kNumLoraTargets], LoraTarget target) {
  return ts[static_cast<std::size_t>(target)];
}

MlpActs mlp_acts(void* gate, void* up, void* m, void* const (&ts)[kNumLoraTargets]) {
  return {gate,
          up,
          m,
          t_of(ts, LoraTarget::kGate),
          t_of(ts, LoraTarget::kUp),
          t_of(ts, LoraTarget::kDown)};
}

// An MoE layer's MLP over its weights' router and the setup's experts.
MoeMlp moe_of(const BlockSetup& b, const BlockWeights& w) {
  const Dims& d = b.d;
  MoeMlp m;
  m.device = b.moe.device;
  m.tokens = d.rows;
  m.hidden = d.hidden;
  m.experts = d.experts;
  m.k = d.experts_per_token;
  m.ffn = d.expert_ffn;
  m.normalize = b.moe.normalize;
  m.dtype = d.dtype;
  m.router = w.router;
  m.router_adapter = w.lora[static_cast<std::size_t>(LoraTarget::kRouter)];
  m.source = b.moe.source;
  m.base = &b.base;
  m.traffic = b.moe.traffic;
  m.lora = &b.lora;
  m.num_layers = b.moe.num_layers;
  m.ep = b.moe.ep.group != nullptr ? &b.moe.ep : nullptr;
  return m;
}

// The block after attention, shared by training and decoding: hmid = x + att Wo^T (+ bo) ;
// b = rmsnorm(hmid) (statistics into rstd) ; then the MLP from b (an MoE layer's experts where
// it has a router), and unless out is null, out = hmid + its output. Null out (recomputation
// for backward) still forms down_proj's adapter activation, which its backward needs. `ts`: each
// adapter's t.
Status block_tail(const device::Ops& ops, const BlockSetup& bs, const BlockLayers& L,
                  const BlockWeights& w, const void* x, const void* att, void* hmid, float* rstd,
                  void* b, const MlpActs& mlp, const MoeActs& moe, void* t_o, void* scratch,
                  void* partial, void* b_local, void* out) {
  const Dims& d = bs.d;
  const TensorSplit& split = bs.split;
  const std::int64_t H = d.hidden, Rl = split.local_rows;
  STRATA_RETURN_IF_ERROR(L.o.forward(ops, att, partial, hmid, t_o, scratch, "o_proj output"));
  ops.add(hmid, x, hmid, Rl * H, d.dtype);
  ops.rmsnorm_forward(hmid, w.ln2, b_local != nullptr ? b_local : split.row_slot(b, H), rstd, Rl, H,
                      d.eps, d.dtype);
  if (w.router != nullptr) {
    // Under tensor parallelism every rank of the group runs the whole MoE layer over every row
    // (the experts and the router are whole on each: Megatron's default), so its output and
    // input gradient are complete, with nothing to sum.
    STRATA_CHECK(!split.seq_parallel, "an MoE layer under sequence parallelism");
    STRATA_RETURN_IF_ERROR(moe_of(bs, w).forward(ops, b, moe, bs.moe.scratch, out,
                                                 out != nullptr ? bs.moe.aux : nullptr));
  } else {
    STRATA_RETURN_IF_ERROR(
        L.mlp.gate_up.gather_input(b, "post_attention_layernorm output", b_local));
    STRATA_RETURN_IF_ERROR(L.mlp.forward(ops, b, mlp, scratch, partial, out));
  }
  if (out != nullptr) ops.add(out, hmid, out, Rl * H, d.dtype);
  return Status::ok();
}

}  // namespace

// x [R, H] -> out [R, H]:
//   a = rmsnorm(x) ; q, k, v = a Wq^T + bq, a Wk^T + bk, a Wv^T + bv (biases where the family has
//   them) ; q, k = rmsnorm per head (Qwen3) ; rope(q, k) ; att = attention(q, k, v, window)
//   hmid = x + att Wo^T (+ bo) ; b = rmsnorm(hmid) ; m = silu(b Wg^T) * (b Wu^T) ;
//   out = hmid + m Wd^T (MLP biases under mlp_bias); each projection plus its adapter's
//   scaling * dropout(input) A^T B^T where it has one.
Status block_forward(const device::Ops& ops, const BlockSetup& bs, const BlockWeights& w,
                     const BlockActs& s, void* out) {
  const Dims& d = bs.d;
  const DType dt = d.dtype;
  const std::int64_t R = d.rows, H = d.hidden;
  const BlockLayers L = layers_of(bs, w);
  ops.rmsnorm_forward(s.x, w.ln1, s.a_local != nullptr ? s.a_local : bs.split.row_slot(s.a, H),
                      s.rstd1, bs.split.local_rows, H, d.eps, dt);
  STRATA_RETURN_IF_ERROR(L.qkv.gather_input(s.a, "input_layernorm output", s.a_local));
  L.qkv.forward(ops, s.a, {d.qk_norm ? s.q_pre : s.q, d.qk_norm ? s.k_pre : s.k, s.v},
                {t_of(s.lora_t, LoraTarget::kQ), t_of(s.lora_t, LoraTarget::kK),
                 t_of(s.lora_t, LoraTarget::kV)},
                s.lora_x);
  if (d.qk_norm) {
    ops.rmsnorm_forward(s.q_pre, w.qn, s.q, s.rstd_q, R * d.heads, d.head_dim, d.eps, dt);
    ops.rmsnorm_forward(s.k_pre, w.kn, s.k, s.rstd_k, R * d.kv_heads, d.head_dim, d.eps, dt);
  }
  ops.rope(s.q, d.batch, d.seq, d.heads, d.head_dim, d.rope, false, dt);
  ops.rope(s.k, d.batch, d.seq, d.kv_heads, d.head_dim, d.rope, false, dt);
  ops.attention_forward(s.q, s.k, s.v, s.att, s.lse, d.attention(), dt);
  return block_tail(ops, bs, L, w, s.x, s.att, s.hmid, s.rstd2, s.b,
                    mlp_acts(s.gate, s.up, s.m, s.lora_t), s.moe, t_of(s.lora_t, LoraTarget::kO),
                    s.lora_x, s.partial, s.b_local, out);
}

Status block_decode(const device::Ops& ops, const BlockSetup& bs, const BlockWeights& w,
                    const DecodeActs& s, void* k_cache, void* v_cache, std::int64_t past,
                    void* out) {
  const Dims& d = bs.d;
  const DType dt = d.dtype;
  const std::int64_t R = d.rows, H = d.hidden, KV = d.kv_dim;
  STRATA_CHECK(bs.lora.dropout == 0.0f, "decoding with adapter dropout", bs.lora.dropout);
  STRATA_CHECK(!bs.split.seq_parallel, "decoding with sequence parallelism");
  void* k_new = offset_ptr(k_cache, past * KV, d.elem_bytes);
  void* v_new = offset_ptr(v_cache, past * KV, d.elem_bytes);
  // No backward: every adapter's t goes through the one scratch.
  void* ts[kNumLoraTargets];
  std::fill(std::begin(ts), std::end(ts), s.lora_t);
  const BlockLayers L = layers_of(bs, w);
  ops.rmsnorm_forward(s.x, w.ln1, s.a, s.rstd, R, H, d.eps, dt);
  L.qkv.forward(ops, s.a, {d.qk_norm ? s.q_pre : s.q, d.qk_norm ? s.k_pre : k_new, v_new},
                {s.lora_t, s.lora_t, s.lora_t}, nullptr);
  if (d.qk_norm) {
    ops.rmsnorm_forward(s.q_pre, w.qn, s.q, s.rstd, R * d.heads, d.head_dim, d.eps, dt);
    ops.rmsnorm_forward(s.k_pre, w.kn, k_new, s.rstd, R * d.kv_heads, d.head_dim, d.eps, dt);
  }
  device::RopeParams rope = d.rope;
  rope.position_offset = past;
  ops.rope(s.q, 1, R, d.heads, d.head_dim, rope, false, dt);
  ops.rope(k_new, 1, R, d.kv_heads, d.head_dim, rope, false, dt);
  ops.attention_decode(s.q, k_cache, v_cache, s.att,
                       {R, past, d.heads, d.kv_heads, d.head_dim, d.window}, dt);
  return block_tail(ops, bs, L, w, s.x, s.att, s.hmid, s.rstd, s.b, mlp_acts(s.gate, s.up, s.m, ts),
                    s.moe, s.lora_t, nullptr, nullptr, nullptr, out);
}

// dh [R, H]: dL/dout -> dL/dx. Weight gradients dW = dY^T X (+=), bias gradients db = sum of dY
// over rows (+=), input gradients dX = dY W; a frozen base (null gradients) skips its weight
// and bias products but not the input gradients, and each adapter adds its own.
Status block_backward(const device::Ops& ops, const BlockSetup& bs, const BlockWeights& w,
                      const BlockActs& s, const BlockGrads& g, const BackwardScratch& t) {
  const Dims& d = bs.d;
  const TensorSplit& split = bs.split;
  const DType dt = d.dtype;
  const std::int64_t R = d.rows, H = d.hidden, Rl = split.local_rows;
  const BlockLayers L = layers_of(bs, w);
  const AdapterScratch as{t.lora_dt, t.lora_dx, t.lora_grad};
  const auto grad_of = [&](LoraTarget target) { return g.lora[static_cast<std::size_t>(target)]; };
  const auto t_at = [&](LoraTarget target) { return t_of(s.lora_t, target); };
  // Under sequence parallelism the row-parallel products' backward takes every row of dh, and
  // each column-parallel input gradient comes back as this rank's rows of its sum.
  void* const dh = split.seq_parallel ? t.dh_full : t.dh;
  void* const dx = split.seq_parallel ? t.dx_local : t.dx;

  // MLP: out = hmid + m Wd^T (+ bd), m = silu(gate) * up.
  const MlpGrads mg{g.wg,
                    g.wu,
                    g.wd,
                    g.bg,
                    g.bu,
                    g.bd,
                    grad_of(LoraTarget::kGate),
                    grad_of(LoraTarget::kUp),
                    grad_of(LoraTarget::kDown)};
  if (w.router != nullptr) {
    STRATA_RETURN_IF_ERROR(moe_of(bs, w).backward(ops, s.b, s.moe, bs.moe.scratch, dh, t.dm,
                                                  g.router, grad_of(LoraTarget::kRouter),
                                                  bs.moe.aux_grad, dx));
  } else {
    // Kept apart, this layer's b is gathered again into the buffer the layers share.
    STRATA_RETURN_IF_ERROR(L.mlp.backward(ops, s.b, mlp_acts(s.gate, s.up, s.m, s.lora_t), mg, dh,
                                          t.dm, t.dx, dx, s.lora_x, as, s.b_local));
  }
  STRATA_RETURN_IF_ERROR(norm_backward(ops, d, split, dx, s.hmid, w.ln2, s.rstd2, t.dtmp, g.ln2,
                                       t.dln2, "post_attention_layernorm weight gradient"));
  ops.add(t.dh, t.dtmp, t.dh, Rl * H, dt);  // dh = dL/dhmid (residual + norm path)

  // Attention: hmid = x + att Wo^T (+ bo).
  STRATA_RETURN_IF_ERROR(L.o.gather_output_grad(dh, "attention output gradient"));
  STRATA_RETURN_IF_ERROR(L.o.part.backward(ops, s.att, t_at(LoraTarget::kO), g.wo, g.bo,
                                           grad_of(LoraTarget::kO), dh, t.datt, false, s.lora_x,
                                           as));
  ops.attention_backward(t.datt, s.q, s.k, s.v, s.att, s.lse, t.dq, t.dk, t.dv, d.attention(), dt);
  ops.rope(t.dq, d.batch, d.seq, d.heads, d.head_dim, d.rope, true, dt);
  ops.rope(t.dk, d.batch, d.seq, d.kv_heads, d.head_dim, d.rope, true, dt);
  const void* dq = t.dq;
  const void* dk = t.dk;
  if (d.qk_norm) {
    // Split, each rank's heads give part of the whole norm's weight gradient: summed over the
    // group in scratch (zeroed by the caller), then added.
    const auto norm_back = [&](const void* dy, const void* x, const void* wn, const float* rstd,
                               void* dxn, void* gw, void* scratch, std::int64_t heads,
                               std::string_view what) -> Status {
      if (!split.split() || gw == nullptr) {
        ops.rmsnorm_backward(dy, x, wn, rstd, dxn, gw, R * heads, d.head_dim, dt);
        return Status::ok();
      }
      ops.rmsnorm_backward(dy, x, wn, rstd, dxn, scratch, R * heads, d.head_dim, dt);
      STRATA_RETURN_IF_ERROR(split.sum(scratch, d.head_dim, what));
      ops.add(gw, scratch, gw, d.head_dim, dt);
      return Status::ok();
    };
    STRATA_RETURN_IF_ERROR(norm_back(t.dq, s.q_pre, w.qn, s.rstd_q, t.dq_pre, g.qn, t.dqn, d.heads,
                                     "q_norm weight gradient"));
    STRATA_RETURN_IF_ERROR(norm_back(t.dk, s.k_pre, w.kn, s.rstd_k, t.dk_pre, g.kn, t.dkn,
                                     d.kv_heads, "k_norm weight gradient"));
    dq = t.dq_pre;
    dk = t.dk_pre;
  }
  if (s.a_local != nullptr) {
    STRATA_RETURN_IF_ERROR(L.qkv.gather_input(s.a, "input_layernorm output again", s.a_local));
  }
  // The input gradients add up in t.dx; k's and v's weight gradients are summed over the kv
  // replicas where their head is whole on several ranks.
  const auto& [q, k, v] = L.qkv.parts;
  STRATA_RETURN_IF_ERROR(q.backward(ops, s.a, t_at(LoraTarget::kQ), g.wq, g.bq,
                                    grad_of(LoraTarget::kQ), dq, t.dx, false, s.lora_x, as));
  STRATA_RETURN_IF_ERROR(k.backward(ops, s.a, t_at(LoraTarget::kK), g.wk, g.bk,
                                    grad_of(LoraTarget::kK), dk, t.dx, true, s.lora_x, as, t.kv_dw,
                                    t.kdb));
  STRATA_RETURN_IF_ERROR(v.backward(ops, s.a, t_at(LoraTarget::kV), g.wv, g.bv,
                                    grad_of(LoraTarget::kV), t.dv, t.dx, true, s.lora_x, as,
                                    t.kv_dw, t.vdb));
  STRATA_RETURN_IF_ERROR(L.qkv.reduce_input_grad(t.dx, dx, "q/k/v input gradient"));
  STRATA_RETURN_IF_ERROR(norm_backward(ops, d, split, dx, s.x, w.ln1, s.rstd1, t.dtmp, g.ln1,
                                       t.dln1, "input_layernorm weight gradient"));
  ops.add(t.dh, t.dtmp, t.dh, Rl * H, dt);  // dh = dL/dx
  return Status::ok();
}

}  // namespace strata::model::detail
