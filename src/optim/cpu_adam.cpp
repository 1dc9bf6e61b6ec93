// CpuAdam: run-time SIMD dispatch (CPUID), the static tile partition over a pinned oneTBB arena,
// and the finite-gradient pre-scan.
#include "strata/optim/cpu_adam.h"

#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/parallel_for.h>
#include <oneapi/tbb/partitioner.h>
#include <oneapi/tbb/task_arena.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <map>
#include <mutex>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

#include "src/device/cpu/cpu_kernels.h"
#include "src/optim/cpu_adam_kernels.h"
#include "src/optim/thread_pinning.h"
#include "strata/core/check.h"
#include "strata/core/rng.h"
#include "strata/device/adam8bit.h"
#include "strata/sys/process.h"

namespace strata::optim {

namespace {

using detail::AdamConstants;
using detail::AdamTile;
using detail::KernelSet;

int grad_kind(DType d) {
  switch (d) {
    case DType::kF32:
      return detail::kGradF32;
    case DType::kBF16:
      return detail::kGradBF16;
    case DType::kF16:
      return detail::kGradF16;
    default:
      break;
  }
  STRATA_CHECK(false, "CpuAdam: gradient dtype must be f32, bf16 or f16, got", dtype_name(d));
  return 0;
}

int out_kind(const device::AdamWArgs& a) {
  if (a.param_out == nullptr) return detail::kOutNone;
  switch (a.out_dtype) {
    case DType::kF32:
      return detail::kOutF32;
    case DType::kBF16:
      return detail::kOutBF16;
    case DType::kF16:
      return detail::kOutF16;
    default:
      break;
  }
  STRATA_CHECK(false, "CpuAdam: param_out dtype must be f32, bf16 or f16, got",
               dtype_name(a.out_dtype));
  return 0;
}

void check_args(const device::AdamWArgs& a) { device::check_adamw_args(a, "CpuAdam:"); }

}  // namespace

namespace detail {
class Tuner;

Quant8Search quant8_search(bool second) {
  const device::Adam8Search& search = device::adam8_search(second);
  return {second,
          search.threshold.data(),
          search.level.data(),
          search.bucket.data(),
          device::kAdam8BucketLo,
          device::kAdam8BucketHi,
          second ? device::adam8_unsigned_code().data() : device::adam8_signed_code().data(),
          search.binade_band.data(),
          search.binade_boundary.data(),
          search.band_slope.data(),
          search.band_offset.data()};
}
}  // namespace detail

struct CpuAdam::Impl {
  CpuAdamOptions options;
  SimdPath path = SimdPath::kScalar;
  bool native_bf16 = false;
  int threads = 1;
  KernelSet kernels{};
  // 8-bit moments' searches (device::adam8_search, as the kernels take them).
  detail::Quant8Search q8_m{}, q8_v{};
  // The device's elementwise kernels of the same path: bf16 moments widen and narrow through
  // them (exactly strata::bf16_to_f32 / f32_to_bf16).
  const device::cpu::CpuKernels* convert = nullptr;
  tbb::task_arena arena;  // declared before pinning: the observer detaches first
  std::unique_ptr<detail::ArenaPinning> pinning;

  // The variant in use: the options' choice, or kAuto's once it has chosen (until then, the
  // baseline: regular stores, no prefetch, or whichever the options fixed).
  bool streaming = false;  // for spans of nontemporal_min_elems+
  bool prefetch = false;
  detail::Tuner* tuner = nullptr;  // kAuto's, shared by every CpuAdam of its kind; null once chosen
  const KernelCalibration* tuned = nullptr;  // its measurement, once it chose

  // bf16 moments or master weights are updated in fp32 scratch that is read back at once:
  // regular stores there.
  int nt_index(bool stream, const device::AdamWArgs& a) const {
    return stream && a.state_dtype == DType::kF32 && a.master_dtype == DType::kF32 &&
                   a.n >= options.nontemporal_min_elems
               ? 1
               : 0;
  }
  // Spans this long are timed for the tuner: long enough to leave the caches' reach in most of
  // their bytes and to time to a few percent, and long enough for streaming stores to apply.
  std::int64_t tune_min_elems() const {
    return std::max<std::int64_t>(options.nontemporal_min_elems, std::int64_t{1} << 20);
  }
  void adopt_if_chosen();

  // Calls fn(begin, end) for every tile of [0, n): on the caller alone when one thread (or one
  // tile) suffices, else statically partitioned into contiguous runs of tiles, one per thread.
  // Tiles are rounded up to a multiple of `granule` elements (8-bit moments: whole blocks).
  template <typename Fn>
  void for_each_tile(std::int64_t n, std::int64_t granule, const Fn& fn) {
    const std::int64_t tile = (options.tile_elems + granule - 1) / granule * granule;
    const std::int64_t num_tiles = (n + tile - 1) / tile;
    if (threads == 1 || num_tiles <= 1) {
      for (std::int64_t t = 0; t < num_tiles; ++t) fn(t * tile, std::min(n, (t + 1) * tile));
      return;
    }
    const auto caller = pinning != nullptr ? pinning->bind_caller() : nullptr;
    arena.execute([&] {
      tbb::parallel_for(
          tbb::blocked_range<std::int64_t>(0, num_tiles, 1),
          [&](const tbb::blocked_range<std::int64_t>& r) {
            for (std::int64_t t = r.begin(); t < r.end(); ++t) {
              fn(t * tile, std::min(n, (t + 1) * tile));
            }
          },
          tbb::static_partitioner());
    });
  }

  // Runs `kernel(tile)` over the span's tiles with every pointer offset to the tile. Compact
  // state (bf16 or 8-bit moments, bf16 master weights) goes through the f32 kernels kStateChunk
  // elements at a time: widened into scratch the kernel updates in place (the step's arithmetic
  // is the f32 step's), then stored back: moments rounded to nearest or quantized by block,
  // master weights stochastically (the reference's random bits, element by element) or with
  // their Kahan compensation, the copy converted from the value stored. (bf16 moments beside f32
  // master weights, and 8-bit moments beside any master weights, skip this where the ISA's
  // kernels read them directly: run_bf16_moment_tiles, run_adam8_tiles.)
  static constexpr std::int64_t kStateChunk = 2048;
  template <typename Kernel>
  void run_tiles(const device::AdamWArgs& a, const Kernel& kernel) {
    const std::size_t gsize = dtype_size(a.grad_dtype);
    const std::size_t osize = a.param_out != nullptr ? dtype_size(a.out_dtype) : 0;
    const bool out_of_place = a.param_in != nullptr;
    const void* p_in = out_of_place ? a.param_in : a.param;
    const void* m_in = out_of_place ? a.exp_avg_in : a.exp_avg;
    const void* v_in = out_of_place ? a.exp_avg_sq_in : a.exp_avg_sq;
    const auto grad_at = [&](std::int64_t i) {
      return static_cast<const std::byte*>(a.grad) + static_cast<std::size_t>(i) * gsize;
    };
    const auto out_at = [&](std::int64_t i) -> void* {
      return a.param_out != nullptr
                 ? static_cast<std::byte*>(a.param_out) + static_cast<std::size_t>(i) * osize
                 : nullptr;
    };
    const bool half_master = a.master_dtype == DType::kBF16;
    const bool kahan = half_master && a.master_rounding == device::MasterRounding::kKahan;
    const bool half_state = a.state_dtype == DType::kBF16;
    const bool q8 = a.state_dtype == device::kAdam8StateDType;
    if (!half_master && !half_state && !q8) {
      for_each_tile(a.n, 1, [&](std::int64_t b, std::int64_t e) {
        kernel(AdamTile{static_cast<float*>(a.param) + b, grad_at(b),
                        static_cast<float*>(a.exp_avg) + b, static_cast<float*>(a.exp_avg_sq) + b,
                        out_at(b), e - b, static_cast<const float*>(p_in) + b,
                        static_cast<const float*>(m_in) + b, static_cast<const float*>(v_in) + b});
      });
      return;
    }
    const void* comp_in = out_of_place ? a.param_comp_in : a.param_comp;
    const float* m_scale_in = out_of_place ? a.exp_avg_scale_in : a.exp_avg_scale;
    const float* v_scale_in = out_of_place ? a.exp_avg_sq_scale_in : a.exp_avg_sq_scale;
    // 8-bit moments: tiles and chunks of whole blocks (kStateChunk is a multiple of one).
    static_assert(kStateChunk % device::kAdam8BlockElems == 0);
    for_each_tile(a.n, q8 ? device::kAdam8BlockElems : 1, [&](std::int64_t b, std::int64_t e) {
      alignas(64) float p[kStateChunk], m[kStateChunk], v[kStateChunk];
      for (std::int64_t c = b; c < e; c += kStateChunk) {
        const std::int64_t len = std::min(kStateChunk, e - c);
        float* pp = static_cast<float*>(a.param) + c;
        const float* pp_in = static_cast<const float*>(p_in) + c;
        if (half_master) {
          convert->bf16_to_f32(static_cast<const std::uint16_t*>(p_in) + c, p, len);
          if (kahan) add_compensation(static_cast<const bf16*>(comp_in) + c, p, len);
          pp = p;
          pp_in = p;
        }
        float* mm = static_cast<float*>(a.exp_avg) + c;
        float* vv = static_cast<float*>(a.exp_avg_sq) + c;
        const float* mm_in = static_cast<const float*>(m_in) + c;
        const float* vv_in = static_cast<const float*>(v_in) + c;
        if (half_state) {
          convert->bf16_to_f32(static_cast<const std::uint16_t*>(m_in) + c, m, len);
          convert->bf16_to_f32(static_cast<const std::uint16_t*>(v_in) + c, v, len);
        } else if (q8) {
          for_each_block(c, len, [&](std::int64_t at, std::int64_t block, std::int64_t n) {
            kernels.dequant8(q8_m.value, static_cast<const std::uint8_t*>(m_in) + at,
                             m_scale_in[block], n, false, m + (at - c));
            kernels.dequant8(q8_v.value, static_cast<const std::uint8_t*>(v_in) + at,
                             v_scale_in[block], n, true, v + (at - c));
          });
        }
        if (half_state || q8) {
          mm = m;
          mm_in = m;
          vv = v;
          vv_in = v;
        }
        kernel(AdamTile{pp, grad_at(c), mm, vv, half_master ? nullptr : out_at(c), len, pp_in,
                        mm_in, vv_in});
        if (half_state) {
          convert->f32_to_bf16(m, static_cast<std::uint16_t*>(a.exp_avg) + c, len);
          convert->f32_to_bf16(v, static_cast<std::uint16_t*>(a.exp_avg_sq) + c, len);
        } else if (q8) {
          for_each_block(c, len, [&](std::int64_t at, std::int64_t block, std::int64_t n) {
            kernels.quant8(q8_m, m + (at - c), n, static_cast<std::uint8_t*>(a.exp_avg) + at,
                           a.exp_avg_scale + block);
            kernels.quant8(q8_v, v + (at - c), n, static_cast<std::uint8_t*>(a.exp_avg_sq) + at,
                           a.exp_avg_sq_scale + block);
          });
        }
        if (half_master) store_master(a, c, len, p);
      }
    });
  }
  // Runs `kernel(tile)` over the span's tiles for a kernel that reads and writes bf16 moments
  // itself: the tile's moment pointers are the bf16 arrays' (as float*, offset in bf16 units).
  template <typename Kernel>
  void run_bf16_moment_tiles(const device::AdamWArgs& a, const Kernel& kernel) {
    const std::size_t gsize = dtype_size(a.grad_dtype);
    const std::size_t osize = a.param_out != nullptr ? dtype_size(a.out_dtype) : 0;
    const bool out_of_place = a.param_in != nullptr;
    const auto* p_in = static_cast<const float*>(out_of_place ? a.param_in : a.param);
    const auto* m_in = static_cast<const std::uint16_t*>(out_of_place ? a.exp_avg_in : a.exp_avg);
    const auto* v_in =
        static_cast<const std::uint16_t*>(out_of_place ? a.exp_avg_sq_in : a.exp_avg_sq);
    auto* m = static_cast<std::uint16_t*>(a.exp_avg);
    auto* v = static_cast<std::uint16_t*>(a.exp_avg_sq);
    const auto as_f32 = [](auto* p) {
      using F = std::conditional_t<std::is_const_v<std::remove_pointer_t<decltype(p)>>,
                                   const float*, float*>;
      return reinterpret_cast<F>(p);
    };
    for_each_tile(a.n, 1, [&](std::int64_t b, std::int64_t e) {
      const auto at = static_cast<std::size_t>(b);
      kernel(AdamTile{
          static_cast<float*>(a.param) + b, static_cast<const std::byte*>(a.grad) + at * gsize,
          as_f32(m + b), as_f32(v + b),
          a.param_out != nullptr ? static_cast<std::byte*>(a.param_out) + at * osize : nullptr,
          e - b, p_in + b, as_f32(m_in + b), as_f32(v_in + b)});
    });
  }
  // Runs `kernel(tile)` over the span's tiles of whole 8-bit blocks for a kernel that reads and
  // writes every array itself (detail::Adam8Kernel): master weights in their form, their
  // compensation, the moments' bytes and scales, the copy.
  template <typename Kernel>
  void run_adam8_tiles(const device::AdamWArgs& a, const Kernel& kernel) {
    const bool out_of_place = a.param_in != nullptr;
    const std::size_t gsize = dtype_size(a.grad_dtype);
    const std::size_t osize = a.param_out != nullptr ? dtype_size(a.out_dtype) : 0;
    const std::size_t psize = dtype_size(a.master_dtype);
    const bool kahan =
        a.master_dtype == DType::kBF16 && a.master_rounding == device::MasterRounding::kKahan;
    const void* p_in = out_of_place ? a.param_in : a.param;
    const void* comp_in = out_of_place ? a.param_comp_in : a.param_comp;
    const auto* m_in = static_cast<const std::uint8_t*>(out_of_place ? a.exp_avg_in : a.exp_avg);
    const auto* v_in =
        static_cast<const std::uint8_t*>(out_of_place ? a.exp_avg_sq_in : a.exp_avg_sq);
    const float* m_scale_in = out_of_place ? a.exp_avg_scale_in : a.exp_avg_scale;
    const float* v_scale_in = out_of_place ? a.exp_avg_sq_scale_in : a.exp_avg_sq_scale;
    for_each_tile(a.n, device::kAdam8BlockElems, [&](std::int64_t b, std::int64_t e) {
      const std::int64_t block = b / device::kAdam8BlockElems;
      const auto at = static_cast<std::size_t>(b);
      kernel(detail::Adam8Tile{
          .param = static_cast<std::byte*>(a.param) + at * psize,
          .param_in = static_cast<const std::byte*>(p_in) + at * psize,
          .param_comp = kahan ? static_cast<std::uint16_t*>(a.param_comp) + b : nullptr,
          .param_comp_in = kahan ? static_cast<const std::uint16_t*>(comp_in) + b : nullptr,
          .grad = static_cast<const std::byte*>(a.grad) + at * gsize,
          .param_out =
              a.param_out != nullptr ? static_cast<std::byte*>(a.param_out) + at * osize : nullptr,
          .exp_avg = static_cast<std::uint8_t*>(a.exp_avg) + b,
          .exp_avg_scale = a.exp_avg_scale + block,
          .exp_avg_sq = static_cast<std::uint8_t*>(a.exp_avg_sq) + b,
          .exp_avg_sq_scale = a.exp_avg_sq_scale + block,
          .exp_avg_in = m_in + b,
          .exp_avg_scale_in = m_scale_in + block,
          .exp_avg_sq_in = v_in + b,
          .exp_avg_sq_scale_in = v_scale_in + block,
          .n = e - b,
          .seed = a.rounding_seed,
          .first = a.element_offset + static_cast<std::uint64_t>(b)});
    });
  }
  // fn(first element, block index, elements) for each 8-bit block of [c, c + len) (c on a block
  // boundary of the span).
  template <typename Fn>
  static void for_each_block(std::int64_t c, std::int64_t len, const Fn& fn) {
    for (std::int64_t at = c; at < c + len; at += device::kAdam8BlockElems) {
      fn(at, at / device::kAdam8BlockElems, std::min(device::kAdam8BlockElems, c + len - at));
    }
  }
  // Kahan master weights: p[j] += the compensation (each weight is the pair's f32 sum).
  static void add_compensation(const bf16* comp, float* p, std::int64_t len) {
    for (std::int64_t j = 0; j < len; ++j) p[j] += bf16_to_f32(comp[j]);
  }
  // Stores `len` updated master weights from p (a chunk at element c) as master_rounding says,
  // leaving p the values stored, and writes the copy from them.
  void store_master(const device::AdamWArgs& a, std::int64_t c, std::int64_t len, float* p) const {
    auto* dst = static_cast<bf16*>(a.param) + c;
    if (a.master_rounding == device::MasterRounding::kKahan) {
      // Rounded to nearest, and what that dropped rounded toward zero (truncated), both bf16.
      convert->f32_to_bf16(p, reinterpret_cast<std::uint16_t*>(dst), len);
      auto* comp = static_cast<bf16*>(a.param_comp) + c;
      for (std::int64_t j = 0; j < len; ++j) {
        const float hi = bf16_to_f32(dst[j]);
        comp[j] = f32_to_bf16_toward_zero(p[j] - hi);
        p[j] = hi + bf16_to_f32(comp[j]);
      }
    } else {
      kernels.round_stochastic(p, len, a.rounding_seed,
                               a.element_offset + static_cast<std::uint64_t>(c),
                               reinterpret_cast<std::uint16_t*>(dst));
    }
    if (a.param_out == nullptr) return;
    const auto at = static_cast<std::size_t>(c);
    switch (a.out_dtype) {
      case DType::kF32:
        std::copy(p, p + len, static_cast<float*>(a.param_out) + at);
        break;
      case DType::kBF16:
        if (a.master_rounding == device::MasterRounding::kKahan) {
          convert->f32_to_bf16(p, static_cast<std::uint16_t*>(a.param_out) + at, len);
        } else {
          std::copy(dst, dst + len, static_cast<bf16*>(a.param_out) + at);
        }
        break;
      default:
        convert->f32_to_f16(p, static_cast<std::uint16_t*>(a.param_out) + at, len);
        break;
    }
  }
};

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t m = v.size() / 2;
  return v.size() % 2 == 1 ? v[m] : 0.5 * (v[m - 1] + v[m]);
}

}  // namespace

// Chooses streaming stores and prefetch from the first large steps themselves: the real arrays,
// sizes and layout, which a synthetic buffer does not reproduce (on an AMD Zen 3, prefetch made a
// 3.7M-element calibration pass 4% faster and a 64M-element step 1.35x faster). Each step of at
// least tune_min_elems elements runs the open variant with the fewest samples and reports its
// time per element; after the first round, variants more than 15% slower than the fastest are
// dropped; once every open variant has kSamples, the fastest by median is kept if it beats the
// baseline (regular stores, no prefetch, or the first variant open) by more than 1%. Every
// variant writes the same bytes, so only the first steps' speed depends on this. Shared by every
// CpuAdam of one path, bf16 conversion, thread count and open variants in the process.
namespace detail {

class Tuner {
 public:
  struct Variant {
    int nt, pf;
  };
  static constexpr int kSamples = 5;

  explicit Tuner(const CpuAdamOptions& o) {
    for (int nt = 0; nt < 2; ++nt) {
      if (o.stores != CpuAdamOptions::Stores::kAuto &&
          nt != (o.stores == CpuAdamOptions::Stores::kStreaming ? 1 : 0)) {
        continue;
      }
      for (int pf = 0; pf < 2; ++pf) {
        if (o.prefetch != CpuAdamOptions::Prefetch::kAuto &&
            pf != (o.prefetch == CpuAdamOptions::Prefetch::kOn ? 1 : 0)) {
          continue;
        }
        variants_.push_back({nt, pf});
      }
    }
    samples_.resize(variants_.size());
    open_.assign(variants_.size(), true);
  }

  // The variant for the next large step: the choice once made, else the next one to time.
  // Returns its index, or -1 when the choice is made (then *chosen holds it).
  int next(Variant* chosen) {
    const std::lock_guard<std::mutex> lock(mu_);
    if (result_) {
      *chosen = {result_->streaming ? 1 : 0, result_->prefetch ? 1 : 0};
      return -1;
    }
    int best = -1;
    for (std::size_t k = 0; k < variants_.size(); ++k) {
      if (open_[k] &&
          (best < 0 || samples_[k].size() < samples_[static_cast<std::size_t>(best)].size())) {
        best = static_cast<int>(k);
      }
    }
    *chosen = variants_[static_cast<std::size_t>(best)];
    return best;
  }

  void report(int k, double ns_per_elem) {
    const std::lock_guard<std::mutex> lock(mu_);
    if (result_) return;
    samples_[static_cast<std::size_t>(k)].push_back(ns_per_elem);
    if (!pruned_ &&
        std::all_of(samples_.begin(), samples_.end(), [](const auto& v) { return !v.empty(); })) {
      double fastest = samples_[0][0];
      for (const auto& v : samples_) fastest = std::min(fastest, v[0]);
      for (std::size_t j = 0; j < samples_.size(); ++j) open_[j] = samples_[j][0] <= 1.15 * fastest;
      open_[0] = true;  // the baseline always stays, for the comparison
      pruned_ = true;
    }
    for (std::size_t j = 0; j < samples_.size(); ++j) {
      if (open_[j] && samples_[j].size() < kSamples) return;
    }
    KernelCalibration c;
    const double base = median(samples_[0]);
    std::size_t best = 0;
    double best_m = base;
    for (std::size_t j = 0; j < samples_.size(); ++j) {
      const double m = median(samples_[j]);
      c.ns_per_elem[variants_[j].nt][variants_[j].pf] = m;
      if (open_[j] && m < 0.99 * base && m < best_m) best = j, best_m = m;
    }
    c.streaming = variants_[best].nt == 1;
    c.prefetch = variants_[best].pf == 1;
    result_ = c;
  }

  const KernelCalibration* result() const {
    const std::lock_guard<std::mutex> lock(mu_);
    return result_ ? &*result_ : nullptr;
  }

 private:
  mutable std::mutex mu_;
  std::vector<Variant> variants_;
  std::vector<std::vector<double>> samples_;
  std::vector<bool> open_;
  bool pruned_ = false;
  std::optional<KernelCalibration> result_;
};

}  // namespace detail

namespace {

// The one process-wide state in the optimizer: which variant is fastest is a property of the
// machine, found once and shared. Never destroyed, so no CpuAdam can outlive its tuner.
detail::Tuner* shared_tuner(SimdPath path, bool native_bf16, int threads, const CpuAdamOptions& o) {
  using Key = std::tuple<int, bool, int, int, int>;
  static std::mutex mu;
  static auto* tuners = new std::map<Key, std::unique_ptr<detail::Tuner>>();
  const std::lock_guard<std::mutex> lock(mu);
  std::unique_ptr<detail::Tuner>& t =
      (*tuners)[{static_cast<int>(path), native_bf16, threads, static_cast<int>(o.stores),
                 static_cast<int>(o.prefetch)}];
  if (t == nullptr) t = std::make_unique<detail::Tuner>(o);
  return t.get();
}

}  // namespace

void CpuAdam::Impl::adopt_if_chosen() {
  if (tuner == nullptr) return;
  if (const KernelCalibration* r = tuner->result()) {
    streaming = r->streaming;
    prefetch = r->prefetch;
    tuned = r;
    tuner = nullptr;
  }
}

CpuAdam::CpuAdam(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CpuAdam::CpuAdam(CpuAdam&&) noexcept = default;
CpuAdam& CpuAdam::operator=(CpuAdam&&) noexcept = default;
CpuAdam::~CpuAdam() = default;

Result<CpuAdam> CpuAdam::create(const CpuAdamOptions& options) {
  if (options.threads < 0) {
    return invalid_argument("CpuAdam threads " + std::to_string(options.threads) +
                            " is negative; use 0 for one per core or a positive count");
  }
  if (options.tile_elems < 64 || options.tile_elems % 64 != 0) {
    return invalid_argument("CpuAdam tile_elems " + std::to_string(options.tile_elems) +
                            " must be a positive multiple of 64 (one cache line of any dtype)");
  }
  STRATA_ASSIGN_OR_RETURN(SimdPath path, sys::resolve_simd_path(options.simd, "simd option"));
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  impl->path = path;
  impl->threads = options.threads > 0 ? options.threads : std::max(1, sys::cpu_topology().cores);
  impl->convert = &device::cpu::cpu_kernels_for(path);
  impl->q8_m = detail::quant8_search(/*second=*/false);
  impl->q8_v = detail::quant8_search(/*second=*/true);
  switch (path) {
    case SimdPath::kScalar:
      detail::fill_scalar_kernels(&impl->kernels);
      break;
    case SimdPath::kAvx2:
      detail::fill_avx2_kernels(&impl->kernels);
      break;
    case SimdPath::kAvx512:
      impl->native_bf16 = options.native_bf16 && sys::cpu_supports_avx512_bf16();
      detail::fill_avx512_kernels(&impl->kernels, impl->native_bf16);
      break;
  }
  if (impl->threads > 1) {
    impl->arena.initialize(impl->threads);
    if (options.pin_threads) impl->pinning = detail::ArenaPinning::create(impl->arena);
  }
  using Stores = CpuAdamOptions::Stores;
  using Prefetch = CpuAdamOptions::Prefetch;
  // The scalar path has neither streaming stores nor prefetch: nothing to choose.
  if (path != SimdPath::kScalar) {
    impl->streaming = options.stores == Stores::kStreaming;
    impl->prefetch = options.prefetch == Prefetch::kOn;
    if (options.stores == Stores::kAuto || options.prefetch == Prefetch::kAuto) {
      impl->tuner = shared_tuner(path, impl->native_bf16, impl->threads, options);
      impl->adopt_if_chosen();  // another CpuAdam of this kind may have chosen already
    }
  }
  return CpuAdam(std::move(impl));
}

StepOutcome CpuAdam::step(const device::AdamWArgs& args, bool check_finite) {
  check_args(args);
  if (args.n == 0) return StepOutcome::kUpdated;
  Impl& s = *impl_;
  const int g = grad_kind(args.grad_dtype);
  // bf16 master weights: the copy is written from the value stored, after the kernel.
  const int o = args.master_dtype == DType::kF32 ? out_kind(args) : detail::kOutNone;
  if (check_finite && !all_finite(args.grad, args.grad_dtype, args.n)) {
    return StepOutcome::kSkippedNonFinite;
  }
  const AdamConstants c = device::adamw_constants(args);
  // bf16 moments with f32 master weights: read and written as bf16 by the kernel itself where
  // the ISA has one (the tuner's variants are of f32 state; these use regular stores).
  if (args.state_dtype == DType::kBF16 && args.master_dtype == DType::kF32) {
    if (const detail::AdamKernel fused =
            s.kernels.adam_bf16_moments[g][o][args.adamw_mode ? 1 : 0]) {
      s.run_bf16_moment_tiles(args, [&](const AdamTile& t) { fused(c, t); });
      return StepOutcome::kUpdated;
    }
  }
  // 8-bit moments: every array read and written by the ISA's kernel for them where it has one
  // (the tuner's variants are of f32 state; this kernel's stores are regular).
  if (args.state_dtype == device::kAdam8StateDType) {
    const detail::MasterKind master = args.master_dtype == DType::kF32 ? detail::kMasterF32
                                      : args.master_rounding == device::MasterRounding::kKahan
                                          ? detail::kMasterKahan
                                          : detail::kMasterStochastic;
    if (const detail::Adam8Kernel fused =
            s.kernels.adam8[g][out_kind(args)][args.adamw_mode ? 1 : 0][master]) {
      s.run_adam8_tiles(args, [&](const detail::Adam8Tile& t) { fused(c, s.q8_m, s.q8_v, t); });
      return StepOutcome::kUpdated;
    }
  }
  s.adopt_if_chosen();
  bool streaming = s.streaming, prefetch = s.prefetch;
  int sample = -1;  // the tuner's variant this step is timed for, if any
  if (s.tuner != nullptr && args.n >= s.tune_min_elems()) {
    detail::Tuner::Variant v{};
    sample = s.tuner->next(&v);
    streaming = v.nt == 1;
    prefetch = v.pf == 1;
  }
  const detail::AdamKernel kernel =
      s.kernels.adam[g][o][args.adamw_mode ? 1 : 0][s.nt_index(streaming, args)][prefetch];
  const auto t0 = sample >= 0 ? std::chrono::steady_clock::now()  // timed for the tuner only
                              : std::chrono::steady_clock::time_point{};
  s.run_tiles(args, [&](const AdamTile& t) { kernel(c, t); });
  if (sample >= 0) {
    const std::chrono::duration<double, std::nano> took = std::chrono::steady_clock::now() - t0;
    s.tuner->report(sample, took.count() / static_cast<double>(args.n));
    s.adopt_if_chosen();  // this sample may have completed the choice
  }
  return StepOutcome::kUpdated;
}

bool CpuAdam::all_finite(const void* grad, DType grad_dtype, std::int64_t n) {
  STRATA_CHECK(n >= 0 && (n == 0 || grad != nullptr), "CpuAdam::all_finite: bad span", n);
  const detail::FiniteKernel kernel = impl_->kernels.all_finite[grad_kind(grad_dtype)];
  const std::size_t size = dtype_size(grad_dtype);
  std::atomic<bool> bad{false};
  impl_->for_each_tile(n, 1, [&](std::int64_t b, std::int64_t e) {
    if (bad.load(std::memory_order_relaxed)) return;
    const auto* p = static_cast<const std::byte*>(grad) + static_cast<std::size_t>(b) * size;
    if (!kernel(p, e - b)) bad.store(true, std::memory_order_relaxed);
  });
  return !bad.load();
}

void CpuAdam::memory_roofline(const device::AdamWArgs& args) {
  check_args(args);
  Impl& s = *impl_;
  s.adopt_if_chosen();
  const detail::RooflineKernel kernel =
      s.kernels.roofline[grad_kind(args.grad_dtype)]
                        [args.master_dtype == DType::kF32 ? out_kind(args) : detail::kOutNone]
                        [s.nt_index(s.streaming, args)][s.prefetch ? 1 : 0];
  s.run_tiles(args, [&](const AdamTile& t) { kernel(t); });
}

SimdPath CpuAdam::simd() const { return impl_->path; }
bool CpuAdam::uses_native_bf16() const { return impl_->native_bf16; }
bool CpuAdam::uses_streaming_stores() const {
  impl_->adopt_if_chosen();
  return impl_->streaming;
}
bool CpuAdam::uses_prefetch() const {
  impl_->adopt_if_chosen();
  return impl_->prefetch;
}
const KernelCalibration* CpuAdam::calibration() const {
  impl_->adopt_if_chosen();
  return impl_->tuned;
}
int CpuAdam::threads() const { return impl_->threads; }
const CpuAdamOptions& CpuAdam::options() const { return impl_->options; }

}  // namespace strata::optim
