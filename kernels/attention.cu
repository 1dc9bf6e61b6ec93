// Attention dispatch: the flash kernels where they apply, the simple kernels elsewhere; the
// second flash variant only when asked for (kFlash2) until measurements make it the default.
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

int attention_forward(const LaunchContext& ctx, const void* q, const void* k, const void* v,
                      void* out, float* lse, const AttentionDims& d, Elem dtype,
                      AttentionKernel kernel) {
  if (kernel == AttentionKernel::kFlash2) {
    if (dtype != Elem::kBF16) return static_cast<int>(cudaErrorNotSupported);
    return attention_forward_flash2(ctx, q, k, v, out, lse, d);
  }
  const bool aligned = aligned16(q) && aligned16(k) && aligned16(v) && aligned16(out);
  const bool flash =
      kernel == AttentionKernel::kFlash || (kernel == AttentionKernel::kAuto && aligned &&
                                            flash_attention_applies(ctx, d, dtype, false));
  if (flash) {
    if (dtype != Elem::kBF16) return static_cast<int>(cudaErrorNotSupported);
    return attention_forward_flash(ctx, q, k, v, out, lse, d);
  }
  return attention_forward_simple(ctx, q, k, v, out, lse, d, dtype);
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
  if (kernel == AttentionKernel::kFlash2) {
    if (dtype != Elem::kBF16) return static_cast<int>(cudaErrorNotSupported);
    return attention_backward_flash2(ctx, dout, q, k, v, lse, drow, dq, dk, dv, d);
  }
  const bool aligned = aligned16(dout) && aligned16(q) && aligned16(k) && aligned16(v) &&
                       aligned16(dq) && aligned16(dk) && aligned16(dv);
  const bool flash =
      kernel == AttentionKernel::kFlash ||
      (kernel == AttentionKernel::kAuto && aligned && flash_attention_applies(ctx, d, dtype, true));
  if (flash) {
    if (dtype != Elem::kBF16) return static_cast<int>(cudaErrorNotSupported);
    return attention_backward_flash(ctx, dout, q, k, v, lse, drow, dq, dk, dv, d);
  }
  return attention_backward_simple(ctx, dout, q, k, v, lse, drow, dq, dk, dv, d, dtype);
}

}  // namespace strata::kernels
