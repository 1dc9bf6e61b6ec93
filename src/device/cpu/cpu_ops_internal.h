// Private helpers shared by the CPU op files: dtype dispatch, element load/store and the
// deterministic parallel loops every CPU op uses.
#pragma once

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "src/device/cpu/cpu_kernels.h"
#include "src/device/cpu/onednn_gemm.h"
#include "strata/core/check.h"
#include "strata/core/dtype.h"
#include "strata/device/ops.h"
#include "strata/sys/cpu_features.h"

namespace strata::device::cpu {

inline float to_f32(float x) { return x; }
inline float to_f32(bf16 x) { return bf16_to_f32(x); }
inline float to_f32(f16 x) { return f16_to_f32(x); }

template <typename T>
inline T from_f32(float x);
template <>
inline float from_f32<float>(float x) {
  return x;
}
template <>
inline bf16 from_f32<bf16>(float x) {
  return f32_to_bf16(x);
}
template <>
inline f16 from_f32<f16>(float x) {
  return f32_to_f16(x);
}

// Calls fn(T{}) with T = float, bf16 or f16 for the op's storage dtype (the half types compute
// in fp32 and round once on the way out).
template <typename Fn>
decltype(auto) dispatch_float(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kF32:
      return fn(float{});
    case DType::kBF16:
      return fn(bf16{});
    case DType::kF16:
      return fn(f16{});
    default:
      break;
  }
  STRATA_CHECK(false, "CPU ops support f32, bf16 and f16 only, got", dtype_name(dtype));
  return fn(float{});  // unreachable
}

// The kernel tables' index of T.
inline KernelDType kernel_dtype(float) { return kKernelF32; }
inline KernelDType kernel_dtype(bf16) { return kKernelBF16; }
inline KernelDType kernel_dtype(f16) { return kKernelF16; }

// Loads n elements of T into fp32 (or copies), through the SIMD kernels for bf16.
inline void load_row(const CpuKernels& /*k*/, const float* src, float* dst, std::int64_t n) {
  std::copy(src, src + n, dst);
}
inline void load_row(const CpuKernels& k, const bf16* src, float* dst, std::int64_t n) {
  k.bf16_to_f32(reinterpret_cast<const std::uint16_t*>(src), dst, n);
}
inline void store_row(const CpuKernels& /*k*/, const float* src, float* dst, std::int64_t n) {
  std::copy(src, src + n, dst);
}
inline void store_row(const CpuKernels& k, const float* src, bf16* dst, std::int64_t n) {
  k.f32_to_bf16(src, reinterpret_cast<std::uint16_t*>(dst), n);
}
inline void load_row(const CpuKernels& k, const f16* src, float* dst, std::int64_t n) {
  k.f16_to_f32(reinterpret_cast<const std::uint16_t*>(src), dst, n);
}
inline void store_row(const CpuKernels& k, const float* src, f16* dst, std::int64_t n) {
  k.f32_to_f16(src, reinterpret_cast<std::uint16_t*>(dst), n);
}

// Dot product with independent partial sums so the compiler can vectorize it without
// -ffast-math; the summation order is fixed, so results are reproducible.
inline float dot_f32(const float* a, const float* b, std::int64_t n) {
  constexpr int kLanes = 8;
  float acc[kLanes] = {};
  std::int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) acc[l] += a[i + l] * b[i + l];
  }
  float tail = 0.0f;
  for (; i < n; ++i) tail += a[i] * b[i];
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7])) + tail;
}

// y += alpha * x
inline void axpy_f32(float alpha, const float* x, float* y, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

// Reusable fp32 scratch buffers. Ops take one per task and give it back, so steady-state calls
// touch no fresh pages (first touch costs ~10 us per 4 KiB page on this machine).
class ScratchPool {
 public:
  class Lease {
   public:
    Lease(ScratchPool* pool, std::size_t capacity, std::unique_ptr<float[]> data)
        : pool_(pool), capacity_(capacity), data_(std::move(data)) {}
    ~Lease() {
      if (data_) pool_->give_back(capacity_, std::move(data_));
    }
    Lease(Lease&&) = default;
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    Lease& operator=(Lease&&) = delete;
    float* data() const { return data_.get(); }

   private:
    ScratchPool* pool_;
    std::size_t capacity_;
    std::unique_ptr<float[]> data_;
  };

  // At least n floats, uninitialized.
  Lease take(std::size_t n) {
    n = std::max<std::size_t>(n, 1);
    {
      std::lock_guard lock(mu_);
      // Smallest free buffer that fits, so big buffers stay available for big requests.
      std::size_t best = free_.size();
      for (std::size_t i = 0; i < free_.size(); ++i) {
        if (free_[i].capacity >= n &&
            (best == free_.size() || free_[i].capacity < free_[best].capacity)) {
          best = i;
        }
      }
      if (best != free_.size()) {
        Entry e = std::move(free_[best]);
        free_.erase(free_.begin() + static_cast<std::ptrdiff_t>(best));
        return Lease(this, e.capacity, std::move(e.data));
      }
    }
    return Lease(this, n, std::make_unique_for_overwrite<float[]>(n));
  }

 private:
  struct Entry {
    std::size_t capacity;
    std::unique_ptr<float[]> data;
  };
  static constexpr std::size_t kMaxFree = 64;

  void give_back(std::size_t capacity, std::unique_ptr<float[]> data) {
    std::lock_guard lock(mu_);
    if (free_.size() >= kMaxFree) {
      // Drop the smallest so the pool keeps the buffers that serve the most requests.
      auto it = std::min_element(free_.begin(), free_.end(), [](const Entry& a, const Entry& b) {
        return a.capacity < b.capacity;
      });
      if (it->capacity >= capacity) return;
      free_.erase(it);
    }
    free_.push_back(Entry{capacity, std::move(data)});
  }

  std::mutex mu_;
  std::vector<Entry> free_;
};

// The thread context of one op table: a task arena sized to the requested thread count. Every
// parallel loop splits work into chunks whose boundaries depend only on the problem size, and
// each chunk writes disjoint outputs, so results never depend on scheduling.
class CpuContext {
 public:
  CpuContext(int num_threads, sys::SimdPath simd, CpuGemmChoice gemm = {})
      : arena_(num_threads > 0 ? num_threads : tbb::task_arena::automatic),
        kernels_(cpu_kernels_for(simd)),
        gemm_(gemm),
        onednn_(gemm.any_onednn() ? std::make_unique<OneDnnGemm>() : nullptr) {}

  int max_concurrency() const { return arena_.max_concurrency(); }
  // The elementwise kernels of the SIMD path this op table was made for.
  const CpuKernels& kernels() const { return kernels_; }
  // oneDNN's primitives where this op table runs `dtype`'s GEMMs on it, else null.
  const OneDnnGemm* onednn_for(DType dtype) const {
    const GemmLibrary lib = dtype == DType::kBF16  ? gemm_.bf16
                            : dtype == DType::kF32 ? gemm_.f32
                                                   : GemmLibrary::kOpenBlas;
    return lib == GemmLibrary::kOneDnn ? onednn_.get() : nullptr;
  }
  ScratchPool::Lease scratch(std::size_t num_floats) const { return scratch_.take(num_floats); }

  // fn(begin, end) over [0, n) in chunks of at least `grain` items.
  template <typename Fn>
  void parallel_for(std::int64_t n, std::int64_t grain, Fn&& fn) const {
    if (n <= 0) return;
    grain = std::max<std::int64_t>(grain, 1);
    if (n <= grain || arena_.max_concurrency() <= 1) {
      fn(std::int64_t{0}, n);
      return;
    }
    arena_.execute([&] {
      tbb::parallel_for(tbb::blocked_range<std::int64_t>(0, n, grain),
                        [&](const tbb::blocked_range<std::int64_t>& r) { fn(r.begin(), r.end()); });
    });
  }

  // fn(chunk, begin, end) over fixed chunks of `chunk_size` items: chunk i always covers
  // [i * chunk_size, min(n, (i + 1) * chunk_size)), for reductions that must be reproducible.
  template <typename Fn>
  void parallel_chunks(std::int64_t n, std::int64_t chunk_size, Fn&& fn) const {
    const std::int64_t num_chunks = (n + chunk_size - 1) / chunk_size;
    parallel_for(num_chunks, 1, [&](std::int64_t c0, std::int64_t c1) {
      for (std::int64_t c = c0; c < c1; ++c) {
        fn(c, c * chunk_size, std::min(n, (c + 1) * chunk_size));
      }
    });
  }

 private:
  mutable tbb::task_arena arena_;
  mutable ScratchPool scratch_;
  const CpuKernels& kernels_;
  CpuGemmChoice gemm_;
  std::unique_ptr<OneDnnGemm> onednn_;
};

// GEMM (cpu_gemm.cpp): on oneDNN where the context runs the dtype's GEMMs there and oneDNN has a
// real implementation for the problem; else fp32 on OpenBLAS and bf16 and f16 through
// gemm_half_tiled.
void cpu_gemm(const CpuContext& ctx, const GemmArgs& args);
// A GEMM on oneDNN: C split into blocks of whole rows or columns, chosen from the shape alone,
// one single-threaded product per block over the context's arena, so the bits do not depend on
// the thread count. False, with C untouched, where oneDNN has only its reference implementation.
bool gemm_onednn(const CpuContext& ctx, const OneDnnGemm& dnnl, const GemmArgs& args);
// The bf16 and f16 GEMM: A, B and C converted to fp32 in tiles of at most `budget_floats`
// together (whole operands when they fit), sgemm on each. cpu_gemm passes its own budget; tests
// pass small ones to cover the tiling.
void gemm_half_tiled(const CpuContext& ctx, const GemmArgs& args, std::int64_t budget_floats);
// Row-major cblas_sgemm. Call it from the op's calling thread only, never from inside a
// parallel loop: OpenBLAS runs its own thread pool.
void sgemm_f32(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k,
               float alpha, const float* a, std::int64_t lda, const float* b, std::int64_t ldb,
               float beta, float* c, std::int64_t ldc);

// Causal GQA attention (cpu_attention.cpp).
void cpu_attention_decode(const CpuContext& ctx, const void* q, const void* k_cache,
                          const void* v_cache, void* out, const DecodeAttentionShape& shape,
                          DType dtype);
void cpu_attention_forward(const CpuContext& ctx, const void* q, const void* k, const void* v,
                           void* out, float* lse, const AttentionShape& shape, DType dtype);
void cpu_attention_backward(const CpuContext& ctx, const void* dout, const void* q, const void* k,
                            const void* v, const void* out, const float* lse, void* dq, void* dk,
                            void* dv, const AttentionShape& shape, DType dtype);

// Host array kernels over the context's arena (host_arrays.cpp), shared by the cast and
// sum_squares ops and device::HostArrays; the bits are those of core/dtype.h's references.
void parallel_convert(const CpuContext& ctx, const void* src, DType src_dtype, void* dst,
                      DType dst_dtype, std::int64_t n);
ExactSum parallel_sum_squares(const CpuContext& ctx, const void* x, DType dtype, std::int64_t n);
ExactSum parallel_accumulate(const CpuContext& ctx, float* acc, const void* grad, DType grad_dtype,
                             std::int64_t n, bool fresh, std::int64_t counted);

// AdamW step (cpu_adamw.cpp).
void cpu_adamw(const CpuContext& ctx, const AdamWArgs& args);

}  // namespace strata::device::cpu
