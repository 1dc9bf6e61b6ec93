// The CUDA op table: argument checks as on the CPU backend, then the kernels' host launchers
// (kernels/launchers.h) or cuBLASLt, all on the compute stream; failures become the device's
// sticky error. Plain C++: no device code here.
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <string>

#include "src/device/cuda/cuda_device.h"
#include "src/device/cuda/cuda_gemm.h"
#include "strata/core/aligned.h"
#include "strata/device/adam8bit.h"
#include "strata/device/nf4.h"

namespace strata::device::cuda {
namespace {

static_assert(kernels::kAdam8BlockElems == kAdam8BlockElems,
              "the GPU's 8-bit blocks are the reference's");

kernels::Elem elem(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return kernels::Elem::kF32;
    case DType::kBF16:
      return kernels::Elem::kBF16;
    case DType::kF16:
      return kernels::Elem::kF16;
    default:
      break;
  }
  STRATA_CHECK(false, "CUDA ops support f32, bf16 and f16 storage, got", dtype_name(dtype));
  return kernels::Elem::kF32;
}

// The float ops take f32, bf16 or f16, like the CPU backend's.
kernels::Elem float_elem(DType dtype) { return elem(dtype); }

kernels::AttentionDims attention_dims(const AttentionShape& s) {
  STRATA_CHECK(
      s.batch >= 0 && s.seq >= 0 && s.head_dim > 0 && s.kv_heads > 0 && s.heads % s.kv_heads == 0,
      "bad attention shape", s.batch, s.seq, s.heads, s.kv_heads, s.head_dim);
  kernels::AttentionDims d;
  d.batch = s.batch;
  d.seq = s.seq;
  d.heads = s.heads;
  d.kv_heads = s.kv_heads;
  d.head_dim = s.head_dim;
  d.window = s.window;
  return d;
}

constexpr std::size_t kMiB = std::size_t{1} << 20;

class CudaOps final : public Ops {
 public:
  CudaOps(CudaDevice& dev, const CudaTuning& tuning) : dev_(dev), tuning_(tuning) {}

  Status init(bool allow_tf32, std::uint64_t limit_bytes) {
    std::size_t ws = tuning_.gemm_workspace_bytes;
    if (ws == 0) ws = std::min<std::size_t>(32 * kMiB, limit_bytes / 16);
    ws = ws / 256 * 256;
    if (ws > 0) {
      STRATA_ASSIGN_OR_RETURN(workspace_, dev_.allocate(ws, "cuBLAS workspace"));
    }
    STRATA_ASSIGN_OR_RETURN(gemm_, CudaGemm::create(workspace_.data(), ws, allow_tf32));
    return Status::ok();
  }

  void gemm(const GemmArgs& g) const override {
    check_gemm_args(g, "gemm (CUDA):");
    const kernels::Elem e = float_elem(g.dtype);
    if (g.m == 0 || g.n == 0) return;
    if (g.k == 0) {
      done(kernels::scale_matrix(ctx(), g.c, g.m, g.n, g.ldc, g.beta, e), "gemm (k = 0)");
      return;
    }
    dev_.bind();
    dev_.errors().record(gemm_->run(g, dev_.compute_stream()));
    sync_if_asked("gemm");
  }

  void embedding_forward(const std::int32_t* ids, std::int64_t rows, const void* table,
                         std::int64_t dim, void* out, DType dtype) const override {
    done(kernels::embedding_forward(ctx(), ids, rows, table, dim, out, float_elem(dtype)),
         "embedding_forward");
  }
  void embedding_backward(const std::int32_t* ids, std::int64_t rows, const void* dout,
                          std::int64_t dim, void* dtable, DType dtype) const override {
    const kernels::Elem e = float_elem(dtype);
    if (rows <= 0) return;
    void* s = scratch(kernels::embedding_backward_scratch_bytes(rows));
    if (s == nullptr) return;
    done(kernels::embedding_backward(ctx(), ids, rows, dout, dim, dtable, e, s),
         "embedding_backward");
  }

  void rmsnorm_forward(const void* x, const void* w, void* out, float* rstd, std::int64_t rows,
                       std::int64_t dim, float eps, DType dtype) const override {
    done(kernels::rmsnorm_forward(ctx(), x, w, out, rstd, rows, dim, eps, float_elem(dtype)),
         "rmsnorm_forward");
  }
  void rmsnorm_backward(const void* dout, const void* x, const void* w, const float* rstd, void* dx,
                        void* dw, std::int64_t rows, std::int64_t dim, DType dtype) const override {
    STRATA_CHECK(static_cast<std::size_t>(dim) * sizeof(float) <= ctx().max_smem_optin_bytes,
                 "rmsnorm_backward keeps a row of dw partials in shared memory; dim too large", dim,
                 ctx().max_smem_optin_bytes);
    void* s = scratch(kernels::rmsnorm_backward_scratch_bytes(rows, dim));
    if (s == nullptr) return;
    done(
        kernels::rmsnorm_backward(ctx(), dout, x, w, rstd, dx, dw, rows, dim, float_elem(dtype), s),
        "rmsnorm_backward");
  }

  void rope(void* x, std::int64_t batch, std::int64_t seq, std::int64_t heads,
            std::int64_t head_dim, const RopeParams& rope, bool inverse,
            DType dtype) const override {
    STRATA_CHECK(head_dim % 2 == 0, "rope needs an even head_dim", head_dim);
    void* s = scratch(kernels::rope_scratch_bytes(seq, head_dim));
    if (s == nullptr) return;
    done(kernels::rope(ctx(), x, batch, seq, heads, head_dim, rope, inverse, float_elem(dtype), s),
         "rope");
  }

  void attention_forward(const void* q, const void* k, const void* v, void* out, float* lse,
                         const AttentionShape& shape, DType dtype) const override {
    const kernels::AttentionDims d = attention_dims(shape);
    const kernels::Elem e = float_elem(dtype);
    done(kernels::attention_forward(ctx(), q, k, v, out, lse, d, e,
                                    attention_kernel(d, e, false, {q, k, v, out})),
         "attention_forward");
  }
  void attention_backward(const void* dout, const void* q, const void* k, const void* v,
                          const void* out, const float* lse, void* dq, void* dk, void* dv,
                          const AttentionShape& shape, DType dtype) const override {
    const kernels::AttentionDims d = attention_dims(shape);
    if (d.seq == 0 || d.batch == 0) return;
    void* s = scratch(kernels::attention_backward_scratch_bytes(d));
    if (s == nullptr) return;
    const kernels::Elem e = float_elem(dtype);
    done(kernels::attention_backward(ctx(), dout, q, k, v, out, lse, dq, dk, dv, d, e,
                                     attention_kernel(d, e, true, {dout, q, k, v, dq, dk, dv}), s),
         "attention_backward");
  }

  void attention_decode(const void* q, const void* k_cache, const void* v_cache, void* out,
                        const DecodeAttentionShape& shape, DType dtype) const override {
    kernels::AttentionDims d;
    d.heads = shape.heads;
    d.kv_heads = shape.kv_heads;
    d.head_dim = shape.head_dim;
    d.window = shape.window;
    done(kernels::attention_decode(ctx(), q, k_cache, v_cache, out, shape.queries, shape.past, d,
                                   float_elem(dtype)),
         "attention_decode");
  }

  void swiglu_forward(const void* gate, const void* up, void* out, std::int64_t n,
                      DType dtype) const override {
    done(kernels::swiglu_forward(ctx(), gate, up, out, n, float_elem(dtype)), "swiglu_forward");
  }
  void swiglu_backward(const void* dout, const void* gate, const void* up, void* dgate, void* dup,
                       std::int64_t n, DType dtype) const override {
    done(kernels::swiglu_backward(ctx(), dout, gate, up, dgate, dup, n, float_elem(dtype)),
         "swiglu_backward");
  }

  void sum_blocks(const void* in, std::int64_t blocks, std::int64_t n, DType in_dtype, void* out,
                  DType out_dtype) const override {
    STRATA_CHECK(blocks >= 1 && n >= 0, "sum_blocks: bad shape", blocks, n);
    done(
        kernels::sum_blocks(ctx(), in, blocks, n, float_elem(in_dtype), out, float_elem(out_dtype)),
        "sum_blocks");
  }

  void add(const void* a, const void* b, void* out, std::int64_t n, DType dtype) const override {
    done(kernels::add(ctx(), a, b, out, n, float_elem(dtype)), "add");
  }

  void add_bias(void* x, const void* bias, std::int64_t rows, std::int64_t cols,
                DType dtype) const override {
    STRATA_CHECK(rows >= 0 && cols >= 0, "negative add_bias size", rows, cols);
    done(kernels::add_bias(ctx(), x, bias, rows, cols, float_elem(dtype)), "add_bias");
  }
  void bias_grad(const void* dy, void* dbias, std::int64_t rows, std::int64_t cols,
                 DType dtype) const override {
    STRATA_CHECK(rows >= 0 && cols >= 0, "negative bias_grad size", rows, cols);
    const kernels::Elem e = float_elem(dtype);
    if (rows == 0 || cols == 0) return;
    void* s = scratch(kernels::bias_grad_scratch_bytes(rows, cols));
    if (s == nullptr) return;
    done(kernels::bias_grad(ctx(), dy, dbias, rows, cols, e, s), "bias_grad");
  }

  void cross_entropy(const void* logits, const std::int32_t* targets, float* losses, void* dlogits,
                     std::int64_t rows, std::int64_t vocab, float dloss_scale,
                     DType dtype) const override {
    done(kernels::cross_entropy(ctx(), logits, targets, losses, dlogits, rows, vocab, dloss_scale,
                                float_elem(dtype)),
         "cross_entropy");
  }

  void cross_entropy_stats(const void* logits, const std::int32_t* targets, std::int64_t rows,
                           std::int64_t vocab, std::int64_t vocab_begin, float* stats,
                           DType dtype) const override {
    done(kernels::cross_entropy_stats(ctx(), logits, targets, rows, vocab, vocab_begin, stats,
                                      float_elem(dtype)),
         "cross_entropy_stats");
  }

  void cross_entropy_grad(const void* logits, const std::int32_t* targets, std::int64_t rows,
                          std::int64_t vocab, std::int64_t vocab_begin, const float* row_max,
                          const float* row_sum, void* dlogits, float dloss_scale,
                          DType dtype) const override {
    done(kernels::cross_entropy_grad(ctx(), logits, targets, rows, vocab, vocab_begin, row_max,
                                     row_sum, dlogits, dloss_scale, float_elem(dtype)),
         "cross_entropy_grad");
  }

  void dropout(const void* x, void* out, const DropoutBlock& block, float p, std::uint64_t key,
               DType dtype) const override {
    STRATA_CHECK(block.valid(), "a dropout block outside its matrix", block.rows, block.cols,
                 block.col_begin, block.full_cols);
    done(kernels::dropout(ctx(), x, out, block.rows, block.cols, block.full_cols, block.col_begin,
                          dropout_threshold(p), 1.0f / (1.0f - p), key, float_elem(dtype)),
         "dropout");
  }

  void moe_route(const float* logits, std::int64_t tokens, std::int64_t experts, std::int64_t k,
                 bool normalize, float* probs, std::int32_t* chosen,
                 float* weights) const override {
    STRATA_CHECK(k >= 1 && k <= experts, "moe_route picks 1 to experts experts", k, experts);
    done(kernels::moe_route(ctx(), logits, tokens, experts, k, normalize, probs, chosen, weights),
         "moe_route");
  }

  void moe_route_backward(const float* probs, const std::int32_t* chosen, const float* dweights,
                          const float* aux_grad, std::int64_t tokens, std::int64_t experts,
                          std::int64_t k, bool normalize, float* dlogits) const override {
    done(kernels::moe_route_backward(ctx(), probs, chosen, dweights, aux_grad, tokens, experts, k,
                                     normalize, dlogits),
         "moe_route_backward");
  }

  void scale_rows(void* x, const float* scale, std::int64_t rows, std::int64_t cols,
                  DType dtype) const override {
    done(kernels::scale_rows(ctx(), x, scale, rows, cols, float_elem(dtype)), "scale_rows");
  }

  void row_dots(const void* a, const void* b, std::int64_t rows, std::int64_t cols,
                const std::int32_t* index, float* out, DType dtype) const override {
    done(kernels::row_dots(ctx(), a, b, rows, cols, index, out, float_elem(dtype)), "row_dots");
  }

  void dequantize_nf4(const void* packed, std::int64_t n, void* out, DType dtype) const override {
    STRATA_CHECK(n >= 0, "negative NF4 size", n);
    const Nf4Layout l = nf4_layout(n);
    const kernels::Nf4Parts parts{n, l.codes, l.absmax, l.scales, l.mean};
    kernels::Nf4Tables tables{};
    std::memcpy(tables.levels, kNf4Levels.data(), sizeof tables.levels);
    std::memcpy(tables.absmax_code, nf4_absmax_code().data(), sizeof tables.absmax_code);
    done(kernels::dequantize_nf4(ctx(), packed, parts, tables, out, float_elem(dtype)),
         "dequantize_nf4");
  }

  void cast(const void* src, DType src_dtype, void* dst, DType dst_dtype,
            std::int64_t n) const override {
    if (n <= 0) return;
    if (src_dtype == dst_dtype) {
      if (src != dst) {
        dev_.errors().record(STRATA_CUDA_STATUS(
            cudaMemcpyAsync(dst, src, static_cast<std::size_t>(n) * dtype_size(src_dtype),
                            cudaMemcpyDeviceToDevice, dev_.compute_stream())));
      }
      return;
    }
    done(kernels::cast(ctx(), src, elem(src_dtype), dst, elem(dst_dtype), n), "cast");
  }

  // Asynchronous: the caller reads many results back at once. A failed launch is the device's
  // sticky error, which the caller checks after its read.
  void sum_squares(const void* x, std::int64_t n, DType dtype, ExactSum* result) const override {
    static_assert(sizeof(kernels::ExactSumLayout) == sizeof(ExactSum) &&
                  kernels::kExactSumLimbs == ExactSum::kLimbs &&
                  kernels::kExactSumLowBit == ExactSum::kLowBit &&
                  kernels::kExactSumHighBit == ExactSum::kHighBit &&
                  kernels::kSumSquaresChunk == static_cast<std::int64_t>(kSumSquaresChunkElems));
    done(kernels::sum_squares(ctx(), x, n, float_elem(dtype),
                              reinterpret_cast<kernels::ExactSumLayout*>(result)),
         "sum_squares");
  }

  void adamw(const AdamWArgs& a) const override {
    STRATA_CHECK(a.step >= 1, "adamw step is 1-based", a.step);
    check_adamw_args(a, "adamw (CUDA):");
    STRATA_CHECK(a.param_in == nullptr, "the CUDA adamw op updates in place only");
    const bool q8 = a.state_dtype == kAdam8StateDType;
    // The reference's scalars (adamw_reference.cpp), so both backends agree bit for bit.
    const kernels::AdamWScalars s = adamw_constants(a);
    const kernels::Elem out = a.param_out != nullptr ? elem(a.out_dtype) : kernels::Elem::kF32;
    kernels::MasterWeights w;
    w.param = a.param;
    if (a.master_dtype == DType::kBF16) {
      if (a.master_rounding == MasterRounding::kKahan) {
        w.form = kernels::MasterForm::kKahan;
        w.comp = static_cast<std::uint16_t*>(a.param_comp);
      } else {
        w.form = kernels::MasterForm::kStochastic;
        w.seed = a.rounding_seed;
        w.first = a.element_offset;
      }
    }
    if (q8) {
      done(kernels::adamw8(ctx(), w, a.grad, elem(a.grad_dtype),
                           static_cast<std::uint8_t*>(a.exp_avg), a.exp_avg_scale,
                           static_cast<std::uint8_t*>(a.exp_avg_sq), a.exp_avg_sq_scale, a.n, s,
                           adam8_tables(), a.param_out, out),
           "adamw (8-bit moments)");
      return;
    }
    done(kernels::adamw(ctx(), w, a.grad, elem(a.grad_dtype), a.exp_avg, a.exp_avg_sq,
                        elem(a.state_dtype), a.n, s, a.param_out, out),
         "adamw");
  }

 private:
  // The 8-bit moments' tables (device::adam8_search and the codes), as adamw8 takes them.
  static const kernels::Adam8Tables& adam8_tables() {
    static const kernels::Adam8Tables tables = [] {
      kernels::Adam8Tables t{};
      const Adam8Search& m = adam8_search(false);
      const Adam8Search& v = adam8_search(true);
      for (int j = 0; j < 256; ++j) {
        const auto u = static_cast<std::size_t>(j);
        if (j < 128) {
          t.m_magnitude[u] = adam8_signed_code()[u];
          t.m_threshold[u] = m.threshold[u];
        }
        t.v_value[u] = adam8_unsigned_code()[u];
        t.v_threshold[u] = v.threshold[u];
      }
      return t;
    }();
    return tables;
  }

  const kernels::LaunchContext& ctx() const {
    dev_.bind();
    return dev_.launch_context();
  }

  // The kernels of one attention call: the tuning's, except that the flash kernels chosen with
  // attention_falls_back leaves the calls it does not serve (attention.cu's conditions for kAuto:
  // applies, and every tensor 16-byte aligned) to the simple kernels instead of failing them.
  kernels::AttentionKernel attention_kernel(const kernels::AttentionDims& d, kernels::Elem e,
                                            bool backward,
                                            std::initializer_list<const void*> tensors) const {
    const kernels::AttentionKernel chosen = tuning_.attention;
    if (!tuning_.attention_falls_back || chosen != kernels::AttentionKernel::kFlash2) {
      return chosen;
    }
    bool aligned = true;
    for (const void* t : tensors) {
      aligned = aligned && reinterpret_cast<std::uintptr_t>(t) % 16 == 0;
    }
    return aligned && kernels::flash_attention_applies(ctx(), d, e, backward)
               ? chosen
               : kernels::AttentionKernel::kSimple;
  }

  // Records a failed launch (with the op's name) as the device's sticky error.
  void done(int err, const char* op) const {
    if (err != 0) {
      dev_.errors().record(
          internal_error(std::string("CUDA op ") + op + " failed: " + kernels::error_text(err)));
      return;
    }
    sync_if_asked(op);
  }

  void sync_if_asked(const char* op) const {
    if (!tuning_.sync_after_each_op) return;
    const cudaError_t e = cudaStreamSynchronize(dev_.compute_stream());
    if (e != cudaSuccess) {
      dev_.errors().record(internal_error(std::string("CUDA op ") + op +
                                          " faulted: " + kernels::error_text(static_cast<int>(e))));
    }
  }

  // Scratch for one op at a time, in compute-stream order. Growing frees the old block, which
  // the device reuses only after the work already queued on it has finished.
  void* scratch(std::size_t bytes) const {
    bytes = std::max<std::size_t>(bytes, 1);
    if (scratch_.size() >= bytes) return scratch_.data();
    scratch_.reset();
    auto r = dev_.allocate(align_up(bytes, kMiB), "CUDA op scratch");
    if (!r.is_ok()) {
      dev_.errors().record(r.status());
      return nullptr;
    }
    scratch_ = std::move(r).value();
    return scratch_.data();
  }

  CudaDevice& dev_;
  CudaTuning tuning_;
  DeviceBuffer workspace_;  // declared before gemm_, which uses it, so it is freed after
  std::unique_ptr<CudaGemm> gemm_;
  mutable DeviceBuffer scratch_;
};

}  // namespace

Result<std::unique_ptr<Ops>> make_cuda_ops(CudaDevice& device, const CudaTuning& tuning,
                                           bool allow_tf32, std::uint64_t limit_bytes) {
  auto ops = std::make_unique<CudaOps>(device, tuning);
  STRATA_RETURN_IF_ERROR(ops->init(allow_tf32, limit_bytes));
  return std::unique_ptr<Ops>(std::move(ops));
}

}  // namespace strata::device::cuda
