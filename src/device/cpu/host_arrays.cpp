// Host array kernels (conversion, accumulation, sums of squares) over a oneTBB arena, for the
// CPU backend's ops and for HostArrays.
#include "strata/device/host_arrays.h"

#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

#include "src/device/cpu/cpu_ops_internal.h"

namespace strata::device {
namespace cpu {
namespace {

// Elements per task of a conversion: large enough to amortize a task, small enough to spread.
constexpr std::int64_t kConvertGrain = 1 << 16;
// Elements widened at a time between two half-precision types.
constexpr std::int64_t kBounce = 2048;
constexpr auto kChunk = static_cast<std::int64_t>(kSumSquaresChunkElems);
static_assert(kSumSquaresLanes == 8, "the kernels' sums keep 8 lanes");

ArrayDType array_dtype(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return kArrayF32;
    case DType::kBF16:
      return kArrayBF16;
    case DType::kF16:
      return kArrayF16;
    default:
      break;
  }
  STRATA_CHECK(false, "host array kernels take f32, bf16 or f16, got", dtype_name(dtype));
  return kArrayF32;
}

// One serial piece of a conversion.
void convert_span(const CpuKernels& k, const void* src, ArrayDType from, void* dst, ArrayDType to,
                  std::int64_t n) {
  const auto* s16 = static_cast<const std::uint16_t*>(src);
  auto* d16 = static_cast<std::uint16_t*>(dst);
  if (from == kArrayF32) {
    (to == kArrayBF16 ? k.f32_to_bf16 : k.f32_to_f16)(static_cast<const float*>(src), d16, n);
    return;
  }
  const auto widen = from == kArrayBF16 ? k.bf16_to_f32 : k.f16_to_f32;
  if (to == kArrayF32) {
    widen(s16, static_cast<float*>(dst), n);
    return;
  }
  // bf16 <-> f16: through f32, which holds either exactly.
  const auto narrow = to == kArrayBF16 ? k.f32_to_bf16 : k.f32_to_f16;
  float buf[kBounce];
  for (std::int64_t i = 0; i < n; i += kBounce) {
    const std::int64_t m = std::min(kBounce, n - i);
    widen(s16 + i, buf, m);
    narrow(buf, d16 + i, m);
  }
}

// Elements per task of a sum of squares: many chunks, so a task pays for itself.
constexpr std::int64_t kSumTask = 1 << 16;
static_assert(kSumTask % kChunk == 0);

// The chunks' sums (chunk_sum(i0, i1) of each chunk of kChunk elements from element 0), added
// exactly: each task into its own ExactSum, the tasks' sums then in any order.
template <typename ChunkSum>
ExactSum exact_chunked_sum(const CpuContext& ctx, std::int64_t n, ChunkSum chunk_sum) {
  if (n <= 0) return {};
  const std::int64_t tasks = (n + kSumTask - 1) / kSumTask;
  std::vector<ExactSum> partial(static_cast<std::size_t>(tasks));
  ctx.parallel_chunks(n, kSumTask, [&](std::int64_t t, std::int64_t i0, std::int64_t i1) {
    ExactSum& sum = partial[static_cast<std::size_t>(t)];
    for (std::int64_t c = i0; c < i1; c += kChunk) sum.add(chunk_sum(c, std::min(i1, c + kChunk)));
  });
  ExactSum total;
  for (const ExactSum& p : partial) total += p;
  return total;
}

}  // namespace

void parallel_convert(const CpuContext& ctx, const void* src, DType src_dtype, void* dst,
                      DType dst_dtype, std::int64_t n) {
  const std::size_t ss = dtype_size(src_dtype), ds = dtype_size(dst_dtype);
  const auto* s = static_cast<const std::byte*>(src);
  auto* d = static_cast<std::byte*>(dst);
  if (src_dtype == dst_dtype) {
    ctx.parallel_for(n, kConvertGrain, [&](std::int64_t i0, std::int64_t i1) {
      std::memcpy(d + i0 * ss, s + i0 * ss, static_cast<std::size_t>(i1 - i0) * ss);
    });
    return;
  }
  const ArrayDType from = array_dtype(src_dtype), to = array_dtype(dst_dtype);
  const CpuKernels& k = ctx.kernels();
  ctx.parallel_for(n, kConvertGrain, [&](std::int64_t i0, std::int64_t i1) {
    convert_span(k, s + i0 * ss, from, d + i0 * ds, to, i1 - i0);
  });
}

ExactSum parallel_sum_squares(const CpuContext& ctx, const void* x, DType dtype, std::int64_t n) {
  const auto kernel = ctx.kernels().sum_squares[array_dtype(dtype)];
  const auto* bytes = static_cast<const std::byte*>(x);
  const std::size_t esize = dtype_size(dtype);
  return exact_chunked_sum(ctx, n, [&](std::int64_t i0, std::int64_t i1) {
    return kernel(bytes + static_cast<std::size_t>(i0) * esize, i1 - i0);
  });
}

ExactSum parallel_accumulate(const CpuContext& ctx, float* acc, const void* grad, DType grad_dtype,
                             std::int64_t n, bool fresh, std::int64_t counted) {
  const auto kernel = ctx.kernels().accumulate[array_dtype(grad_dtype)];
  const auto* bytes = static_cast<const std::byte*>(grad);
  const std::size_t esize = dtype_size(grad_dtype);
  const auto add = [&](std::int64_t i0, std::int64_t i1) {
    return kernel(acc + i0, bytes + static_cast<std::size_t>(i0) * esize, i1 - i0, fresh);
  };
  // Elements from `counted` on are added but not squared: the chunk they begin in is cut there.
  return exact_chunked_sum(ctx, n, [&](std::int64_t i0, std::int64_t i1) {
    if (i0 >= counted) {
      add(i0, i1);
      return 0.0;
    }
    if (i1 <= counted) return add(i0, i1);
    const double squares = add(i0, counted);
    add(counted, i1);
    return squares;
  });
}

}  // namespace cpu

struct HostArrays::Impl {
  Impl(int threads, sys::SimdPath simd) : ctx(threads, simd), path(simd) {}
  cpu::CpuContext ctx;
  sys::SimdPath path;
};

Result<HostArrays> HostArrays::create(const HostArrayOptions& options) {
  STRATA_ASSIGN_OR_RETURN(const sys::SimdPath path,
                          sys::resolve_simd_path(options.simd, "host array simd"));
  return HostArrays(std::make_unique<Impl>(options.threads, path));
}

HostArrays::HostArrays(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
HostArrays::HostArrays(HostArrays&&) noexcept = default;
HostArrays& HostArrays::operator=(HostArrays&&) noexcept = default;
HostArrays::~HostArrays() = default;

void HostArrays::convert(const void* src, DType src_dtype, void* dst, DType dst_dtype,
                         std::int64_t n) const {
  cpu::parallel_convert(impl_->ctx, src, src_dtype, dst, dst_dtype, n);
}

ExactSum HostArrays::accumulate(float* acc, const void* grad, DType grad_dtype, std::int64_t n,
                                bool fresh, std::int64_t counted) const {
  return cpu::parallel_accumulate(impl_->ctx, acc, grad, grad_dtype, n, fresh, counted);
}

ExactSum HostArrays::sum_squares(const void* x, DType dtype, std::int64_t n) const {
  return cpu::parallel_sum_squares(impl_->ctx, x, dtype, n);
}

int HostArrays::threads() const { return impl_->ctx.max_concurrency(); }
sys::SimdPath HostArrays::simd() const { return impl_->path; }

}  // namespace strata::device
