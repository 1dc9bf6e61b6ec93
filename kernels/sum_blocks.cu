// Sums of blocks in the canonical tree (strata::canonical_sum): one thread an element, a binary
// counter's stack of partial sums in registers, the blocks read in order.
#include "common.cuh"

namespace strata::kernels {
namespace {

template <typename In, typename Out>
__global__ void sum_blocks_kernel(const In* __restrict__ in, std::int64_t blocks, std::int64_t n,
                                  Out* __restrict__ out) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    float partial[64];
    int level[64];
    int depth = 0;
    float sum = 0.0f;
    bool any = false;
    std::int64_t next = 0;
    for (int block = 62; block >= 0; --block) {
      if (((blocks >> block) & 1) == 0) continue;
      for (const std::int64_t end = next + (std::int64_t{1} << block); next < end; ++next) {
        float carry = 0.0f + to_float(in[next * n + i]);
        int at = 0;
        while (depth > 0 && level[depth - 1] == at) {
          carry = partial[--depth] + carry;
          ++at;
        }
        partial[depth] = carry;
        level[depth++] = at;
      }
      sum = any ? sum + partial[--depth] : partial[--depth];
      any = true;
    }
    out[i] = from_float<Out>(sum);
  }
}

}  // namespace

int sum_blocks(const LaunchContext& ctx, const void* in, std::int64_t blocks, std::int64_t n,
               Elem in_dtype, void* out, Elem out_dtype) {
  if (n <= 0) return 0;
  constexpr int kThreads = 256;
  return dispatch_float(in_dtype, [&](auto in_tag) {
    using In = typename decltype(in_tag)::type;
    return dispatch_float(out_dtype, [&](auto out_tag) {
      using Out = typename decltype(out_tag)::type;
      sum_blocks_kernel<In, Out><<<grid_for(n, kThreads), kThreads, 0, stream_of(ctx)>>>(
          static_cast<const In*>(in), blocks, n, static_cast<Out*>(out));
      return launch_check();
    });
  });
}

}  // namespace strata::kernels
