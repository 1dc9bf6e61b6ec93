// One LLaMA decoder block (HF LlamaDecoderLayer): forward and hand-written backward.
#include "src/model/llama_block.h"

#include "strata/core/check.h"

namespace strata::model::detail {

Dims Dims::make(const LlamaConfig& c, const ModelOptions& options, std::int64_t batch,
                std::int64_t seq) {
  const DType dtype = options.compute_dtype;
  const std::optional<LoraConfig>& lora = options.lora;
  Dims d;
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
  d.dtype = dtype;
  d.elem_bytes = dtype_size(dtype);
  if (lora) {
    d.lora_rank = lora->r;
    for (int i = 0; i < kNumLoraTargets; ++i) d.lora_on[i] = lora->has(static_cast<LoraTarget>(i));
    d.lora_scaling = static_cast<float>(lora->scaling());
    d.lora_dropout = static_cast<float>(lora->dropout);
  }
  d.nf4 = options.nf4_base;
  d.tp = options.tensor_group;
  d.tp_size = options.tensor_parallel.size;
  if (d.split()) {
    // This rank's share (ParamLayout::build's slices): its heads, its kv heads (one, whole, when
    // they are fewer than the ranks), its part of the MLP and of the vocabulary.
    const std::int64_t t = d.tp_size;
    d.heads /= t;
    d.kv_replicas = kv_head_replicas(c.num_key_value_heads, d.tp_size);
    d.kv_heads = c.num_key_value_heads * d.kv_replicas / t;
    d.q_dim = d.heads * d.head_dim;
    d.kv_dim = d.kv_heads * d.head_dim;
    d.ffn /= t;
    d.vocab /= t;
    d.vocab_begin = d.vocab * options.tensor_parallel.rank;
  }
  if (options.lm_head_chunk_tokens > 0) {
    d.head_rows = std::min(options.lm_head_chunk_tokens, d.rows);
  } else if (d.vocab <= 2 * d.hidden) {
    d.head_rows = d.rows;
  } else {
    d.head_rows =
        std::clamp<std::int64_t>((2 * d.hidden * d.rows + d.vocab - 1) / d.vocab, 1, d.rows);
  }
  d.local_rows = d.rows;
  if (d.split() && options.sequence_parallel) {
    d.seq_parallel = true;
    d.local_rows = d.rows / d.tp_size;
    d.row_begin = d.local_rows * options.tensor_parallel.rank;
  }
  return d;
}

namespace {
// The sum over the tensor-parallel group of buffer [n] (nothing on one rank).
Status tp_sum(const Dims& d, void* buffer, std::int64_t n, std::string_view what) {
  return d.split() ? d.tp->all_reduce_sum(buffer, n, d.dtype, what) : Status::ok();
}
}  // namespace

void* row_slot(const Dims& d, void* full, std::int64_t n) {
  return offset_ptr(full, d.row_begin * n, d.elem_bytes);
}

Status gather_rows(const Dims& d, void* full, std::int64_t n, std::string_view what,
                   const void* local) {
  if (!d.seq_parallel) return Status::ok();
  return d.tp->all_gather(local != nullptr ? local : row_slot(d, full, n), full, d.local_rows * n,
                          d.dtype, what);
}

Status sum_partial(const Dims& d, void* partial, void* out, std::int64_t n, std::string_view what) {
  if (d.seq_parallel) {
    return d.tp->reduce_scatter_sum(partial, out, d.local_rows * n, d.dtype, what);
  }
  STRATA_CHECK(partial == out, "a partial product summed elsewhere without sequence parallelism");
  return tp_sum(d, out, d.rows * n, what);
}

Status norm_backward(const device::Ops& ops, const Dims& d, const void* dy, const void* x,
                     const void* w, const float* rstd, void* dx, void* gw, void* scratch,
                     std::string_view what) {
  const std::int64_t R = d.local_rows, H = d.hidden;
  if (!d.seq_parallel || gw == nullptr) {
    ops.rmsnorm_backward(dy, x, w, rstd, dx, gw, R, H, d.dtype);
    return Status::ok();
  }
  ops.rmsnorm_backward(dy, x, w, rstd, dx, scratch, R, H, d.dtype);
  STRATA_RETURN_IF_ERROR(tp_sum(d, scratch, H, what));
  ops.add(gw, scratch, gw, H, d.dtype);
  return Status::ok();
}

void matmul(const device::Ops& ops, DType dtype, bool trans_a, bool trans_b, std::int64_t m,
            std::int64_t n, std::int64_t k, const void* a, const void* b, void* c, bool accumulate,
            float alpha) {
  device::GemmArgs g;
  g.trans_a = trans_a;
  g.trans_b = trans_b;
  g.m = m;
  g.n = n;
  g.k = k;
  g.alpha = alpha;
  g.a = a;
  g.lda = trans_a ? m : k;
  g.b = b;
  g.ldb = trans_b ? k : n;
  g.beta = accumulate ? 1.0f : 0.0f;
  g.c = c;
  g.ldc = n;
  g.dtype = dtype;
  ops.gemm(g);
}

namespace {

using Adapter = LoraPair<const void*>;
using AdapterGrad = LoraPair<void*>;

// One projection of the block, with its adapter (if any) and what its backward needs.
struct Projection {
  LoraTarget target;
  std::int64_t out, in;
  const void* w;  // [out, in]
  const void* b;  // [out] or nullptr
  Adapter lora;   // nullptrs without an adapter
};

std::uint64_t dropout_key(const Dims& d, LoraTarget target) {
  return lora_dropout_key(d.lora_key, d.layer, target);
}

// The adapter's input: x, or dropout(x) in `scratch` while training with lora_dropout > 0.
const void* adapter_input(const device::Ops& ops, const Dims& d, const Projection& p, const void* x,
                          void* scratch) {
  if (d.lora_dropout <= 0.0f) return x;
  ops.dropout(x, scratch, d.rows * p.in, d.lora_dropout, dropout_key(d, p.target), d.dtype);
  return scratch;
}

// t [R, r] = dropout(x) A^T: the adapter's low-rank activation, kept for its backward.
void adapter_t(const device::Ops& ops, const Dims& d, const Projection& p, const void* x, void* t,
               void* scratch) {
  const void* xin = adapter_input(ops, d, p, x, scratch);
  matmul(ops, d.dtype, false, true, d.rows, d.lora_rank, p.in, xin, p.lora.a, t, false);
}

// The projection's weight in the compute dtype: its own, or an NF4 base's decoded into
// d.nf4_weight (valid until the next projection's).
const void* weight_of(const device::Ops& ops, const Dims& d, const Projection& p) {
  if (!d.nf4) return p.w;
  ops.dequantize_nf4(p.w, p.out * p.in, d.nf4_weight, d.dtype);
  return d.nf4_weight;
}

// y [R, out] = x W^T (+ b) (+ scaling * dropout(x) A^T B^T, its t kept in `t`): PEFT's
// result = base_layer(x) + lora_B(lora_A(dropout(x))) * scaling.
void project(const device::Ops& ops, const Dims& d, const Projection& p, const void* x, void* y,
             void* t, void* scratch) {
  matmul(ops, d.dtype, false, true, d.rows, p.out, p.in, x, weight_of(ops, d, p), y, false);
  if (p.b != nullptr) ops.add_bias(y, p.b, d.rows, p.out, d.dtype);
  if (p.lora.a == nullptr) return;
  adapter_t(ops, d, p, x, t, scratch);
  matmul(ops, d.dtype, false, true, d.rows, p.out, d.lora_rank, t, p.lora.b, y, true,
         d.lora_scaling);
}

// Backward of project with dy [R, out]: dW += dy^T x and db += sum(dy) where the weight trains
// (gw, gb non-null), dB += scaling dy^T t and dA += (scaling dy B)^T dropout(x) where it has an
// adapter, and dx [R, in] = (or += with accumulate) dy W + dropout(scaling dy B A).
void project_backward(const device::Ops& ops, const Dims& d, const Projection& p, const void* x,
                      const void* t, void* gw, void* gb, const AdapterGrad& ga, const void* dy,
                      void* dx, bool accumulate, void* x_scratch, const BackwardScratch& s) {
  const DType dt = d.dtype;
  const std::int64_t R = d.rows, r = d.lora_rank;
  if (gw != nullptr) matmul(ops, dt, true, false, p.out, p.in, R, dy, x, gw, true);
  if (gb != nullptr) ops.bias_grad(dy, gb, R, p.out, dt);
  matmul(ops, dt, false, false, R, p.in, p.out, dy, weight_of(ops, d, p), dx, accumulate);
  if (p.lora.a == nullptr) return;
  matmul(ops, dt, true, false, p.out, r, R, dy, t, ga.b, true, d.lora_scaling);
  matmul(ops, dt, false, false, R, r, p.out, dy, p.lora.b, s.lora_dt, false, d.lora_scaling);
  const void* xin = adapter_input(ops, d, p, x, x_scratch);
  matmul(ops, dt, true, false, r, p.in, R, s.lora_dt, xin, ga.a, true);
  if (d.lora_dropout <= 0.0f) {
    matmul(ops, dt, false, false, R, p.in, r, s.lora_dt, p.lora.a, dx, true);
    return;
  }
  matmul(ops, dt, false, false, R, p.in, r, s.lora_dt, p.lora.a, s.lora_dx, false);
  ops.dropout(s.lora_dx, s.lora_dx, R * p.in, d.lora_dropout, dropout_key(d, p.target), dt);
  ops.add(dx, s.lora_dx, dx, R * p.in, dt);
}

Projection proj(const Dims& d, const BlockWeights& w, LoraTarget target) {
  const auto i = static_cast<std::size_t>(target);
  const Adapter lora = w.lora[i];
  switch (target) {
    case LoraTarget::kQ:
      return {target, d.q_dim, d.hidden, w.wq, w.bq, lora};
    case LoraTarget::kK:
      return {target, d.kv_dim, d.hidden, w.wk, w.bk, lora};
    case LoraTarget::kV:
      return {target, d.kv_dim, d.hidden, w.wv, w.bv, lora};
    case LoraTarget::kO:  // row-parallel: split, its bias is added after the ranks' sum
      return {target, d.hidden, d.q_dim, w.wo, d.split() ? nullptr : w.bo, lora};
    case LoraTarget::kGate:
      return {target, d.ffn, d.hidden, w.wg, w.bg, lora};
    case LoraTarget::kUp:
      return {target, d.ffn, d.hidden, w.wu, w.bu, lora};
    case LoraTarget::kDown:
      return {target, d.hidden, d.ffn, w.wd, d.split() ? nullptr : w.bd, lora};
  }
  STRATA_CHECK(false, "unknown LoRA target", static_cast<int>(target));
  return {};
}

void* t_of(void* const (&ts)[kNumLoraTargets], LoraTarget target) {
  return ts[static_cast<std::size_t>(target)];
}

// The block after attention, shared by training and decoding: hmid = x + att Wo^T (+ bo) ;
// b = rmsnorm(hmid) (statistics into rstd) ; m = silu(b Wg^T) * (b Wu^T) ; then, unless out is
// null, out = hmid + m Wd^T. Null out (recomputation for backward) still forms down_proj's
// adapter activation, which its backward needs. `ts`: each adapter's t.
Status block_tail(const device::Ops& ops, const Dims& d, const BlockWeights& w, const void* x,
                  const void* att, void* hmid, float* rstd, void* b, void* gate, void* up, void* m,
                  void* const (&ts)[kNumLoraTargets], void* scratch, void* partial, void* b_local,
                  void* out) {
  const DType dt = d.dtype;
  const std::int64_t R = d.rows, H = d.hidden, F = d.ffn, Rl = d.local_rows;
  // Row-parallel: the ranks' partial products summed (this rank's rows of the sum under sequence
  // parallelism), then the bias.
  void* o_part = d.seq_parallel ? partial : hmid;
  project(ops, d, proj(d, w, LoraTarget::kO), att, o_part, t_of(ts, LoraTarget::kO), scratch);
  if (d.split()) {
    STRATA_RETURN_IF_ERROR(sum_partial(d, o_part, hmid, H, "o_proj output"));
    if (w.bo != nullptr) ops.add_bias(hmid, w.bo, Rl, H, dt);
  }
  ops.add(hmid, x, hmid, Rl * H, dt);
  ops.rmsnorm_forward(hmid, w.ln2, b_local != nullptr ? b_local : row_slot(d, b, H), rstd, Rl, H,
                      d.eps, dt);
  STRATA_RETURN_IF_ERROR(gather_rows(d, b, H, "post_attention_layernorm output", b_local));
  project(ops, d, proj(d, w, LoraTarget::kGate), b, gate, t_of(ts, LoraTarget::kGate), scratch);
  project(ops, d, proj(d, w, LoraTarget::kUp), b, up, t_of(ts, LoraTarget::kUp), scratch);
  ops.swiglu_forward(gate, up, m, R * F, dt);
  const Projection down = proj(d, w, LoraTarget::kDown);
  if (out == nullptr) {
    if (down.lora.a != nullptr) adapter_t(ops, d, down, m, t_of(ts, LoraTarget::kDown), scratch);
    return Status::ok();
  }
  void* d_part = d.seq_parallel ? partial : out;
  project(ops, d, down, m, d_part, t_of(ts, LoraTarget::kDown), scratch);
  if (d.split()) {
    STRATA_RETURN_IF_ERROR(sum_partial(d, d_part, out, H, "down_proj output"));
    if (w.bd != nullptr) ops.add_bias(out, w.bd, Rl, H, dt);
  }
  ops.add(out, hmid, out, Rl * H, dt);
  return Status::ok();
}

}  // namespace

// x [R, H] -> out [R, H]:
//   a = rmsnorm(x) ; q, k, v = a Wq^T + bq, a Wk^T + bk, a Wv^T + bv (biases where the family has
//   them) ; q, k = rmsnorm per head (Qwen3) ; rope(q, k) ; att = attention(q, k, v, window)
//   hmid = x + att Wo^T (+ bo) ; b = rmsnorm(hmid) ; m = silu(b Wg^T) * (b Wu^T) ;
//   out = hmid + m Wd^T (MLP biases under mlp_bias); each projection plus its adapter's
//   scaling * dropout(input) A^T B^T where it has one.
Status block_forward(const device::Ops& ops, const Dims& d, const BlockWeights& w,
                     const BlockActs& s, void* out) {
  const DType dt = d.dtype;
  const std::int64_t R = d.rows, H = d.hidden;
  ops.rmsnorm_forward(s.x, w.ln1, s.a_local != nullptr ? s.a_local : row_slot(d, s.a, H), s.rstd1,
                      d.local_rows, H, d.eps, dt);
  STRATA_RETURN_IF_ERROR(gather_rows(d, s.a, H, "input_layernorm output", s.a_local));
  project(ops, d, proj(d, w, LoraTarget::kQ), s.a, d.qk_norm ? s.q_pre : s.q,
          t_of(s.lora_t, LoraTarget::kQ), s.lora_x);
  project(ops, d, proj(d, w, LoraTarget::kK), s.a, d.qk_norm ? s.k_pre : s.k,
          t_of(s.lora_t, LoraTarget::kK), s.lora_x);
  project(ops, d, proj(d, w, LoraTarget::kV), s.a, s.v, t_of(s.lora_t, LoraTarget::kV), s.lora_x);
  if (d.qk_norm) {
    ops.rmsnorm_forward(s.q_pre, w.qn, s.q, s.rstd_q, R * d.heads, d.head_dim, d.eps, dt);
    ops.rmsnorm_forward(s.k_pre, w.kn, s.k, s.rstd_k, R * d.kv_heads, d.head_dim, d.eps, dt);
  }
  ops.rope(s.q, d.batch, d.seq, d.heads, d.head_dim, d.rope, false, dt);
  ops.rope(s.k, d.batch, d.seq, d.kv_heads, d.head_dim, d.rope, false, dt);
  ops.attention_forward(s.q, s.k, s.v, s.att, s.lse, d.attention(), dt);
  return block_tail(ops, d, w, s.x, s.att, s.hmid, s.rstd2, s.b, s.gate, s.up, s.m, s.lora_t,
                    s.lora_x, s.partial, s.b_local, out);
}

Status block_decode(const device::Ops& ops, const Dims& d, const BlockWeights& w,
                    const DecodeActs& s, void* k_cache, void* v_cache, std::int64_t past,
                    void* out) {
  const DType dt = d.dtype;
  const std::int64_t R = d.rows, H = d.hidden, KV = d.kv_dim;
  STRATA_CHECK(d.lora_dropout == 0.0f, "decoding with adapter dropout", d.lora_dropout);
  void* k_new = offset_ptr(k_cache, past * KV, d.elem_bytes);
  void* v_new = offset_ptr(v_cache, past * KV, d.elem_bytes);
  // No backward: every adapter's t goes through the one scratch.
  void* const ts[kNumLoraTargets] = {s.lora_t, s.lora_t, s.lora_t, s.lora_t,
                                     s.lora_t, s.lora_t, s.lora_t};
  ops.rmsnorm_forward(s.x, w.ln1, s.a, s.rstd, R, H, d.eps, dt);
  project(ops, d, proj(d, w, LoraTarget::kQ), s.a, d.qk_norm ? s.q_pre : s.q, s.lora_t, nullptr);
  project(ops, d, proj(d, w, LoraTarget::kK), s.a, d.qk_norm ? s.k_pre : k_new, s.lora_t, nullptr);
  project(ops, d, proj(d, w, LoraTarget::kV), s.a, v_new, s.lora_t, nullptr);
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
  return block_tail(ops, d, w, s.x, s.att, s.hmid, s.rstd, s.b, s.gate, s.up, s.m, ts, nullptr,
                    nullptr, nullptr, out);
}

// dh [R, H]: dL/dout -> dL/dx. Weight gradients dW = dY^T X (+=), bias gradients db = sum of dY
// over rows (+=), input gradients dX = dY W; a frozen base (null gradients) skips its weight
// and bias products but not the input gradients, and each adapter adds its own.
Status block_backward(const device::Ops& ops, const Dims& d, const BlockWeights& w,
                      const BlockActs& s, const BlockGrads& g, const BackwardScratch& t) {
  const DType dt = d.dtype;
  const std::int64_t R = d.rows, H = d.hidden, F = d.ffn, Rl = d.local_rows;
  auto grad_of = [&](LoraTarget target) { return g.lora[static_cast<std::size_t>(target)]; };
  // Under sequence parallelism the row-parallel products' backward takes every row of dh, and
  // each column-parallel input gradient comes back as this rank's rows of its sum.
  void* const dh = d.seq_parallel ? t.dh_full : t.dh;
  void* const dx = d.seq_parallel ? t.dx_local : t.dx;
  auto back = [&](LoraTarget target, const void* x, void* gw, void* gb, const void* dy, void* dx,
                  bool accumulate) {
    project_backward(ops, d, proj(d, w, target), x, t_of(s.lora_t, target), gw, gb, grad_of(target),
                     dy, dx, accumulate, s.lora_x, t);
  };

  // MLP: out = hmid + m Wd^T (+ bd), m = silu(gate) * up.
  STRATA_RETURN_IF_ERROR(gather_rows(d, dh, H, "block output gradient"));
  back(LoraTarget::kDown, s.m, g.wd, g.bd, dh, t.dm, false);
  // In place: gate and up are read here for the last time (their gradients take their room).
  void* const dgate = s.gate;
  void* const dup = s.up;
  ops.swiglu_backward(t.dm, s.gate, s.up, dgate, dup, R * F, dt);
  // Kept apart, this layer's b is gathered again into the buffer the layers share.
  if (s.b_local != nullptr) {
    STRATA_RETURN_IF_ERROR(
        gather_rows(d, s.b, H, "post_attention_layernorm output again", s.b_local));
  }
  back(LoraTarget::kGate, s.b, g.wg, g.bg, dgate, t.dx, false);
  back(LoraTarget::kUp, s.b, g.wu, g.bu, dup, t.dx, true);
  // Column-parallel: each rank's input gradient is its part of the sum.
  STRATA_RETURN_IF_ERROR(sum_partial(d, t.dx, dx, H, "gate/up input gradient"));
  STRATA_RETURN_IF_ERROR(norm_backward(ops, d, dx, s.hmid, w.ln2, s.rstd2, t.dtmp, g.ln2, t.dln2,
                                       "post_attention_layernorm weight gradient"));
  ops.add(t.dh, t.dtmp, t.dh, Rl * H, dt);  // dh = dL/dhmid (residual + norm path)

  // Attention: hmid = x + att Wo^T (+ bo).
  STRATA_RETURN_IF_ERROR(gather_rows(d, dh, H, "attention output gradient"));
  back(LoraTarget::kO, s.att, g.wo, g.bo, dh, t.datt, false);
  ops.attention_backward(t.datt, s.q, s.k, s.v, s.att, s.lse, t.dq, t.dk, t.dv, d.attention(), dt);
  ops.rope(t.dq, d.batch, d.seq, d.heads, d.head_dim, d.rope, true, dt);
  ops.rope(t.dk, d.batch, d.seq, d.kv_heads, d.head_dim, d.rope, true, dt);
  const void* dq = t.dq;
  const void* dk = t.dk;
  if (d.qk_norm) {
    // Split, each rank's heads give part of the whole norm's weight gradient: summed over the
    // group in scratch (zeroed by the caller), then added.
    const auto norm_back = [&](const void* dy, const void* x, const void* wn, const float* rstd,
                               void* dx, void* gw, void* scratch, std::int64_t heads,
                               std::string_view what) -> Status {
      if (!d.split() || gw == nullptr) {
        ops.rmsnorm_backward(dy, x, wn, rstd, dx, gw, R * heads, d.head_dim, dt);
        return Status::ok();
      }
      ops.rmsnorm_backward(dy, x, wn, rstd, dx, scratch, R * heads, d.head_dim, dt);
      STRATA_RETURN_IF_ERROR(tp_sum(d, scratch, d.head_dim, what));
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
    STRATA_RETURN_IF_ERROR(gather_rows(d, s.a, H, "input_layernorm output again", s.a_local));
  }
  back(LoraTarget::kQ, s.a, g.wq, g.bq, dq, t.dx, false);
  if (d.kv_replicas == 1) {
    back(LoraTarget::kK, s.a, g.wk, g.bk, dk, t.dx, true);
    back(LoraTarget::kV, s.a, g.wv, g.bv, t.dv, t.dx, true);
  } else {
    // The kv head is whole on several ranks, each with the gradient of its own q heads: the
    // weight and bias gradients are summed over them (the input gradient over every rank,
    // below), each in scratch before it is added.
    back(LoraTarget::kK, s.a, nullptr, nullptr, dk, t.dx, true);
    back(LoraTarget::kV, s.a, nullptr, nullptr, t.dv, t.dx, true);
    const std::int64_t KV = d.kv_dim;
    const auto replica_grads = [&](const void* dy, void* gw, void* gb, void* db,
                                   std::string_view what) -> Status {
      if (gw != nullptr) {
        matmul(ops, dt, true, false, KV, H, R, dy, s.a, t.kv_dw, false);
        STRATA_RETURN_IF_ERROR(d.tp->kv_replica_sum(t.kv_dw, KV * H, dt, what));
        ops.add(gw, t.kv_dw, gw, KV * H, dt);
      }
      if (gb != nullptr) {
        ops.bias_grad(dy, db, R, KV, dt);
        STRATA_RETURN_IF_ERROR(d.tp->kv_replica_sum(db, KV, dt, what));
        ops.add(gb, db, gb, KV, dt);
      }
      return Status::ok();
    };
    STRATA_RETURN_IF_ERROR(replica_grads(dk, g.wk, g.bk, t.kdb, "k_proj gradient"));
    STRATA_RETURN_IF_ERROR(replica_grads(t.dv, g.wv, g.bv, t.vdb, "v_proj gradient"));
  }
  STRATA_RETURN_IF_ERROR(sum_partial(d, t.dx, dx, H, "q/k/v input gradient"));
  STRATA_RETURN_IF_ERROR(norm_backward(ops, d, dx, s.x, w.ln1, s.rstd1, t.dtmp, g.ln1, t.dln1,
                                       "input_layernorm weight gradient"));
  ops.add(t.dh, t.dtmp, t.dh, Rl * H, dt);  // dh = dL/dx
  return Status::ok();
}

}  // namespace strata::model::detail
