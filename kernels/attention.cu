// Attention dispatch: the second flash variant where it applies, else the first, else the simple
// kernels (kAuto); or the variant asked for. bench_gpu_attention on an H200 measured kFlash2 at
// 3.4 times kFlash's speed forward and backward (bench/RESULTS.md, "The first GPU run").
#include "attention_flash2.cuh"

namespace strata::kernels {

bool flash_attention_applies(const LaunchContext& ctx, const AttentionDims& d, Elem dtype,
                             bool backward, AttentionKernel kernel) {
  if (dtype != Elem::kBF16 || (d.head_dim != 64 && d.head_dim != 128)) return false;
  if (d.kv_heads <= 0 || d.heads % d.kv_heads != 0 || d.heads > 65535 || d.kv_heads > 65535 ||
      d.batch > 65535) {
    return false;
  }
  std::size_t smem = 0;
  if (kernel == AttentionKernel::kFlash2) {
    smem =
        backward ? flash2_backward_smem_bytes(d.head_dim) : flash2_forward_smem_bytes(d.head_dim);
  } else {
    smem = backward ? flash_backward_smem_bytes(d.head_dim) : flash_forward_smem_bytes(d.head_dim);
  }
  return smem != 0 && smem <= ctx.max_smem_optin_bytes;
}

namespace {

// kAuto's choice for one call.
AttentionKernel auto_kernel(const LaunchContext& ctx, const AttentionDims& d, Elem dtype,
                            bool backward, bool aligned) {
  if (!aligned) return AttentionKernel::kSimple;
  if (ctx.compute_major >= 8 &&
      flash_attention_applies(ctx, d, dtype, backward, AttentionKernel::kFlash2)) {
    return AttentionKernel::kFlash2;
  }
  return flash_attention_applies(ctx, d, dtype, backward) ? AttentionKernel::kFlash
                                                          : AttentionKernel::kSimple;
}

}  // namespace

int attention_forward(const LaunchContext& ctx, const void* q, const void* k, const void* v,
                      void* out, float* lse, const AttentionDims& d, Elem dtype,
                      AttentionKernel kernel) {
  if (kernel == AttentionKernel::kAuto) {
    kernel = auto_kernel(ctx, d, dtype, false,
                         aligned16(q) && aligned16(k) && aligned16(v) && aligned16(out));
  }
  if (kernel == AttentionKernel::kSimple) {
    return attention_forward_simple(ctx, q, k, v, out, lse, d, dtype);
  }
  if (dtype != Elem::kBF16) return static_cast<int>(cudaErrorNotSupported);
  return kernel == AttentionKernel::kFlash2 ? attention_forward_flash2(ctx, q, k, v, out, lse, d)
                                            : attention_forward_flash(ctx, q, k, v, out, lse, d);
}

std::size_t attention_backward_scratch_bytes(const AttentionDims& d) {
  return static_cast<std::size_t>(d.batch * d.heads * d.seq) * sizeof(float);
}

int attention_backward(const LaunchContext& ctx, const void* dout, const void* q, const void* k,
                       const void* v, const void* out, const float* lse, void* dq, void* dk,
                       void* dv, const AttentionDims& d, Elem dtype, AttentionKernel kernel,
                       void* scratch) {
  auto* drow = static_cast<float*>(scratch);
  if (const int e = attention_row_dot(ctx, dout, out, drow, d, dtype); e != 0) return e;
  if (kernel == AttentionKernel::kAuto) {
    kernel = auto_kernel(ctx, d, dtype, true,
                         aligned16(dout) && aligned16(q) && aligned16(k) && aligned16(v) &&
                             aligned16(dq) && aligned16(dk) && aligned16(dv));
  }
  if (kernel == AttentionKernel::kSimple) {
    return attention_backward_simple(ctx, dout, q, k, v, lse, drow, dq, dk, dv, d, dtype);
  }
  if (dtype != Elem::kBF16) return static_cast<int>(cudaErrorNotSupported);
  return kernel == AttentionKernel::kFlash2
             ? attention_backward_flash2(ctx, dout, q, k, v, lse, drow, dq, dk, dv, d)
             : attention_backward_flash(ctx, dout, q, k, v, lse, drow, dq, dk, dv, d);
}

}  // namespace strata::kernels
