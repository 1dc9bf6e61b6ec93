// One LLaMA decoder block (HF LlamaDecoderLayer): forward and hand-written backward.
#include "src/model/llama_block.h"

namespace strata::model::detail {

Dims Dims::make(const LlamaConfig& c, DType dtype, std::int64_t batch, std::int64_t seq) {
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
  return d;
}

void matmul(const device::Ops& ops, DType dtype, bool trans_a, bool trans_b, std::int64_t m,
            std::int64_t n, std::int64_t k, const void* a, const void* b, void* c,
            bool accumulate) {
  device::GemmArgs g;
  g.trans_a = trans_a;
  g.trans_b = trans_b;
  g.m = m;
  g.n = n;
  g.k = k;
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

// y[R, n] = x W^T (+ b).
void linear(const device::Ops& ops, DType dt, std::int64_t rows, std::int64_t out, std::int64_t in,
            const void* x, const void* w, const void* b, void* y) {
  matmul(ops, dt, false, true, rows, out, in, x, w, y, false);
  if (b != nullptr) ops.add_bias(y, b, rows, out, dt);
}

// The block after attention, shared by training and decoding: hmid = x + att Wo^T (+ bo) ;
// b = rmsnorm(hmid) (statistics into rstd) ; m = silu(b Wg^T) * (b Wu^T) ; then, unless out is
// null, out = hmid + m Wd^T.
void block_tail(const device::Ops& ops, const Dims& d, const BlockWeights& w, const void* x,
                const void* att, void* hmid, float* rstd, void* b, void* gate, void* up, void* m,
                void* out) {
  const DType dt = d.dtype;
  const std::int64_t R = d.rows, H = d.hidden, Q = d.q_dim, F = d.ffn;
  linear(ops, dt, R, H, Q, att, w.wo, w.bo, hmid);
  ops.add(hmid, x, hmid, R * H, dt);
  ops.rmsnorm_forward(hmid, w.ln2, b, rstd, R, H, d.eps, dt);
  linear(ops, dt, R, F, H, b, w.wg, w.bg, gate);
  linear(ops, dt, R, F, H, b, w.wu, w.bu, up);
  ops.swiglu_forward(gate, up, m, R * F, dt);
  if (out == nullptr) return;
  linear(ops, dt, R, H, F, m, w.wd, w.bd, out);
  ops.add(out, hmid, out, R * H, dt);
}

}  // namespace

// x [R, H] -> out [R, H]:
//   a = rmsnorm(x) ; q, k, v = a Wq^T + bq, a Wk^T + bk, a Wv^T + bv (biases where the family has
//   them) ; q, k = rmsnorm per head (Qwen3) ; rope(q, k) ; att = attention(q, k, v, window)
//   hmid = x + att Wo^T (+ bo) ; b = rmsnorm(hmid) ; m = silu(b Wg^T) * (b Wu^T) ;
//   out = hmid + m Wd^T (MLP biases under mlp_bias)
void block_forward(const device::Ops& ops, const Dims& d, const BlockWeights& w, const BlockActs& s,
                   void* out) {
  const DType dt = d.dtype;
  const std::int64_t R = d.rows, H = d.hidden, Q = d.q_dim, KV = d.kv_dim;
  ops.rmsnorm_forward(s.x, w.ln1, s.a, s.rstd1, R, H, d.eps, dt);
  linear(ops, dt, R, Q, H, s.a, w.wq, w.bq, d.qk_norm ? s.q_pre : s.q);
  linear(ops, dt, R, KV, H, s.a, w.wk, w.bk, d.qk_norm ? s.k_pre : s.k);
  linear(ops, dt, R, KV, H, s.a, w.wv, w.bv, s.v);
  if (d.qk_norm) {
    ops.rmsnorm_forward(s.q_pre, w.qn, s.q, s.rstd_q, R * d.heads, d.head_dim, d.eps, dt);
    ops.rmsnorm_forward(s.k_pre, w.kn, s.k, s.rstd_k, R * d.kv_heads, d.head_dim, d.eps, dt);
  }
  ops.rope(s.q, d.batch, d.seq, d.heads, d.head_dim, d.rope, false, dt);
  ops.rope(s.k, d.batch, d.seq, d.kv_heads, d.head_dim, d.rope, false, dt);
  ops.attention_forward(s.q, s.k, s.v, s.att, s.lse, d.attention(), dt);
  block_tail(ops, d, w, s.x, s.att, s.hmid, s.rstd2, s.b, s.gate, s.up, s.m, out);
}

void block_decode(const device::Ops& ops, const Dims& d, const BlockWeights& w, const DecodeActs& s,
                  void* k_cache, void* v_cache, std::int64_t past, void* out) {
  const DType dt = d.dtype;
  const std::int64_t R = d.rows, H = d.hidden, Q = d.q_dim, KV = d.kv_dim;
  void* k_new = offset_ptr(k_cache, past * KV, d.elem_bytes);
  void* v_new = offset_ptr(v_cache, past * KV, d.elem_bytes);
  ops.rmsnorm_forward(s.x, w.ln1, s.a, s.rstd, R, H, d.eps, dt);
  linear(ops, dt, R, Q, H, s.a, w.wq, w.bq, d.qk_norm ? s.q_pre : s.q);
  linear(ops, dt, R, KV, H, s.a, w.wk, w.bk, d.qk_norm ? s.k_pre : k_new);
  linear(ops, dt, R, KV, H, s.a, w.wv, w.bv, v_new);
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
  block_tail(ops, d, w, s.x, s.att, s.hmid, s.rstd, s.b, s.gate, s.up, s.m, out);
}

// dh [R, H]: dL/dout -> dL/dx. Weight gradients dW = dY^T X (+=), bias gradients db = sum of dY
// over rows (+=), input gradients dX = dY W.
void block_backward(const device::Ops& ops, const Dims& d, const BlockWeights& w,
                    const BlockActs& s, const BlockGrads& g, const BackwardScratch& t) {
  const DType dt = d.dtype;
  const std::int64_t R = d.rows, H = d.hidden, Q = d.q_dim, KV = d.kv_dim, F = d.ffn;
  auto bias_grad = [&](const void* dy, void* db, std::int64_t cols) {
    if (db != nullptr) ops.bias_grad(dy, db, R, cols, dt);
  };

  // MLP: out = hmid + m Wd^T (+ bd), m = silu(gate) * up.
  matmul(ops, dt, true, false, H, F, R, t.dh, s.m, g.wd, true);
  bias_grad(t.dh, g.bd, H);
  matmul(ops, dt, false, false, R, F, H, t.dh, w.wd, t.dm, false);
  ops.swiglu_backward(t.dm, s.gate, s.up, t.dgate, t.dup, R * F, dt);
  matmul(ops, dt, true, false, F, H, R, t.dgate, s.b, g.wg, true);
  matmul(ops, dt, true, false, F, H, R, t.dup, s.b, g.wu, true);
  bias_grad(t.dgate, g.bg, F);
  bias_grad(t.dup, g.bu, F);
  matmul(ops, dt, false, false, R, H, F, t.dgate, w.wg, t.dx, false);
  matmul(ops, dt, false, false, R, H, F, t.dup, w.wu, t.dx, true);
  ops.rmsnorm_backward(t.dx, s.hmid, w.ln2, s.rstd2, t.dtmp, g.ln2, R, H, dt);
  ops.add(t.dh, t.dtmp, t.dh, R * H, dt);  // dh = dL/dhmid (residual + norm path)

  // Attention: hmid = x + att Wo^T (+ bo).
  matmul(ops, dt, true, false, H, Q, R, t.dh, s.att, g.wo, true);
  bias_grad(t.dh, g.bo, H);
  matmul(ops, dt, false, false, R, Q, H, t.dh, w.wo, t.datt, false);
  ops.attention_backward(t.datt, s.q, s.k, s.v, s.att, s.lse, t.dq, t.dk, t.dv, d.attention(), dt);
  ops.rope(t.dq, d.batch, d.seq, d.heads, d.head_dim, d.rope, true, dt);
  ops.rope(t.dk, d.batch, d.seq, d.kv_heads, d.head_dim, d.rope, true, dt);
  const void* dq = t.dq;
  const void* dk = t.dk;
  if (d.qk_norm) {
    ops.rmsnorm_backward(t.dq, s.q_pre, w.qn, s.rstd_q, t.dq_pre, g.qn, R * d.heads, d.head_dim,
                         dt);
    ops.rmsnorm_backward(t.dk, s.k_pre, w.kn, s.rstd_k, t.dk_pre, g.kn, R * d.kv_heads, d.head_dim,
                         dt);
    dq = t.dq_pre;
    dk = t.dk_pre;
  }
  matmul(ops, dt, true, false, Q, H, R, dq, s.a, g.wq, true);
  matmul(ops, dt, true, false, KV, H, R, dk, s.a, g.wk, true);
  matmul(ops, dt, true, false, KV, H, R, t.dv, s.a, g.wv, true);
  bias_grad(dq, g.bq, Q);
  bias_grad(dk, g.bk, KV);
  bias_grad(t.dv, g.bv, KV);
  matmul(ops, dt, false, false, R, H, Q, dq, w.wq, t.dx, false);
  matmul(ops, dt, false, false, R, H, KV, dk, w.wk, t.dx, true);
  matmul(ops, dt, false, false, R, H, KV, t.dv, w.wv, t.dx, true);
  ops.rmsnorm_backward(t.dx, s.x, w.ln1, s.rstd1, t.dtmp, g.ln1, R, H, dt);
  ops.add(t.dh, t.dtmp, t.dh, R * H, dt);  // dh = dL/dx
}

}  // namespace strata::model::detail
