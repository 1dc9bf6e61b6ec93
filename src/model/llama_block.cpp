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
  d.kv_dim = d.kv_heads * d.head_dim;
  d.ffn = c.intermediate_size;
  d.vocab = c.vocab_size;
  d.eps = static_cast<float>(c.rms_norm_eps);
  d.theta = static_cast<float>(c.rope_theta);
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

// x [R, H] -> out [R, H]:
//   a = rmsnorm(x) ; q, k, v = a Wq^T, a Wk^T, a Wv^T ; rope(q, k) ; att = attention(q, k, v)
//   hmid = x + att Wo^T ; b = rmsnorm(hmid) ; m = silu(b Wg^T) * (b Wu^T) ; out = hmid + m Wd^T
void block_forward(const device::Ops& ops, const Dims& d, const BlockWeights& w, const BlockActs& s,
                   void* out) {
  const DType dt = d.dtype;
  const std::int64_t R = d.rows, H = d.hidden, KV = d.kv_dim, F = d.ffn;
  ops.rmsnorm_forward(s.x, w.ln1, s.a, s.rstd1, R, H, d.eps, dt);
  matmul(ops, dt, false, true, R, H, H, s.a, w.wq, s.q, false);
  matmul(ops, dt, false, true, R, KV, H, s.a, w.wk, s.k, false);
  matmul(ops, dt, false, true, R, KV, H, s.a, w.wv, s.v, false);
  ops.rope(s.q, d.batch, d.seq, d.heads, d.head_dim, d.theta, false, dt);
  ops.rope(s.k, d.batch, d.seq, d.kv_heads, d.head_dim, d.theta, false, dt);
  ops.attention_forward(s.q, s.k, s.v, s.att, s.lse, d.attention(), dt);
  matmul(ops, dt, false, true, R, H, H, s.att, w.wo, s.hmid, false);
  ops.add(s.hmid, s.x, s.hmid, R * H, dt);
  ops.rmsnorm_forward(s.hmid, w.ln2, s.b, s.rstd2, R, H, d.eps, dt);
  matmul(ops, dt, false, true, R, F, H, s.b, w.wg, s.gate, false);
  matmul(ops, dt, false, true, R, F, H, s.b, w.wu, s.up, false);
  ops.swiglu_forward(s.gate, s.up, s.m, R * F, dt);
  if (out == nullptr) return;
  matmul(ops, dt, false, true, R, H, F, s.m, w.wd, out, false);
  ops.add(out, s.hmid, out, R * H, dt);
}

// dh [R, H]: dL/dout -> dL/dx. Weight gradients dW = dY^T X (+=), input gradients dX = dY W.
void block_backward(const device::Ops& ops, const Dims& d, const BlockWeights& w,
                    const BlockActs& s, const BlockGrads& g, const BackwardScratch& t) {
  const DType dt = d.dtype;
  const std::int64_t R = d.rows, H = d.hidden, KV = d.kv_dim, F = d.ffn;

  // MLP: out = hmid + m Wd^T, m = silu(gate) * up.
  matmul(ops, dt, true, false, H, F, R, t.dh, s.m, g.wd, true);
  matmul(ops, dt, false, false, R, F, H, t.dh, w.wd, t.dm, false);
  ops.swiglu_backward(t.dm, s.gate, s.up, t.dgate, t.dup, R * F, dt);
  matmul(ops, dt, true, false, F, H, R, t.dgate, s.b, g.wg, true);
  matmul(ops, dt, true, false, F, H, R, t.dup, s.b, g.wu, true);
  matmul(ops, dt, false, false, R, H, F, t.dgate, w.wg, t.dx, false);
  matmul(ops, dt, false, false, R, H, F, t.dup, w.wu, t.dx, true);
  ops.rmsnorm_backward(t.dx, s.hmid, w.ln2, s.rstd2, t.dtmp, g.ln2, R, H, dt);
  ops.add(t.dh, t.dtmp, t.dh, R * H, dt);  // dh = dL/dhmid (residual + norm path)

  // Attention: hmid = x + att Wo^T.
  matmul(ops, dt, true, false, H, H, R, t.dh, s.att, g.wo, true);
  matmul(ops, dt, false, false, R, H, H, t.dh, w.wo, t.datt, false);
  ops.attention_backward(t.datt, s.q, s.k, s.v, s.att, s.lse, t.dq, t.dk, t.dv, d.attention(), dt);
  ops.rope(t.dq, d.batch, d.seq, d.heads, d.head_dim, d.theta, true, dt);
  ops.rope(t.dk, d.batch, d.seq, d.kv_heads, d.head_dim, d.theta, true, dt);
  matmul(ops, dt, true, false, H, H, R, t.dq, s.a, g.wq, true);
  matmul(ops, dt, true, false, KV, H, R, t.dk, s.a, g.wk, true);
  matmul(ops, dt, true, false, KV, H, R, t.dv, s.a, g.wv, true);
  matmul(ops, dt, false, false, R, H, H, t.dq, w.wq, t.dx, false);
  matmul(ops, dt, false, false, R, H, KV, t.dk, w.wk, t.dx, true);
  matmul(ops, dt, false, false, R, H, KV, t.dv, w.wv, t.dx, true);
  ops.rmsnorm_backward(t.dx, s.x, w.ln1, s.rstd1, t.dtmp, g.ln1, R, H, dt);
  ops.add(t.dh, t.dtmp, t.dh, R * H, dt);  // dh = dL/dx
}

}  // namespace strata::model::detail
