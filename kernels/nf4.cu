// NF4 decode (device::Ops::dequantize_nf4): one thread a byte of codes, two elements; each
// block's maximum decoded from its 8-bit code, group scale and mean with the host's two f32
// operations (no contraction), then one f32 product per element: the host reference's bits.
#include "common.cuh"

namespace strata::kernels {
namespace {

template <typename T>
__global__ void nf4_decode_kernel(const std::uint8_t* packed, Nf4Parts parts, Nf4Tables tables,
                                  T* out) {
  const std::int64_t pairs = (parts.elems + 1) / 2;
  const float mean = *reinterpret_cast<const float*>(packed + parts.mean);
  const float* scales = reinterpret_cast<const float*>(packed + parts.scales);
  for (std::int64_t j = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; j < pairs;
       j += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t i = 2 * j;
    const std::int64_t b = i / 64;
    const float code = tables.absmax_code[packed[parts.absmax + b]];
    const float absmax = __fadd_rn(__fmul_rn(code, scales[b / 256]), mean);
    const std::uint8_t byte = packed[parts.codes + j];
    out[i] = from_float<T>(__fmul_rn(tables.levels[byte >> 4], absmax));
    if (i + 1 < parts.elems)
      out[i + 1] = from_float<T>(__fmul_rn(tables.levels[byte & 15], absmax));
  }
}

}  // namespace

int dequantize_nf4(const LaunchContext& ctx, const void* packed, const Nf4Parts& parts,
                   const Nf4Tables& tables, void* out, Elem dtype) {
  if (parts.elems <= 0) return 0;
  constexpr int kThreads = 256;
  return dispatch_float(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    nf4_decode_kernel<T>
        <<<grid_for((parts.elems + 1) / 2, kThreads), kThreads, 0, stream_of(ctx)>>>(
            static_cast<const std::uint8_t*>(packed), parts, tables, static_cast<T*>(out));
    return launch_check();
  });
}

}  // namespace strata::kernels
