// Attention dispatch: the flash kernels (kFlash2) where they apply, else the simple kernels
// (kAuto); or the variant asked for. The first flash variant (WMMA through shared memory) was
// removed: kFlash2 served every call it served, in less shared memory, at 3.2-4.0 times its speed
// on an H200 (bench/RESULTS.md, "The first GPU run" and "Issue 58").
#include "attention_flash2.cuh"

namespace strata::kernels {

bool flash_attention_applies(const LaunchContext& ctx, const AttentionDims& d, Elem dtype,
                             bool backward) {
  if (dtype != Elem::kBF16 || (d.head_dim != 64 && d.head_dim != 128)) return false;
  if (d.kv_heads <= 0 || d.heads % d.kv_heads != 0 || d.heads > 65535 || d.kv_heads > 65535 ||
      d.batch > 65535) {
    return false;
  }
  const std::size_t smem =
      backward ? flash2_backward_smem_bytes(d.head_dim) : flash2_forward_smem_bytes(d.head_dim);
  return smem != 0 && smem <= ctx.max_smem_optin_bytes;
}

namespace {

// kAuto's choice for one call.
AttentionKernel auto_kernel(const LaunchContext& ctx, const AttentionDims& d, Elem dtype,
                            bool backward, bool aligned) {
  return aligned && ctx.compute_major >= 8 && flash_attention_applies(ctx, d, dtype, backward)
             ? AttentionKernel::kFlash2
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
  return attention_forward_flash2(ctx, q, k, v, out, lse, d);
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
  return attention_backward_flash2(ctx, dout, q, k, v, lse, drow, dq, dk, dv, d);
}

}  // namespace strata::kernels
