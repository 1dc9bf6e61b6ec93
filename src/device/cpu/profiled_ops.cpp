// The op-profiling decorator (strata/device/op_profile.h): forwards every op to the CPU
// backend's table and adds its wall time, FLOPs and bytes to a process-wide tally.
#include <algorithm>
#include <chrono>
#include <map>
#include <mutex>

#include "src/device/cpu/cpu_ops_internal.h"
#include "strata/device/op_profile.h"

namespace strata::device {
namespace {

struct Tally {
  std::mutex mu;
  std::map<std::string, OpTime> ops;
};
Tally& tally() {
  static Tally t;
  return t;
}

double sz(DType d) { return static_cast<double>(dtype_size(d)); }

// Times one forwarded call and tallies it under `op`.
class Timed {
 public:
  Timed(const char* op, double flops, double bytes) : op_(op), flops_(flops), bytes_(bytes) {}
  ~Timed() {
    const double s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    Tally& t = tally();
    std::lock_guard lock(t.mu);
    OpTime& o = t.ops[op_];
    o.op = op_;
    ++o.calls;
    o.seconds += s;
    o.flops += flops_;
    o.bytes += bytes_;
  }
  Timed(const Timed&) = delete;
  Timed& operator=(const Timed&) = delete;

 private:
  const char* op_;
  double flops_, bytes_;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
};

double attention_products(const AttentionShape& s) {
  // QK^T and PV: 2 x (2 b h s s d), halved when causal (every shape here is).
  const double b = static_cast<double>(s.batch), h = static_cast<double>(s.heads),
               n = static_cast<double>(s.seq), d = static_cast<double>(s.head_dim);
  return 2.0 * b * h * n * n * d;
}
double attention_bytes(const AttentionShape& s, DType dt, int q_like, int kv_like) {
  const double b = static_cast<double>(s.batch), n = static_cast<double>(s.seq),
               d = static_cast<double>(s.head_dim);
  return (q_like * static_cast<double>(s.heads) + kv_like * static_cast<double>(s.kv_heads)) * b *
         n * d * sz(dt);
}

class ProfiledOps final : public Ops {
 public:
  explicit ProfiledOps(std::unique_ptr<Ops> inner) : inner_(std::move(inner)) {}

  void gemm(const GemmArgs& g) const override {
    const double m = static_cast<double>(g.m), n = static_cast<double>(g.n),
                 k = static_cast<double>(g.k);
    Timed t("gemm", 2 * m * n * k, (m * k + k * n + m * n * (g.beta != 0 ? 2 : 1)) * sz(g.dtype));
    inner_->gemm(g);
  }
  void embedding_forward(const std::int32_t* ids, std::int64_t rows, const void* table,
                         std::int64_t dim, void* out, DType dtype) const override {
    Timed t("embedding_forward", 0, 2.0 * static_cast<double>(rows * dim) * sz(dtype));
    inner_->embedding_forward(ids, rows, table, dim, out, dtype);
  }
  void embedding_backward(const std::int32_t* ids, std::int64_t rows, const void* dout,
                          std::int64_t dim, void* dtable, DType dtype) const override {
    Timed t("embedding_backward", 0, 3.0 * static_cast<double>(rows * dim) * sz(dtype));
    inner_->embedding_backward(ids, rows, dout, dim, dtable, dtype);
  }
  void rmsnorm_forward(const void* x, const void* w, void* out, float* rstd, std::int64_t rows,
                       std::int64_t dim, float eps, DType dtype) const override {
    Timed t("rmsnorm_forward", 0, 2.0 * static_cast<double>(rows * dim) * sz(dtype));
    inner_->rmsnorm_forward(x, w, out, rstd, rows, dim, eps, dtype);
  }
  void rmsnorm_backward(const void* dout, const void* x, const void* w, const float* rstd, void* dx,
                        void* dw, std::int64_t rows, std::int64_t dim, DType dtype) const override {
    Timed t("rmsnorm_backward", 0, 3.0 * static_cast<double>(rows * dim) * sz(dtype));
    inner_->rmsnorm_backward(dout, x, w, rstd, dx, dw, rows, dim, dtype);
  }
  void rope(void* x, std::int64_t batch, std::int64_t seq, std::int64_t heads,
            std::int64_t head_dim, const RopeParams& rope, bool inverse,
            DType dtype) const override {
    Timed t("rope", 0, 2.0 * static_cast<double>(batch * seq * heads * head_dim) * sz(dtype));
    inner_->rope(x, batch, seq, heads, head_dim, rope, inverse, dtype);
  }
  void attention_forward(const void* q, const void* k, const void* v, void* out, float* lse,
                         const AttentionShape& shape, DType dtype) const override {
    Timed t("attention_forward", attention_products(shape), attention_bytes(shape, dtype, 2, 2));
    inner_->attention_forward(q, k, v, out, lse, shape, dtype);
  }
  void attention_backward(const void* dout, const void* q, const void* k, const void* v,
                          const void* out, const float* lse, void* dq, void* dk, void* dv,
                          const AttentionShape& shape, DType dtype) const override {
    Timed t("attention_backward", 2.5 * attention_products(shape),
            attention_bytes(shape, dtype, 4, 4));
    inner_->attention_backward(dout, q, k, v, out, lse, dq, dk, dv, shape, dtype);
  }
  void attention_decode(const void* q, const void* k_cache, const void* v_cache, void* out,
                        const DecodeAttentionShape& shape, DType dtype) const override {
    Timed t("attention_decode", 0, 0);
    inner_->attention_decode(q, k_cache, v_cache, out, shape, dtype);
  }
  void swiglu_forward(const void* gate, const void* up, void* out, std::int64_t n,
                      DType dtype) const override {
    Timed t("swiglu_forward", 0, 3.0 * static_cast<double>(n) * sz(dtype));
    inner_->swiglu_forward(gate, up, out, n, dtype);
  }
  void swiglu_backward(const void* dout, const void* gate, const void* up, void* dgate, void* dup,
                       std::int64_t n, DType dtype) const override {
    Timed t("swiglu_backward", 0, 5.0 * static_cast<double>(n) * sz(dtype));
    inner_->swiglu_backward(dout, gate, up, dgate, dup, n, dtype);
  }
  void sum_blocks(const void* in, std::int64_t blocks, std::int64_t n, DType in_dtype, void* out,
                  DType out_dtype) const override {
    Timed t("sum_blocks", 0,
            static_cast<double>(n) * (static_cast<double>(blocks) * sz(in_dtype) + sz(out_dtype)));
    inner_->sum_blocks(in, blocks, n, in_dtype, out, out_dtype);
  }
  void add(const void* a, const void* b, void* out, std::int64_t n, DType dtype) const override {
    Timed t("add", 0, 3.0 * static_cast<double>(n) * sz(dtype));
    inner_->add(a, b, out, n, dtype);
  }
  void add_bias(void* x, const void* bias, std::int64_t rows, std::int64_t cols,
                DType dtype) const override {
    Timed t("add_bias", 0, 2.0 * static_cast<double>(rows * cols) * sz(dtype));
    inner_->add_bias(x, bias, rows, cols, dtype);
  }
  void bias_grad(const void* dy, void* dbias, std::int64_t rows, std::int64_t cols,
                 DType dtype) const override {
    Timed t("bias_grad", 0, static_cast<double>(rows * cols) * sz(dtype));
    inner_->bias_grad(dy, dbias, rows, cols, dtype);
  }
  void cross_entropy(const void* logits, const std::int32_t* targets, float* losses, void* dlogits,
                     std::int64_t rows, std::int64_t vocab, float dloss_scale,
                     DType dtype) const override {
    Timed t("cross_entropy", 0,
            (dlogits != nullptr ? 2.0 : 1.0) * static_cast<double>(rows * vocab) * sz(dtype));
    inner_->cross_entropy(logits, targets, losses, dlogits, rows, vocab, dloss_scale, dtype);
  }
  void cross_entropy_stats(const void* logits, const std::int32_t* targets, std::int64_t rows,
                           std::int64_t vocab, std::int64_t vocab_begin, float* stats,
                           DType dtype) const override {
    Timed t("cross_entropy_stats", 0, static_cast<double>(rows * vocab) * sz(dtype));
    inner_->cross_entropy_stats(logits, targets, rows, vocab, vocab_begin, stats, dtype);
  }
  void cross_entropy_grad(const void* logits, const std::int32_t* targets, std::int64_t rows,
                          std::int64_t vocab, std::int64_t vocab_begin, const float* row_max,
                          const float* row_sum, void* dlogits, float dloss_scale,
                          DType dtype) const override {
    Timed t("cross_entropy_grad", 0, 2.0 * static_cast<double>(rows * vocab) * sz(dtype));
    inner_->cross_entropy_grad(logits, targets, rows, vocab, vocab_begin, row_max, row_sum, dlogits,
                               dloss_scale, dtype);
  }
  void cast(const void* src, DType src_dtype, void* dst, DType dst_dtype,
            std::int64_t n) const override {
    Timed t("cast", 0, static_cast<double>(n) * (sz(src_dtype) + sz(dst_dtype)));
    inner_->cast(src, src_dtype, dst, dst_dtype, n);
  }
  void dropout(const void* x, void* out, const DropoutBlock& block, float p, std::uint64_t key,
               DType dtype) const override {
    Timed t("dropout", 0, 2.0 * static_cast<double>(block.size()) * sz(dtype));
    inner_->dropout(x, out, block, p, key, dtype);
  }
  void moe_route(const float* logits, std::int64_t tokens, std::int64_t experts, std::int64_t k,
                 bool normalize, float* probs, std::int32_t* chosen,
                 float* weights) const override {
    Timed t("moe_route", 0, 8.0 * static_cast<double>(tokens * (experts + k)));
    inner_->moe_route(logits, tokens, experts, k, normalize, probs, chosen, weights);
  }
  void moe_route_backward(const float* probs, const std::int32_t* chosen, const float* dweights,
                          const float* aux_grad, std::int64_t tokens, std::int64_t experts,
                          std::int64_t k, bool normalize, float* dlogits) const override {
    Timed t("moe_route_backward", 0, 8.0 * static_cast<double>(tokens * (experts + k)));
    inner_->moe_route_backward(probs, chosen, dweights, aux_grad, tokens, experts, k, normalize,
                               dlogits);
  }
  void scale_rows(void* x, const float* scale, std::int64_t rows, std::int64_t cols,
                  DType dtype) const override {
    Timed t("scale_rows", 0, 2.0 * static_cast<double>(rows * cols) * sz(dtype));
    inner_->scale_rows(x, scale, rows, cols, dtype);
  }
  void row_dots(const void* a, const void* b, std::int64_t rows, std::int64_t cols,
                const std::int32_t* index, float* out, DType dtype) const override {
    Timed t("row_dots", 2.0 * static_cast<double>(rows * cols),
            2.0 * static_cast<double>(rows * cols) * sz(dtype));
    inner_->row_dots(a, b, rows, cols, index, out, dtype);
  }
  void dequantize_nf4(const void* packed, std::int64_t n, void* out, DType dtype) const override {
    Timed t("dequantize_nf4", 0, static_cast<double>(n) * (0.52 + sz(dtype)));
    inner_->dequantize_nf4(packed, n, out, dtype);
  }
  void sum_squares(const void* x, std::int64_t n, DType dtype, ExactSum* result) const override {
    Timed t("sum_squares", 0, static_cast<double>(n) * sz(dtype));
    inner_->sum_squares(x, n, dtype, result);
  }
  void adamw(const AdamWArgs& a) const override {
    Timed t("adamw", 0, static_cast<double>(a.n) * 16.0);
    inner_->adamw(a);
  }

 private:
  std::unique_ptr<Ops> inner_;
};

}  // namespace

std::vector<OpTime> op_profile() {
  Tally& t = tally();
  std::lock_guard lock(t.mu);
  std::vector<OpTime> out;
  for (const auto& [name, o] : t.ops) out.push_back(o);
  std::sort(out.begin(), out.end(),
            [](const OpTime& a, const OpTime& b) { return a.seconds > b.seconds; });
  return out;
}

void reset_op_profile() {
  Tally& t = tally();
  std::lock_guard lock(t.mu);
  t.ops.clear();
}

namespace cpu {
std::unique_ptr<Ops> profiled_ops(std::unique_ptr<Ops> inner) {
  return std::make_unique<ProfiledOps>(std::move(inner));
}
}  // namespace cpu

}  // namespace strata::device
