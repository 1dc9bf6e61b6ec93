// CpuAdam against the memory system: params/s and effective GB/s for 1, 2 and all threads, each
// timed in alternating pairs with a roofline kernel that moves exactly the same bytes; NT vs
// regular stores; scalar vs SIMD; a STREAM triad; and the NVMe-streamed step against the same
// reads and writes through the swap space with no arithmetic.
//
// This machine's memory bandwidth flips between two modes every few tens of seconds, so every
// ratio comes from pairs run back to back (A B, then B A) inside one benchmark; absolute GB/s
// are only indicative. Buffers are allocated and pre-faulted once (2 MiB aligned, transparent
// huge pages requested) and reused by every benchmark.
//
//   build-adam/bench/bench_cpu_adam --benchmark_counters_tabular=true
//   ... --benchmark_filter=Adam/ --benchmark_format=json   (counters in JSON)
#include <benchmark/benchmark.h>
#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/parallel_for.h>
#include <oneapi/tbb/partitioner.h>
#include <oneapi/tbb/task_arena.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "strata/core/aligned.h"
#include "strata/core/check.h"
#include "strata/core/dtype.h"
#include "strata/device/adam8bit.h"
#include "strata/device/device.h"
#include "strata/io/swap.h"
#include "strata/mem/tiered_store.h"
#include "strata/optim/cpu_adam.h"
#include "strata/optim/state_layout.h"
#include "strata/optim/streamed_adam.h"
#include "strata/sys/process.h"

namespace {

using strata::DType;
using strata::optim::CpuAdam;
using strata::optim::CpuAdamOptions;

constexpr std::int64_t kMega = 1 << 20;
constexpr std::int64_t kMaxParams = 256 * kMega;
constexpr std::int64_t kVerifyElems = 1 * kMega + 37;

double seconds_of(const auto& fn) {
  const auto t0 = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Anonymous memory, 2 MiB aligned, huge pages requested, every page touched once.
class BigBuffer {
 public:
  explicit BigBuffer(std::size_t bytes) : bytes_(bytes) {
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    ::madvise(p, bytes, MADV_HUGEPAGE);  // a hint: fine if refused
    data_ = static_cast<std::byte*>(p);
  }
  ~BigBuffer() { ::munmap(data_, bytes_); }
  BigBuffer(const BigBuffer&) = delete;
  BigBuffer& operator=(const BigBuffer&) = delete;
  template <typename T>
  T* as() const {
    return reinterpret_cast<T*>(data_);
  }

 private:
  std::byte* data_;
  std::size_t bytes_;
};

// Adam state for `params` parameters, filled in parallel with positive, normal-range values
// (roofline passes add the gradient to every array, so nothing drifts to NaN or subnormal). The
// arrays share one mapping, each starting `stagger_bytes` after the end of the one before: with
// one page, their addresses differ in the low bits as the engine's own buffers do; with 0, every
// array starts a power of two of bytes after the last, like equal-sized buffers each mmap'd on
// its own, whose lines some CPUs cannot hold in L1 at once (the AdamCongruentArrays case).
struct Arrays {
  Arrays(std::int64_t params, std::size_t stagger_bytes)
      : params_(params),
        f32_bytes_(static_cast<std::size_t>(params) * 4),
        stagger_(stagger_bytes),
        buffer_(6 * (f32_bytes_ + stagger_bytes)) {
    tbb::parallel_for(tbb::blocked_range<std::int64_t>(0, params, 1 << 16), [&](auto r) {
      for (std::int64_t i = r.begin(); i < r.end(); ++i) {
        const auto h = static_cast<std::uint32_t>((i * 2654435761u) >> 8) & 0xffff;
        const float g = 1e-4f + 9e-4f * static_cast<float>(h) / 65536.0f;
        master()[i] = 0.5f + static_cast<float>(h) / 65536.0f;
        exp_avg()[i] = g;
        exp_avg_sq()[i] = g * g;
        grad_f32()[i] = g;
        grad_bf16()[i] = strata::f32_to_bf16(g).bits;
        out()[i] = 0;
      }
    });
  }

  float* array(int k) const {
    return buffer_.as<float>() + static_cast<std::size_t>(k) * (f32_bytes_ + stagger_) / 4;
  }
  float* master() const { return array(0); }
  float* exp_avg() const { return array(1); }
  float* exp_avg_sq() const { return array(2); }
  float* grad_f32() const { return array(3); }
  std::uint16_t* grad_bf16() const { return reinterpret_cast<std::uint16_t*>(array(4)); }
  std::uint32_t* out() const { return reinterpret_cast<std::uint32_t*>(array(5)); }

  strata::device::AdamWArgs args(std::int64_t n, DType grad_dtype, DType out_dtype) const {
    STRATA_CHECK(n <= params_, "benchmark span larger than its arrays", n, params_);
    strata::device::AdamWArgs a;
    a.lr = 1e-3f;
    a.weight_decay = 0.01f;
    a.step = 10;
    a.param = master();
    a.exp_avg = exp_avg();
    a.exp_avg_sq = exp_avg_sq();
    a.grad = grad_dtype == DType::kF32 ? static_cast<void*>(grad_f32()) : grad_bf16();
    a.grad_dtype = grad_dtype;
    a.param_out = out();
    a.out_dtype = out_dtype;
    a.n = n;
    return a;
  }

 private:
  std::int64_t params_;
  std::size_t f32_bytes_, stagger_;
  BigBuffer buffer_;
};

// Owns what the benchmarks share; lives in main (no mutable globals).
struct Context {
  std::optional<Arrays> arrays_, congruent_;
  int all_threads = strata::sys::cpu_topology().cores;
  Arrays& arrays() {
    if (!arrays_) arrays_.emplace(kMaxParams, strata::kPageBytes);
    return *arrays_;
  }
  Arrays& congruent_arrays() {
    if (!congruent_) congruent_.emplace(64 * kMega, 0);
    return *congruent_;
  }
};

// Bytes read + written per element by one Adam step: master, exp_avg, exp_avg_sq read and
// written (24), the gradient read, the half-precision copy written.
double bytes_per_elem(DType grad_dtype, DType out_dtype) {
  return 24.0 + static_cast<double>(strata::dtype_size(grad_dtype)) +
         static_cast<double>(strata::dtype_size(out_dtype));
}

using Stores = CpuAdamOptions::Stores;
using Prefetch = CpuAdamOptions::Prefetch;

strata::Result<CpuAdam> make_adam(int threads, const char* simd, Stores stores,
                                  Prefetch prefetch = Prefetch::kAuto) {
  CpuAdamOptions o;
  o.threads = threads;
  o.simd = simd;
  o.stores = stores;
  o.prefetch = prefetch;
  return CpuAdam::create(o);
}

// A CpuAdam with kAuto options chooses its variant on its first large steps (the choice is then
// shared by every instance of its kind in the process); run them before timing anything.
void finish_tuning(CpuAdam& adam, const strata::device::AdamWArgs& args) {
  for (int i = 0; i < 32 && adam.calibration() == nullptr; ++i) {  // 4 variants x 5 samples
    benchmark::DoNotOptimize(adam.step(args, /*check_finite=*/false));
  }
}

// Checks the benchmarked configuration against the reference on a slice, before any timing.
bool verify(benchmark::State& state, CpuAdam& adam, const strata::device::AdamWArgs& full) {
  strata::device::AdamWArgs a = full;
  a.n = kVerifyElems;
  // The benchmark's master weights and moments are f32.
  const auto* p0 = static_cast<const float*>(a.param);
  const auto* m0 = static_cast<const float*>(a.exp_avg);
  const auto* v0 = static_cast<const float*>(a.exp_avg_sq);
  std::vector<float> p(p0, p0 + a.n), m(m0, m0 + a.n), v(v0, v0 + a.n);
  std::vector<std::byte> out(static_cast<std::size_t>(a.n) * strata::dtype_size(a.out_dtype));
  strata::device::AdamWArgs r = a;
  r.param = p.data(), r.exp_avg = m.data(), r.exp_avg_sq = v.data(), r.param_out = out.data();
  strata::device::adamw_reference(r);
  if (adam.step(a) != strata::optim::StepOutcome::kUpdated ||
      std::memcmp(a.param, p.data(), p.size() * 4) != 0 ||
      std::memcmp(a.exp_avg, m.data(), m.size() * 4) != 0 ||
      std::memcmp(a.exp_avg_sq, v.data(), v.size() * 4) != 0 ||
      std::memcmp(a.param_out, out.data(), out.size()) != 0) {
    state.SkipWithError("CpuAdam differs from device::adamw_reference");
    return false;
  }
  return true;
}

// Runs `a` and `b` once per iteration, alternating which goes first; the iteration's manual
// time is a's. Ratios are medians of the per-pair ratios: a burst from a neighbour (the machine
// and its disk are shared) spoils one pair, not the figure.
struct PairTimes {
  double a_s = 0, b_s = 0;  // sums
  double n = 0;
  std::vector<double> b_over_a;
  double median_b_over_a() const {
    std::vector<double> r = b_over_a;
    std::sort(r.begin(), r.end());
    const std::size_t m = r.size() / 2;
    return r.size() % 2 == 1 ? r[m] : 0.5 * (r[m - 1] + r[m]);
  }
};

PairTimes run_pairs(benchmark::State& state, const auto& a, const auto& b) {
  PairTimes t;
  for (auto _ : state) {
    double ta, tb;
    if (static_cast<std::int64_t>(t.n) % 2 == 0) {
      ta = seconds_of(a);
      tb = seconds_of(b);
    } else {
      tb = seconds_of(b);
      ta = seconds_of(a);
    }
    t.a_s += ta;
    t.b_s += tb;
    t.n += 1;
    t.b_over_a.push_back(tb / ta);
    state.SetIterationTime(ta);
  }
  return t;
}

void set_rate_counters(benchmark::State& state, const PairTimes& t, std::int64_t n,
                       double bytes_per) {
  state.counters["GBps"] = bytes_per * static_cast<double>(n) * t.n / t.a_s / 1e9;
  state.counters["params_per_s"] = static_cast<double>(n) * t.n / t.a_s;
}

// Adam and then every roofline variant (streaming or regular stores, with and without
// prefetch), rotating which runs first. Per iteration the roofline is the fastest variant (the
// tightest bound any store and prefetch policy gives), so
// ratio_to_roofline = median(min(roofline times) / Adam time).
PairTimes run_against_best_roofline(benchmark::State& state, const std::function<void()>& adam,
                                    const std::vector<std::function<void()>>& rooflines) {
  PairTimes t;
  const std::size_t kinds = rooflines.size() + 1;
  for (auto _ : state) {
    std::vector<double> s(kinds);
    for (std::size_t j = 0; j < kinds; ++j) {
      const std::size_t k = (j + static_cast<std::size_t>(t.n)) % kinds;
      s[k] = seconds_of(k == 0 ? adam : rooflines[k - 1]);
    }
    const double best = *std::min_element(s.begin() + 1, s.end());
    t.a_s += s[0];
    t.b_s += best;
    t.n += 1;
    t.b_over_a.push_back(best / s[0]);
    state.SetIterationTime(s[0]);
  }
  return t;
}

// Adam vs the roofline moving the same bytes: ratio_to_roofline = roofline time / Adam time.
void bm_adam(benchmark::State& state, Context* ctx, DType grad_dtype, std::int64_t n, int threads,
             bool congruent) {
  auto adam = make_adam(threads, "auto", Stores::kAuto);  // the default options
  if (!adam.is_ok()) return state.SkipWithError(adam.status().to_string().c_str());
  std::vector<CpuAdam> bounds;
  for (Stores stores : {Stores::kRegular, Stores::kStreaming}) {
    for (Prefetch prefetch : {Prefetch::kOff, Prefetch::kOn}) {
      auto b = make_adam(threads, "auto", stores, prefetch);
      if (!b.is_ok()) return state.SkipWithError(b.status().to_string().c_str());
      bounds.push_back(std::move(*b));
    }
  }
  const Arrays& arrays = congruent ? ctx->congruent_arrays() : ctx->arrays();
  const auto args = arrays.args(n, grad_dtype, DType::kBF16);
  finish_tuning(*adam, args);
  if (!verify(state, *adam, args)) return;
  std::vector<std::function<void()>> rooflines;
  for (CpuAdam& b : bounds) rooflines.emplace_back([&b, &args] { b.memory_roofline(args); });
  const PairTimes t = run_against_best_roofline(
      state, [&] { benchmark::DoNotOptimize(adam->step(args, /*check_finite=*/false)); },
      rooflines);
  const double bytes = bytes_per_elem(grad_dtype, DType::kBF16);
  set_rate_counters(state, t, n, bytes);
  state.counters["ratio_to_roofline"] = t.median_b_over_a();
  state.counters["roofline_GBps"] = bytes * static_cast<double>(n) * t.n / t.b_s / 1e9;
  state.SetLabel(std::string(strata::sys::simd_path_name(adam->simd())) +
                 (adam->uses_native_bf16() ? "+bf16" : "") +
                 (adam->uses_streaming_stores() ? " streaming" : " regular") +
                 (adam->uses_prefetch() ? "+prefetch" : ""));
  if (const auto* c = adam->calibration()) {  // what the first steps measured, ns per element
    state.counters["tuned_regular_ns"] = c->ns_per_elem[0][0];
    state.counters["tuned_prefetch_ns"] = c->ns_per_elem[0][1];
    state.counters["tuned_streaming_ns"] = c->ns_per_elem[1][0];
    state.counters["tuned_streaming_prefetch_ns"] = c->ns_per_elem[1][1];
  }
}

// CpuAdam over compact optimizer state (optimizer.state_dtype bf16 or int8, master_dtype bf16
// with stochastic or Kahan rounding) against the roofline of the bytes it touches: the f32
// roofline kernel (read every array, write every array) over as many elements as move the same
// bytes, n x the setting's bytes per element / the f32 step's 28, in alternating pairs.
// ratio_to_roofline = roofline time / Adam time. bf16 gradient, bf16 copy.
void bm_adam_compact(benchmark::State& state, Context* ctx, std::int64_t n, int threads,
                     DType master_dtype, strata::device::MasterRounding rounding,
                     DType state_dtype) {
  using strata::optim::StateLayout;
  auto adam = make_adam(threads, "auto", Stores::kAuto);
  auto bound = make_adam(threads, "auto", Stores::kAuto);
  if (!adam.is_ok() || !bound.is_ok()) return state.SkipWithError("CpuAdam::create failed");
  const Arrays& arrays = ctx->arrays();
  const StateLayout ml = strata::optim::master_layout(master_dtype, rounding);
  const StateLayout sl = strata::optim::moment_layout(state_dtype);
  BigBuffer master(ml.bytes(n)), m(sl.bytes(n)), v(sl.bytes(n));
  // The arrays' f32 values, stored as the setting stores them (a block at a time for int8).
  tbb::parallel_for(tbb::blocked_range<std::int64_t>(0, n, 1 << 16), [&](auto r) {
    const std::int64_t b = r.begin(), len = r.end() - r.begin();
    if (master_dtype == DType::kF32) {
      std::memcpy(master.as<float>() + b, arrays.master() + b, static_cast<std::size_t>(len) * 4);
    } else {
      strata::convert(arrays.master() + b, DType::kF32, master.as<std::uint16_t>() + b,
                      DType::kBF16, static_cast<std::size_t>(len));
    }
    const auto moment = [&](const float* x, bool second, const BigBuffer& out) {
      if (state_dtype == DType::kBF16) {
        strata::convert(x + b, DType::kF32, out.as<std::uint16_t>() + b, DType::kBF16,
                        static_cast<std::size_t>(len));
      } else if (state_dtype == DType::kF32) {
        std::memcpy(out.as<float>() + b, x + b, static_cast<std::size_t>(len) * 4);
      } else {
        strata::device::adam8_quantize_array(
            x + b, len, second, out.as<std::uint8_t>() + b,
            reinterpret_cast<float*>(out.as<std::byte>() + sl.aux_offset(n)) +
                b / strata::device::kAdam8BlockElems);
      }
    };
    moment(arrays.exp_avg(), false, m);
    moment(arrays.exp_avg_sq(), true, v);
  });
  if (ml.has_aux())
    std::memset(master.as<std::byte>() + ml.aux_offset(n), 0, ml.aux_plane_bytes(n));
  strata::device::AdamWArgs args = arrays.args(n, DType::kBF16, DType::kBF16);
  args.master_dtype = master_dtype;
  args.master_rounding = rounding;
  args.state_dtype = state_dtype;
  args.param = master.as<void>();
  args.exp_avg = m.as<void>();
  args.exp_avg_sq = v.as<void>();
  args.rounding_seed = 7;
  strata::optim::attach_aux_planes(args, n, args.param, args.exp_avg, args.exp_avg_sq);
  // The state read and written, the bf16 gradient read and the bf16 copy written.
  const double bytes =
      2 * strata::optim::state_bytes_per_param(master_dtype, rounding, state_dtype) + 2 + 2;
  const double f32_bytes = bytes_per_elem(DType::kBF16, DType::kBF16);
  const auto roof_n = static_cast<std::int64_t>(static_cast<double>(n) * bytes / f32_bytes);
  const auto roof = arrays.args(roof_n, DType::kBF16, DType::kBF16);
  finish_tuning(*adam, args);
  finish_tuning(*bound, roof);
  const PairTimes t = run_pairs(
      state, [&] { benchmark::DoNotOptimize(adam->step(args, /*check_finite=*/false)); },
      [&] { bound->memory_roofline(roof); });
  set_rate_counters(state, t, n, bytes);
  state.counters["bytes_per_param"] = bytes;
  state.counters["ratio_to_roofline"] = t.median_b_over_a();
  state.counters["roofline_GBps"] = f32_bytes * static_cast<double>(roof_n) * t.n / t.b_s / 1e9;
  state.SetLabel(std::string(strata::sys::simd_path_name(adam->simd())));
}

// What Adam's arithmetic alone costs: the f32 step over spans small enough to stay in the L2
// caches (128K elements, 2.5 MiB with the gradient and the copy), repeated to cover n elements,
// paired with the roofline kernel moving n elements' f32 bytes from memory.
// roofline_over_arithmetic near or above 1 means the arithmetic (a division and a square root
// per element, exact) takes as long as the memory: a floor under every setting's Adam time,
// however few bytes it moves.
void bm_adam_arithmetic(benchmark::State& state, Context* ctx, std::int64_t n, int threads) {
  auto adam = make_adam(threads, "auto", Stores::kRegular, Prefetch::kOff);
  auto bound = make_adam(threads, "auto", Stores::kAuto);
  if (!adam.is_ok() || !bound.is_ok()) return state.SkipWithError("CpuAdam::create failed");
  const Arrays& arrays = ctx->arrays();
  constexpr std::int64_t kSpan = 128 * 1024;
  const auto small = arrays.args(kSpan, DType::kBF16, DType::kBF16);
  const auto roof = arrays.args(n, DType::kBF16, DType::kBF16);
  finish_tuning(*bound, roof);
  const PairTimes t = run_pairs(
      state,
      [&] {
        for (std::int64_t done = 0; done < n; done += kSpan) {
          benchmark::DoNotOptimize(adam->step(small, /*check_finite=*/false));
        }
      },
      [&] { bound->memory_roofline(roof); });
  set_rate_counters(state, t, n, bytes_per_elem(DType::kBF16, DType::kBF16));
  state.counters["roofline_over_arithmetic"] = t.median_b_over_a();
}

// The same Adam with the finite-gradient pre-scan on (its extra read is not in the roofline).
void bm_adam_checked(benchmark::State& state, Context* ctx, std::int64_t n, int threads) {
  auto adam = make_adam(threads, "auto", Stores::kAuto);
  if (!adam.is_ok()) return state.SkipWithError(adam.status().to_string().c_str());
  const auto args = ctx->arrays().args(n, DType::kF32, DType::kBF16);
  finish_tuning(*adam, args);
  const PairTimes t = run_pairs(
      state, [&] { benchmark::DoNotOptimize(adam->step(args, /*check_finite=*/true)); },
      [&] { adam->memory_roofline(args); });
  set_rate_counters(state, t, n, bytes_per_elem(DType::kF32, DType::kBF16));
  state.counters["ratio_to_roofline"] = t.median_b_over_a();
}

// Non-temporal vs regular stores, Adam against Adam, both without prefetch:
// nt_speedup = regular time / NT time.
void bm_nontemporal(benchmark::State& state, Context* ctx, std::int64_t n, int threads) {
  auto nt = make_adam(threads, "auto", Stores::kStreaming, Prefetch::kOff);
  auto regular = make_adam(threads, "auto", Stores::kRegular, Prefetch::kOff);
  if (!nt.is_ok() || !regular.is_ok()) return state.SkipWithError("CpuAdam::create failed");
  const auto args = ctx->arrays().args(n, DType::kF32, DType::kBF16);
  if (!verify(state, *nt, args)) return;
  const PairTimes t = run_pairs(
      state, [&] { benchmark::DoNotOptimize(nt->step(args, false)); },
      [&] { benchmark::DoNotOptimize(regular->step(args, false)); });
  set_rate_counters(state, t, n, bytes_per_elem(DType::kF32, DType::kBF16));
  state.counters["nt_speedup"] = t.median_b_over_a();
}

// SIMD vs the scalar path: simd_speedup = scalar time / SIMD time.
void bm_scalar_vs_simd(benchmark::State& state, Context* ctx, std::int64_t n, int threads) {
  auto simd = make_adam(threads, "auto", Stores::kAuto);
  auto scalar = make_adam(threads, "scalar", Stores::kAuto);
  if (!simd.is_ok() || !scalar.is_ok()) return state.SkipWithError("CpuAdam::create failed");
  const auto args = ctx->arrays().args(n, DType::kF32, DType::kBF16);
  finish_tuning(*simd, args);
  const PairTimes t = run_pairs(
      state, [&] { benchmark::DoNotOptimize(simd->step(args, false)); },
      [&] { benchmark::DoNotOptimize(scalar->step(args, false)); });
  set_rate_counters(state, t, n, bytes_per_elem(DType::kF32, DType::kBF16));
  state.counters["simd_speedup"] = t.median_b_over_a();
  state.SetLabel("scalar vs " + std::string(strata::sys::simd_path_name(simd->simd())));
}

// DeepSpeed's CPU Adam (since 2024) updates the fp32 state only and leaves the bf16 copy to a
// second cast pass. That shape, with the same SIMD Adam and a vectorized cast, against the fused
// pass: fused_speedup = (Adam without output + cast) time / fused Adam time. The casts are the
// only code here with their own ISA: function-level targets, entered after CPUID says so.
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) void cast_to_bf16_avx512(
    const float* src, std::uint16_t* dst, std::int64_t n) {
  std::int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256bh h = _mm512_cvtneps_pbh(_mm512_loadu_ps(src + i));
    std::memcpy(dst + i, &h, sizeof(h));
  }
  for (; i < n; ++i) dst[i] = strata::f32_to_bf16(src[i]).bits;
}

// Round to nearest even on the bits (finite inputs: the benchmark's values are).
__attribute__((target("avx2"))) void cast_to_bf16_avx2(const float* src, std::uint16_t* dst,
                                                       std::int64_t n) {
  std::int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i u = _mm256_castps_si256(_mm256_loadu_ps(src + i));
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(
        _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)), 16);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
  }
  for (; i < n; ++i) dst[i] = strata::f32_to_bf16(src[i]).bits;
}

void bm_fused_vs_separate_cast(benchmark::State& state, Context* ctx, std::int64_t n, int threads) {
  const bool avx512_bf16 = strata::sys::cpu_supports_avx512_bf16();
  if (!avx512_bf16 && !strata::sys::cpu_supports(strata::sys::SimdPath::kAvx2)) {
    return state.SkipWithError("the separate cast pass here needs AVX2 or avx512_bf16");
  }
  const auto cast_to_bf16 = avx512_bf16 ? cast_to_bf16_avx512 : cast_to_bf16_avx2;
  auto adam = make_adam(threads, "auto", Stores::kAuto);
  if (!adam.is_ok()) return state.SkipWithError(adam.status().to_string().c_str());
  const auto fused = ctx->arrays().args(n, DType::kF32, DType::kBF16);
  finish_tuning(*adam, fused);
  strata::device::AdamWArgs unfused = fused;
  unfused.param_out = nullptr;
  tbb::task_arena arena(threads);
  const auto separate = [&] {
    benchmark::DoNotOptimize(adam->step(unfused, false));
    arena.execute([&] {
      tbb::parallel_for(
          tbb::blocked_range<std::int64_t>(0, n, 1 << 15),
          [&](const tbb::blocked_range<std::int64_t>& r) {
            cast_to_bf16(static_cast<const float*>(fused.param) + r.begin(),
                         static_cast<std::uint16_t*>(fused.param_out) + r.begin(), r.size());
          },
          tbb::static_partitioner());
    });
  };
  const PairTimes t = run_pairs(
      state, [&] { benchmark::DoNotOptimize(adam->step(fused, false)); }, separate);
  set_rate_counters(state, t, n, bytes_per_elem(DType::kF32, DType::kBF16));
  state.counters["fused_speedup"] = t.median_b_over_a();
}

// STREAM triad a = b + s * c (f32, 12 bytes per element counted), paired with the Adam roofline.
void bm_triad(benchmark::State& state, Context* ctx, std::int64_t n, int threads) {
  auto adam = make_adam(threads, "auto", Stores::kAuto);
  if (!adam.is_ok()) return state.SkipWithError(adam.status().to_string().c_str());
  Arrays& arr = ctx->arrays();
  const auto args = arr.args(n, DType::kF32, DType::kBF16);
  finish_tuning(*adam, args);
  auto* a = reinterpret_cast<float*>(arr.out());
  const float* b = arr.grad_f32();
  const float* c = arr.exp_avg();
  tbb::task_arena arena(threads);
  const auto triad = [&] {
    arena.execute([&] {
      tbb::parallel_for(
          tbb::blocked_range<std::int64_t>(0, n, 1 << 15),
          [&](const tbb::blocked_range<std::int64_t>& r) {
            for (std::int64_t i = r.begin(); i < r.end(); ++i) a[i] = b[i] + 0.5f * c[i];
          },
          tbb::static_partitioner());
    });
  };
  const PairTimes t = run_pairs(state, triad, [&] { adam->memory_roofline(args); });
  set_rate_counters(state, t, n, 12.0);
  state.counters["roofline_GBps"] =
      bytes_per_elem(DType::kF32, DType::kBF16) * static_cast<double>(n) * t.n / t.b_s / 1e9;
}

// ---- NVMe-streamed step vs the same I/O alone ----

// Segment s's master, exp_avg and exp_avg_sq: homes[3s .. 3s+2], held open for ranged I/O.
struct StoreStorage final : strata::optim::SegmentStorage {
  explicit StoreStorage(strata::mem::TieredStore& s) : store(s) {}
  strata::io::IoHandle read(std::size_t segment, strata::optim::StreamedArray array,
                            std::uint64_t offset, void* dst, std::size_t bytes) override {
    return store.read_range(home(segment, array), offset, dst, bytes);
  }
  strata::io::IoHandle write(std::size_t segment, strata::optim::StreamedArray array,
                             std::uint64_t offset, const void* src, std::size_t bytes) override {
    return store.write_range(home(segment, array), offset, src, bytes);
  }
  strata::mem::Handle home(std::size_t segment, strata::optim::StreamedArray array) const {
    return homes.at(segment * 3 + static_cast<std::size_t>(array));
  }
  strata::mem::TieredStore& store;
  std::vector<strata::mem::Handle> homes;
};

// ratio_to_io = streamed step time / the same reads and writes alone (target <= 1.10).
void bm_streamed(benchmark::State& state, std::int64_t total_params, std::int64_t sub_group,
                 const char* engine) {
  constexpr int kSegments = 4;
  const std::int64_t seg_elems = total_params / kSegments;
  const std::string dir =
      (std::filesystem::temp_directory_path() / "strata-adam-bench-swap").string();
  std::filesystem::create_directories(dir);
  strata::io::SwapOptions so;
  so.paths = {dir};
  so.engine = *strata::io::parse_swap_engine(engine);
  auto swap = strata::io::SwapSpace::create(so);
  if (!swap.is_ok()) return state.SkipWithError(swap.status().to_string().c_str());
  auto adam = make_adam(0, "auto", Stores::kAuto);
  if (!adam.is_ok()) return state.SkipWithError(adam.status().to_string().c_str());
  strata::optim::StreamedAdamOptions opts;
  opts.sub_group_size = sub_group;
  opts.max_segment_elems = seg_elems;
  opts.check_finite = false;
  // STRATA_BENCH_STAGING_SETS tries other read-ahead depths without a rebuild.
  if (const char* sets = std::getenv("STRATA_BENCH_STAGING_SETS"))
    opts.num_buffers = std::atoi(sets);
  // The state in a tiered store's NVMe homes, streamed through its range staging (registered
  // with the swap space with the rest of its pool): the optimizer step's own path. The staging
  // holds two sets, the streamed step's and the I/O-only side's.
  auto device = strata::device::create_device(strata::device::DeviceOptions{});
  if (!device.is_ok()) return state.SkipWithError(device.status().to_string().c_str());
  const std::size_t staging = strata::optim::StreamedAdam::staging_bytes_for(opts);
  strata::mem::StoreOptions store_options;
  store_options.range_io_bytes = 2 * staging;
  auto store = strata::mem::TieredStore::create(**device, swap->get(), store_options);
  if (!store.is_ok()) return state.SkipWithError(store.status().to_string().c_str());
  const std::span<std::byte> ranges = (*store)->range_staging();
  auto streamed = strata::optim::StreamedAdam::create(*adam, opts, ranges.first(staging));
  if (!streamed.is_ok()) return state.SkipWithError(streamed.status().to_string().c_str());
  strata::optim::StreamedAdamOptions io_opts = opts;
  io_opts.update = false;  // the same pipeline and I/O, without the update
  auto io_only = strata::optim::StreamedAdam::create(*adam, io_opts, ranges.subspan(staging));
  if (!io_only.is_ok()) return state.SkipWithError(io_only.status().to_string().c_str());

  // Host gradient and output; NVMe state initialized from a filled buffer.
  std::vector<float> grad(static_cast<std::size_t>(seg_elems), 1e-3f);
  std::vector<std::uint16_t> out(static_cast<std::size_t>(seg_elems));
  strata::AlignedBuffer init(static_cast<std::size_t>(seg_elems) * 4, strata::io::kIoAlignBytes);
  std::fill_n(init.as<float>(), seg_elems, 0.5f);
  StoreStorage storage(**store);
  std::vector<strata::optim::StreamedSegment> segs;
  for (int s = 0; s < kSegments; ++s) {
    for (int k = 0; k < 3; ++k) {
      strata::mem::TensorSpec spec;
      spec.name = "bench state " + std::to_string(s) + "." + std::to_string(k);
      spec.size_bytes = static_cast<std::uint64_t>(seg_elems) * 4;
      spec.home = strata::Tier::kNvme;
      auto h = (*store)->add(spec);
      if (!h.is_ok()) return state.SkipWithError(h.status().to_string().c_str());
      if (!(*store)->write(*h, init.data(), init.size()).is_ok()) {
        return state.SkipWithError("initial NVMe write failed");
      }
      if (!(*store)->open_ranges(*h).is_ok()) return state.SkipWithError("open_ranges failed");
      storage.homes.push_back(*h);
    }
    strata::optim::StreamedSegment seg;
    seg.name = "bench";
    seg.grad = grad.data();
    seg.num_elems = seg_elems;
    seg.param_out = out.data();
    seg.out_dtype = DType::kBF16;
    segs.push_back(seg);
  }
  strata::device::AdamWArgs hyper;
  hyper.lr = 1e-3f;
  hyper.step = 3;
  double compute_s = 0, io_wait_s = 0;
  const PairTimes t = run_pairs(
      state,
      [&] {
        auto r = streamed->step(segs, storage, hyper);
        STRATA_CHECK(r.is_ok(), r.status().to_string());
        compute_s += r->compute_s;
        io_wait_s += r->io_wait_s;
      },
      [&] {
        auto r = io_only->step(segs, storage, hyper);
        STRATA_CHECK(r.is_ok(), r.status().to_string());
      });
  const double io_bytes = 24.0 * static_cast<double>(total_params);
  state.counters["GBps"] = io_bytes * t.n / t.a_s / 1e9;
  state.counters["io_only_GBps"] = io_bytes * t.n / t.b_s / 1e9;
  state.counters["ratio_to_io"] = 1.0 / t.median_b_over_a();
  state.counters["compute_share"] = compute_s / t.a_s;  // of the streamed step's time
  state.counters["io_wait_share"] = io_wait_s / t.a_s;
  state.SetLabel((*swap)->engine_name());
  for (const strata::mem::Handle h : storage.homes) (*store)->close_ranges(h, true, true);
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  Context ctx;
  std::vector<int> thread_counts = {1, 2};
  if (ctx.all_threads > 2) thread_counts.push_back(ctx.all_threads);
  const auto thread_name = [&](int t) {
    return t == ctx.all_threads ? std::to_string(t) + "(all)" : std::to_string(t);
  };
  for (std::int64_t n : {64 * kMega, 256 * kMega}) {
    const std::string size = std::to_string(n / kMega) + "M";
    for (DType g : {DType::kF32, DType::kBF16}) {
      for (int t : thread_counts) {
        const std::string name = "Adam/" + std::string(strata::dtype_name(g)) + "_grad_bf16_out/" +
                                 size + "/threads:" + thread_name(t);
        benchmark::RegisterBenchmark(name.c_str(), bm_adam, &ctx, g, n, t, false)
            ->UseManualTime()
            ->Iterations(n > 64 * kMega ? 7 : 15)
            ->Unit(benchmark::kMillisecond);
      }
    }
  }
  {
    using strata::device::MasterRounding;
    struct Compact {
      const char* name;
      DType master;
      MasterRounding rounding;
      DType moments;
    };
    const DType kInt8 = strata::device::kAdam8StateDType;
    for (const Compact c :
         {Compact{"fp32", DType::kF32, MasterRounding::kStochastic, DType::kF32},
          Compact{"bf16_moments", DType::kF32, MasterRounding::kStochastic, DType::kBF16},
          Compact{"int8_moments", DType::kF32, MasterRounding::kStochastic, kInt8},
          Compact{"int8_moments_bf16_kahan", DType::kBF16, MasterRounding::kKahan, kInt8},
          Compact{"int8_moments_bf16_stochastic", DType::kBF16, MasterRounding::kStochastic,
                  kInt8}}) {
      const int t = ctx.all_threads;
      const std::string name = std::string("AdamCompactStates/") + c.name +
                               "/bf16_grad_bf16_out/64M/threads:" + thread_name(t);
      benchmark::RegisterBenchmark(name.c_str(), bm_adam_compact, &ctx, 64 * kMega, t, c.master,
                                   c.rounding, c.moments)
          ->UseManualTime()
          ->Iterations(9)
          ->Unit(benchmark::kMillisecond);
    }
  }
  {
    const int t = ctx.all_threads;
    const std::string name = "AdamArithmeticFloor/bf16_grad_bf16_out/64M/threads:" + thread_name(t);
    benchmark::RegisterBenchmark(name.c_str(), bm_adam_arithmetic, &ctx, 64 * kMega, t)
        ->UseManualTime()
        ->Iterations(9)
        ->Unit(benchmark::kMillisecond);
  }
  for (int t : thread_counts) {
    const std::string name = "AdamCongruentArrays/f32_grad_bf16_out/64M/threads:" + thread_name(t);
    benchmark::RegisterBenchmark(name.c_str(), bm_adam, &ctx, DType::kF32, 64 * kMega, t, true)
        ->UseManualTime()
        ->Iterations(15)
        ->Unit(benchmark::kMillisecond);
  }
  for (int t : thread_counts) {
    const std::string tn = "/64M/threads:" + thread_name(t);
    benchmark::RegisterBenchmark(("AdamFiniteCheck/f32_grad_bf16_out" + tn).c_str(),
                                 bm_adam_checked, &ctx, 64 * kMega, t)
        ->UseManualTime()
        ->Iterations(15)
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark(("NontemporalVsRegular/f32_grad_bf16_out" + tn).c_str(),
                                 bm_nontemporal, &ctx, 64 * kMega, t)
        ->UseManualTime()
        ->Iterations(15)
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark(("SimdVsScalar/f32_grad_bf16_out" + tn).c_str(), bm_scalar_vs_simd,
                                 &ctx, 64 * kMega, t)
        ->UseManualTime()
        ->Iterations(7)
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark(("FusedVsSeparateCast/f32_grad_bf16_out" + tn).c_str(),
                                 bm_fused_vs_separate_cast, &ctx, 64 * kMega, t)
        ->UseManualTime()
        ->Iterations(15)
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark(("StreamTriad" + tn).c_str(), bm_triad, &ctx, 64 * kMega, t)
        ->UseManualTime()
        ->Iterations(15)
        ->Unit(benchmark::kMillisecond);
  }
  struct StreamedCase {
    std::int64_t sub;
    const char* engine;
  };
  // Short passes, many pairs: the shared disk's bursts then spoil single pairs, not the median.
  for (const StreamedCase c : {StreamedCase{1 * kMega, "uring"}, StreamedCase{2 * kMega, "uring"},
                               StreamedCase{2 * kMega, "posix"}}) {
    const std::string name =
        "StreamedAdamVsIoOnly/16M/sub_group:" + std::to_string(c.sub / kMega) + "M/" + c.engine;
    benchmark::RegisterBenchmark(name.c_str(), bm_streamed, 16 * kMega, c.sub, c.engine)
        ->UseManualTime()
        ->Iterations(25)
        ->Unit(benchmark::kMillisecond);
  }
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
