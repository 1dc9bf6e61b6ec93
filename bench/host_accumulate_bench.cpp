// Host-side gradient accumulation (device::HostArrays::accumulate: acc += widen(grad) and the sum
// of squares of the result, one pass) against the memory system: each case is timed in
// alternating pairs with a plain read-add-write loop over the same arrays, the same threads and
// the same partition (acc[i] += grad[i], no sum), and reports the ratio of their bytes/s, pair by
// pair (median). Also the scalar reference the engine used before (strata::convert in blocks,
// an add, the chunked sum_squares_chunk, one thread) for the record.
//
// This machine's memory bandwidth changes mode every few tens of seconds, so only ratios from
// pairs run back to back mean anything; absolute GB/s are indicative. Buffers are allocated and
// pre-faulted once and reused.
//
//   build/bench/bench_host_accumulate --benchmark_counters_tabular=true
#include <benchmark/benchmark.h>
#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/parallel_for.h>
#include <oneapi/tbb/partitioner.h>
#include <oneapi/tbb/task_arena.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "strata/core/check.h"
#include "strata/core/dtype.h"
#include "strata/device/host_arrays.h"

namespace {

using strata::DType;

constexpr std::int64_t kElems = std::int64_t{64} << 20;  // 256 MiB of fp32 sums: far past caches
constexpr std::int64_t kChunk = static_cast<std::int64_t>(strata::kSumSquaresChunkElems);

double seconds_of(const auto& fn) {
  const auto t0 = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

struct Buffers {
  std::unique_ptr<float[]> acc{new float[kElems]};
  std::unique_ptr<float[]> grad32{new float[kElems]};
  std::unique_ptr<std::uint16_t[]> grad16{new std::uint16_t[kElems]};
  Buffers() {
    // Small positive values: repeated adds stay finite and normal.
    for (std::int64_t i = 0; i < kElems; ++i) {
      acc[i] = 1.0f + static_cast<float>(i % 977) * 1e-3f;
      grad32[i] = 1e-6f * static_cast<float>(i % 131);
      grad16[i] = strata::f32_to_bf16(grad32[i]).bits;
    }
  }
  const void* grad(DType d) const {
    return d == DType::kF32 ? static_cast<const void*>(grad32.get()) : grad16.get();
  }
};

Buffers& buffers() {
  static Buffers b;
  return b;
}

// The roofline: acc[i] += grad[i] widened, in the HostArrays chunks over an arena of the same
// size. The compiler vectorizes these loops; nothing else is done with the data.
void read_add_write(tbb::task_arena& arena, float* acc, const void* grad, DType dtype,
                    std::int64_t n) {
  arena.execute([&] {
    tbb::parallel_for(tbb::blocked_range<std::int64_t>(0, (n + kChunk - 1) / kChunk, 1),
                      [&](const tbb::blocked_range<std::int64_t>& r) {
                        for (std::int64_t c = r.begin(); c < r.end(); ++c) {
                          const std::int64_t i0 = c * kChunk, i1 = std::min(n, i0 + kChunk);
                          if (dtype == DType::kF32) {
                            const float* g = static_cast<const float*>(grad);
                            for (std::int64_t i = i0; i < i1; ++i) acc[i] += g[i];
                          } else {
                            const auto* g = static_cast<const std::uint16_t*>(grad);
                            for (std::int64_t i = i0; i < i1; ++i) {
                              acc[i] += std::bit_cast<float>(std::uint32_t{g[i]} << 16);
                            }
                          }
                        }
                      });
  });
}

// The engine's accumulation before HostArrays: widen a block with strata::convert, add, and sum
// each chunk with sum_squares_chunk; one thread.
double scalar_accumulate(float* acc, const void* grad, DType dtype, std::int64_t n) {
  constexpr std::int64_t kBlock = 4096;
  float wide[kBlock];
  double squares = 0;
  for (std::int64_t i = 0; i < n; i += kBlock) {
    const std::int64_t m = std::min(kBlock, n - i);
    strata::convert(static_cast<const std::byte*>(grad) + i * strata::dtype_size(dtype), dtype,
                    wide, DType::kF32, static_cast<std::size_t>(m));
    for (std::int64_t j = 0; j < m; ++j) acc[i + j] += wide[j];
    if ((i + m) % kChunk == 0 || i + m == n) {
      const std::int64_t begin = (i + m - 1) / kChunk * kChunk;
      squares += strata::sum_squares_chunk(acc + begin, DType::kF32,
                                           static_cast<std::size_t>(i + m - begin));
    }
  }
  return squares;
}

// args: grad dtype (0 f32, 1 bf16), threads
void BM_Accumulate(benchmark::State& state) {
  const DType dtype = state.range(0) == 0 ? DType::kF32 : DType::kBF16;
  const int threads = static_cast<int>(state.range(1));
  strata::device::HostArrayOptions o;
  o.threads = threads;
  auto arrays = strata::device::HostArrays::create(o);
  STRATA_CHECK(arrays.is_ok(), arrays.status().to_string());
  tbb::task_arena arena(threads);
  Buffers& b = buffers();
  const std::int64_t n = kElems;
  const double bytes =
      static_cast<double>(n) * (8.0 + static_cast<double>(strata::dtype_size(dtype)));
  // Verify before timing: the kernel's sum is the reference's on the same data.
  {
    std::vector<float> check(b.acc.get(), b.acc.get() + (kChunk * 3 + 17));
    std::vector<float> want = check;
    const auto len = static_cast<std::int64_t>(check.size());
    const double got =
        arrays->accumulate(check.data(), b.grad(dtype), dtype, len, false, len).value();
    const double ref = scalar_accumulate(want.data(), b.grad(dtype), dtype,
                                         static_cast<std::int64_t>(want.size()));
    STRATA_CHECK(std::memcmp(check.data(), want.data(), check.size() * 4) == 0,
                 "accumulate differs from the reference");
    STRATA_CHECK(std::fabs(got - ref) <= 1e-9 * ref, "sum of squares far from the reference", got,
                 ref);
  }
  std::vector<double> ratios;
  double kernel_s = 0, roof_s = 0;
  for (auto _ : state) {
    const auto kernel = [&] {
      benchmark::DoNotOptimize(
          arrays->accumulate(b.acc.get(), b.grad(dtype), dtype, n, false, n).limbs[0]);
    };
    const auto roof = [&] { read_add_write(arena, b.acc.get(), b.grad(dtype), dtype, n); };
    // A B then B A: each pair sees the same memory mode on average.
    const bool kernel_first = ratios.size() % 2 == 0;
    const double t1 = seconds_of(kernel_first ? std::function<void()>(kernel) : roof);
    const double t2 = seconds_of(kernel_first ? std::function<void()>(roof) : kernel);
    const double tk = kernel_first ? t1 : t2, tr = kernel_first ? t2 : t1;
    kernel_s += tk;
    roof_s += tr;
    ratios.push_back(tr / tk);
    state.SetIterationTime(tk);
  }
  std::sort(ratios.begin(), ratios.end());
  const auto iters = static_cast<double>(state.iterations());
  state.counters["kernel_GBps"] = bytes * iters / kernel_s / 1e9;
  state.counters["roofline_GBps"] = bytes * iters / roof_s / 1e9;
  state.counters["ratio_to_roofline"] = ratios[ratios.size() / 2];
  state.counters["ratio_min"] = ratios.front();
  state.counters["ratio_max"] = ratios.back();
  state.SetLabel(std::string(strata::dtype_name(dtype)) + " grad, " + std::to_string(threads) +
                 " threads, " + std::string(strata::sys::simd_path_name(arrays->simd())));
}
BENCHMARK(BM_Accumulate)
    ->ArgsProduct({{0, 1}, {1, 2}})
    ->UseManualTime()
    ->Iterations(10)
    ->Unit(benchmark::kMillisecond);

// The engine's accumulation before: GB/s of the same bytes, one thread, scalar reference.
void BM_AccumulateScalarBefore(benchmark::State& state) {
  const DType dtype = state.range(0) == 0 ? DType::kF32 : DType::kBF16;
  Buffers& b = buffers();
  const double bytes =
      static_cast<double>(kElems) * (8.0 + static_cast<double>(strata::dtype_size(dtype)));
  for (auto _ : state) {
    benchmark::DoNotOptimize(scalar_accumulate(b.acc.get(), b.grad(dtype), dtype, kElems));
  }
  state.counters["GBps"] = benchmark::Counter(bytes * static_cast<double>(state.iterations()) / 1e9,
                                              benchmark::Counter::kIsRate);
  state.SetLabel(std::string(strata::dtype_name(dtype)) + " grad, 1 thread, scalar");
}
BENCHMARK(BM_AccumulateScalarBefore)->Arg(0)->Arg(1)->Iterations(3)->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
